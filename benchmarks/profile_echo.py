"""Where Conveyor's CPU goes under echo load, per process (frontend, worker). Not a test.

    python benchmarks/profile_echo.py --mode cpu [--batch-size 1 8] [--tree DIR_A DIR_B] [--rounds 3]
    python benchmarks/profile_echo.py --mode spy [--batch-size 8] [--concurrency 16] [--keep DIR]

Starts Conveyor as ``benchmarks/compare.py`` does (the TorchServe-style echo archive, one worker per
model) and drives it with wrk.

* ``cpu``: microseconds of CPU (user + system, from /proc) per answered request, for the frontend
  and for the worker. Unlike req/s this barely moves with the load other jobs put on a shared
  machine, so it is the measure for a hot-path change: give ``--tree`` a copy of the code from
  before the change and this tree; runs alternate between them and the ratios are printed.
* ``spy``: ``py-spy record --format raw --nonblocking`` on both processes (``pip install py-spy``);
  prints the busy share and the functions with the most samples, inclusive and self. py-spy counts a
  process preempted inside a syscall as busy there, so on an oversubscribed machine socket writes
  look heavier than their CPU cost. ``--keep DIR`` keeps the collapsed stacks (flamegraph.pl and
  speedscope read them).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import REPO, WRK_SCRIPT, Conveyor, _http, build_archive, find_torchserve, run_wrk  # noqa: E402

RATE = 250  # samples per second


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def summarise(raw: Path, seconds: float, top: int, title: str) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith("process ") and not f.startswith("thread ")]
        total += count
        if frames:
            self_time[_short(frames[-1])] += count
        for name in {_short(f) for f in frames}:
            inclusive[name] += count
    busy = 100.0 * total / max(1.0, seconds * RATE)
    print(f"\n== {title}: {total} busy samples, busy {busy:.0f}% of the time (py-spy, {RATE}/s)")
    for label, counter in (("inclusive", inclusive), ("self", self_time)):
        print(f"-- {label}")
        for name, count in counter.most_common(top):
            print(f"{100.0 * count / max(total, 1):6.1f}%  {name}")


def _short(frame: str) -> str:
    """``func (path/to/module.py:123)`` → ``func (module.py:123)``; site-packages paths shortened."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, lineno = where.rpartition(":")
    parts = Path(path).parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    elif len(parts) > 2:
        parts = parts[-2:]
    return f"{name} ({'/'.join(parts)}:{lineno})" if where else name


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def start(name: str, root: Path, store: Path, tree: Path, batch_sizes: list[int]) -> tuple[Conveyor, dict[int, int]]:
    """A running Conveyor from ``tree`` with echo_b<N> registered; returns it and each model's worker pid."""
    server = Conveyor(name, root, store, tree.resolve())
    server.launch([])
    server.wait_started()
    pids = {}
    for batch_size in batch_sizes:
        model = f"echo_b{batch_size}"
        server.register(model, batch_size)
        _, text = _http("GET", f"{server.base('management')}/models/{model}")
        pids[batch_size] = json.loads(text)[0]["workers"][0]["pid"]
    return server, pids


def cpu_per_request(args: argparse.Namespace, root: Path, store: Path, script: Path) -> None:
    """Per tree, µs of CPU per request of the frontend and of the worker, rounds interleaved."""
    trees = args.tree or [REPO]
    servers = [start(f"t{i}", root, store, tree, args.batch_size) for i, tree in enumerate(trees)]
    try:
        print(f"wrk -c {args.concurrency}, {args.duration} s per run, {args.rounds} rounds, trees interleaved; "
              "CPU = user + system from /proc, per request answered")
        print(f"{'batchSize':>9} {'tree':40} {'req/s':>7} {'frontend us/req':>16} {'worker us/req':>14}")
        for batch_size in args.batch_size:
            totals: list[list[tuple[float, float]]] = [[] for _ in trees]
            for _ in range(args.rounds):
                for i, (server, pids) in enumerate(servers):
                    url = server.url(f"echo_b{batch_size}")
                    run_wrk(url, args.concurrency, 1, script)  # warm-up
                    assert server.proc is not None
                    watched = (server.proc.pid, pids[batch_size])
                    before = [sum(cpu_seconds(pid)) for pid in watched]
                    result = run_wrk(url, args.concurrency, args.duration, script)
                    used = [sum(cpu_seconds(pid)) - b for pid, b in zip(watched, before)]
                    n = max(1.0, result.rps * args.duration)
                    totals[i].append((1e6 * used[0] / n, 1e6 * used[1] / n, result.rps))  # type: ignore[arg-type]
                    time.sleep(0.5)
            for i, tree in enumerate(trees):
                runs = totals[i]
                front = statistics.fmean(r[0] for r in runs)
                back = statistics.fmean(r[1] for r in runs)
                rps = statistics.fmean(r[2] for r in runs)  # type: ignore[misc]
                ratio = ""
                if i > 0:
                    base_front = statistics.fmean(r[0] for r in totals[0])
                    base_back = statistics.fmean(r[1] for r in totals[0])
                    ratio = f"   vs first tree: frontend x{front / base_front:.2f}, worker x{back / base_back:.2f}"
                print(f"{batch_size:>9} {str(tree)[-40:]:40} {rps:7.0f} {front:16.0f} {back:14.0f}{ratio}", flush=True)
    finally:
        for server, _ in servers:
            server.stop()


def spy_profile(args: argparse.Namespace, root: Path, store: Path, script: Path) -> None:
    spy = py_spy()
    batch_size = args.batch_size[0]
    server, pids = start("conveyor", root, store, (args.tree or [REPO])[0], [batch_size])
    try:
        url = server.url(f"echo_b{batch_size}")
        run_wrk(url, args.concurrency, 2, script)  # warm-up
        out = args.keep or root
        out.mkdir(parents=True, exist_ok=True)
        assert server.proc is not None
        spies = [subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(RATE), "--duration",
                                   str(args.duration), "--nonblocking", "--format", "raw", "-o", str(out / f"{name}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, pid in (("frontend", server.proc.pid), ("worker", pids[batch_size]))]
        time.sleep(0.5)  # py-spy attaches
        result = run_wrk(url, args.concurrency, args.duration, script)
        for spy_proc in spies:
            spy_proc.wait(60)
        print(f"batchSize {batch_size}, concurrency {args.concurrency}: {result.rps:.0f} req/s under the profiler, "
              f"p50 {result.p50:.2f} ms, p99 {result.p99:.2f} ms, errors {result.errors}")
        for name in ("frontend", "worker"):
            summarise(out / f"{name}.txt", args.duration, args.top, name)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu", "spy"], default="spy")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[8], help="spy: the first only")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10, help="seconds of load (and of sampling)")
    parser.add_argument("--rounds", type=int, default=3, help="cpu: runs per tree and batch size")
    parser.add_argument("--top", type=int, default=30, help="spy: functions listed")
    parser.add_argument("--tree", type=Path, nargs="+", help="Conveyor source tree(s) to run (default: this one); "
                        "cpu mode compares every tree with the first")
    parser.add_argument("--keep", type=Path, help="spy: directory for the raw py-spy output")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="conveyor-profile-"))
    store = root / "store"
    store.mkdir()
    build_archive(store, find_torchserve())
    script = root / "post.lua"
    script.write_text(WRK_SCRIPT)
    try:
        if args.mode == "cpu":
            cpu_per_request(args, root, store, script)
        else:
            spy_profile(args, root, store, script)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
