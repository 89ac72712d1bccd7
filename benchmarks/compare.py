"""Conveyor vs TorchServe, side by side: echo req/s, p50 and p99, and cold start. Not a test.

    python benchmarks/compare.py [--duration 5] [--rounds 2] [--concurrency 1 16 64] [--batch-sizes 1 8]
                                 [--servers conveyor torchserve [aiohttp] [baseline]] [--baseline-tree DIR]
                                 [--cold-starts 2] [--no-load] [--write-docs]
    python benchmarks/compare.py --llm [--llm-models tiny,27m] [--rounds 2] [--write-docs]

* ONE archive: ``benchmarks/ts_echo_handler.py`` (TorchServe-style, imports neither server) packed by
  TorchServe's own ``torch-model-archiver``. Each server registers it twice through its management
  API, ``echo_b1`` (batchSize 1) and ``echo_b8`` (batchSize 8, maxBatchDelay 5 ms), one worker each.
* Both servers run at once on free loopback ports with token auth off and the model API on;
  TorchServe with its own config.properties (``disable_system_metrics``: no periodic metrics
  process), a log4j2 config at WARN and ``--ncs``, in a temporary directory (model store and logs).
* Load: ``wrk`` (threads = min(connections, 2)), POST of a small JSON body. For every cell
  (batchSize × concurrency) the servers take turns, A, B, A, B (``--rounds``); each turn is a
  discarded warm-up, the measured run and a pause. Before the first cell every server/model gets a
  longer warm-up (TorchServe's JIT). Only ratios from one run mean anything on a shared machine:
  the table gives the ratio of the means and, in brackets, the range of the per-round ratios.
* Cold start: launch → ``Model server started`` on Conveyor's stdout (``python -m frontend.cli start
  --foreground``, i.e. ``conveyor start --foreground``, with ``--models echo=echo.mar``); for
  TorchServe, launch → its describe API shows the echo worker READY (for context).
* ``--baseline-tree DIR`` adds "baseline": Conveyor run from another source tree (a copy taken before
  a change), to measure a hot-path change as a ratio in the same interleaved run.
* ``--servers ... aiohttp`` adds a bare aiohttp echo app (``BARE_AIOHTTP``: no middleware, no worker,
  no batching): the ceiling of any aiohttp-based frontend on the same machine, for context.
* ``--llm`` runs the LLM comparison instead: Conveyor vs ``transformers serve --continuous-batching``
  (bounded cache) on the same tiny model, tokens/s and time to first token (benchmarks/compare_llm.py;
  ``--llm-models tiny,27m``, ``--transformers-python``); with ``--write-docs`` it fills its own block.
* ``--write-docs`` replaces the generated block of the "Conveyor vs TorchServe" section of
  docs/benchmarks.md (between the ``compare.py`` markers) and leaves every other section alone.

TorchServe is looked up as ``$TS_BIN/torchserve``, ``/work/ts-venv/bin/torchserve``, then on PATH;
its workers run on that venv's python (its bin directory goes first on PATH).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_llm  # noqa: E402
from echo_load import WRK_SCRIPT, _wrk_ms, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HANDLER = REPO / "benchmarks" / "ts_echo_handler.py"
DOCS = REPO / "docs" / "benchmarks.md"
SECTION = "## Conveyor vs TorchServe"
BEGIN, END = "<!-- compare.py: begin generated block -->", "<!-- compare.py: end generated block -->"
LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders><Console name="STDERR" target="SYSTEM_ERR"><PatternLayout pattern="%d [%-5p] %t %c - %m%n"/></Console></Appenders>
  <Loggers><Root level="warn"><AppenderRef ref="STDERR"/></Root></Loggers>
</Configuration>
"""


@dataclass
class Run:
    rps: float
    p50: float  # ms
    p99: float  # ms
    errors: int  # non-2xx responses + socket errors


@dataclass
class Cell:
    batch_size: int
    concurrency: int
    runs: dict[str, list[Run]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ servers


def _wait_line(proc: subprocess.Popen, text: str, timeout: float) -> float | None:
    """perf_counter() when a stdout line containing ``text`` arrived; None on EOF or timeout."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.perf_counter() + timeout
    try:
        while (left := deadline - time.perf_counter()) > 0:
            if not sel.select(left):
                continue
            line = proc.stdout.readline()
            if not line:
                return None
            if text in line:
                return time.perf_counter()
        return None
    finally:
        sel.close()


def _http(method: str, url: str, timeout: float = 60.0) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    """One server under test, in its own directory with its own free ports."""

    label = ""

    def __init__(self, name: str, root: Path, store: Path) -> None:
        self.name = name
        self.root = root / name
        self.root.mkdir()
        self.store = store
        self.ports = {key: free_port() for key in ("inference", "management", "metrics", "grpc_inf", "grpc_mgmt")}
        self.proc: subprocess.Popen | None = None

    def base(self, api: str) -> str:
        return f"http://127.0.0.1:{self.ports[api]}"

    def config_lines(self) -> list[str]:
        return [f"{api}_address={self.base(api)}" for api in ("inference", "management", "metrics")] + [
            f"grpc_inference_port={self.ports['grpc_inf']}", f"grpc_management_port={self.ports['grpc_mgmt']}",
            f"model_store={self.store}", "disable_token_authorization=true", "enable_model_api=true",
            "default_workers_per_model=1"]

    def command(self, models: list[str]) -> tuple[list[str], dict[str, str], Path]:
        raise NotImplementedError

    def version(self) -> str:
        raise NotImplementedError

    def launch(self, models: list[str]) -> float:
        """Start the process; returns perf_counter() at launch."""
        cmd, env, cwd = self.command(models)
        log = (self.root / "server.log").open("ab")
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return started

    def wait_started(self, timeout: float = 120.0) -> float:
        assert self.proc is not None
        at = _wait_line(self.proc, "Model server started", timeout)
        if at is None:
            self.stop()
            raise SystemExit(f"{self.name} did not start; see {self.root / 'server.log'}")
        return at

    def wait_model_ready(self, model: str, timeout: float = 120.0) -> float:
        """perf_counter() when the describe API shows a READY worker of ``model``."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:
                status, text = _http("GET", f"{self.base('management')}/models/{model}", timeout=2.0)
            except OSError:
                status, text = 0, ""
            if status == 200 and '"READY"' in text:
                return time.perf_counter()
            time.sleep(0.02)
        raise SystemExit(f"{self.name}: model {model} not ready within {timeout:g} s; see {self.root}")

    def register(self, model: str, batch_size: int) -> None:
        query = (f"url=echo.mar&model_name={model}&batch_size={batch_size}&max_batch_delay=5"
                 "&initial_workers=1&synchronous=true")
        status, text = _http("POST", f"{self.base('management')}/models?{query}", timeout=180.0)
        if status != 200:
            raise SystemExit(f"{self.name}: registering {model} failed ({status}): {text}")

    def url(self, model: str) -> str:
        return f"{self.base('inference')}/predictions/{model}"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # our own session: the launcher, the JVM, the workers
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
        try:  # workers that outlived their parent (same process group)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Conveyor(Server):
    label = "Conveyor"

    def __init__(self, name: str, root: Path, store: Path, tree: Path) -> None:
        super().__init__(name, root, store)
        self.tree = tree

    def command(self, models: list[str]) -> tuple[list[str], dict[str, str], Path]:
        config = self.root / "config.properties"
        config.write_text("\n".join(self.config_lines()) + "\n")
        cmd = [sys.executable, "-m", "frontend.cli", "start", "--foreground", "--ts-config", str(config),
               "--model-store", str(self.store), "--pid-file", str(self.root / "pid")]
        if models:
            cmd += ["--models", *models]
        # PYTHONPATH wins over the editable install, for the frontend and the workers it spawns.
        return cmd, {**os.environ, "PYTHONPATH": str(self.tree)}, self.tree

    def version(self) -> str:
        rev = subprocess.run(["git", "-C", str(self.tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(self.tree), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.strip()
        return f"Conveyor {rev or 'unknown'}{'+local changes' if dirty else ''}"


class TorchServe(Server):
    label = "TorchServe"

    def __init__(self, name: str, root: Path, store: Path, bin_dir: Path) -> None:
        super().__init__(name, root, store)
        self.bin_dir = bin_dir

    def command(self, models: list[str]) -> tuple[list[str], dict[str, str], Path]:
        config = self.root / "config.properties"
        config.write_text("\n".join(self.config_lines() + ["disable_system_metrics=true"]) + "\n")
        log4j = self.root / "log4j2.xml"
        log4j.write_text(LOG4J2)
        cmd = [str(self.bin_dir / "torchserve"), "--start", "--foreground", "--ncs", "--ts-config", str(config),
               "--log-config", str(log4j), "--model-store", str(self.store)]
        if models:
            cmd += ["--models", *models]
        env = {**os.environ, "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("PYTHONPATH", None)
        return cmd, env, self.root  # TorchServe writes logs/ under its working directory

    def version(self) -> str:
        out = subprocess.run([str(self.bin_dir / "python"), "-c", "import ts.version as v; print(v.__version__)"],
                             capture_output=True, text=True).stdout.strip()
        java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
        return f"TorchServe {out or '?'} on {java[0] if java else 'java ?'}"


# The ceiling of any aiohttp server on this machine: uvloop, no middleware, no access log, no worker
# process, no batching; the handler reads the body and answers it. Not a model server.
BARE_AIOHTTP = """
import asyncio, sys, uvloop
from aiohttp import web
async def echo(request):
    return web.Response(body=await request.read(), content_type="application/json")
async def main(port):
    app = web.Application()
    app.router.add_post("/predictions/{model}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("Model server started", flush=True)
    await asyncio.Event().wait()
uvloop.install()
asyncio.run(main(int(sys.argv[1])))
"""


class BareAiohttp(Server):
    """Reference, not a model server: what aiohttp + uvloop alone can answer here (see BARE_AIOHTTP)."""

    label = "bare aiohttp"

    def command(self, models: list[str]) -> tuple[list[str], dict[str, str], Path]:
        return [sys.executable, "-c", BARE_AIOHTTP, str(self.ports["inference"])], dict(os.environ), self.root

    def register(self, model: str, batch_size: int) -> None:
        return None

    def version(self) -> str:
        return "bare aiohttp (reference: one process, no model server work)"


def find_torchserve() -> Path | None:
    for candidate in (os.environ.get("TS_BIN"), "/work/ts-venv/bin"):
        if candidate and (Path(candidate) / "torchserve").exists():
            return Path(candidate)
    found = shutil.which("torchserve")
    return Path(found).parent if found else None


def build_archive(store: Path, ts_bin: Path | None) -> str:
    """echo.mar from the TorchServe-style handler, with torch-model-archiver when present."""
    archiver = ts_bin / "torch-model-archiver" if ts_bin else None
    if archiver is not None and archiver.exists():
        cmd = [str(archiver), "--model-name", "echo", "--version", "1.0", "--handler", str(HANDLER),
               "--export-path", str(store)]
        tool = "torch-model-archiver"
    else:  # same layout (MAR-INF/MANIFEST.json), from Conveyor's archiver
        cmd = [sys.executable, "-m", "frontend.cli", "archive", "--model-name", "echo", "--version", "1.0",
               "--handler", str(HANDLER), "--export-path", str(store)]
        tool = "conveyor archive"
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    return tool


# ------------------------------------------------------------------------------------------ load


def run_wrk(url: str, concurrency: int, duration: int, script: Path) -> Run:
    threads = max(1, min(concurrency, 2))  # two cores: more threads only fight the servers for them
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{duration}s", "--latency",
                          "-s", str(script), url], check=True, capture_output=True, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _wrk_ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _wrk_ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    return Run(rps, p50, p99, errors)


def measure(servers: list[Server], args: argparse.Namespace, script: Path) -> list[Cell]:
    for server in servers:  # JIT and caches: one longer warm-up per server and model, discarded
        for batch_size in args.batch_sizes if args.initial_warmup > 0 else ():
            run_wrk(server.url(f"echo_b{batch_size}"), 16, args.initial_warmup, script)
    cells = []
    for batch_size in args.batch_sizes:
        for concurrency in args.concurrency:
            cell = Cell(batch_size, concurrency, {s.name: [] for s in servers})
            for _ in range(args.rounds):
                for server in servers:  # A, B, A, B
                    url = server.url(f"echo_b{batch_size}")
                    if args.warmup > 0:
                        run_wrk(url, concurrency, args.warmup, script)
                    cell.runs[server.name].append(run_wrk(url, concurrency, args.duration, script))
                    time.sleep(args.pause)
            cells.append(cell)
            print(format_row(cell, servers), flush=True)
    return cells


def build_tiny_llm_archive(store: Path) -> str | None:
    """examples/tiny_llm's model as ``tiny_llm.mar`` in the store (the README's demo LLM)."""
    sys.path.insert(0, str(REPO / "examples" / "tiny_llm"))
    import build_tiny_llm

    model_dir = store.parent / "tiny_llm"
    build_tiny_llm.build(model_dir)
    return "tiny_llm.mar" if build_tiny_llm.archive(model_dir, store, "tiny_llm") is not None else None


def cold_starts(servers: list[Server], count: int, llm_archive: str | None = None) -> dict[str, list[float]]:
    """Seconds from launch to ready with the echo model, ``count`` times each, interleaved; and, for
    Conveyor, with the tiny LLM archive (``<name> (tiny LLM)``)."""
    times: dict[str, list[float]] = {s.name: [] for s in servers}
    for _ in range(count):
        for server in servers:
            if isinstance(server, BareAiohttp):
                continue
            models = [("", "echo=echo.mar")]
            if llm_archive is not None and isinstance(server, Conveyor):
                models.append((" (tiny LLM)", f"tiny_llm={llm_archive}"))
            for suffix, model in models:
                started = server.launch([model])
                try:
                    if isinstance(server, TorchServe):
                        ready = server.wait_model_ready("echo")
                    else:
                        ready = server.wait_started()
                    times.setdefault(server.name + suffix, []).append(ready - started)
                finally:
                    server.stop()
                time.sleep(1.0)
    return times


# ------------------------------------------------------------------------------------------ report


def _mean(runs: list[Run], attr: str) -> float:
    return statistics.fmean(getattr(r, attr) for r in runs)


def header(servers: list[Server]) -> str:
    cols = ["batchSize", "conc."]
    for s in servers:
        cols += [f"{s.name} req/s", "p50 ms", "p99 ms"]
    for s in servers[1:]:
        cols += [f"req/s {servers[0].name}/{s.name}", "p99 ratio"]
    cols.append("errors")
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(cell: Cell, servers: list[Server]) -> str:
    cols = [str(cell.batch_size), str(cell.concurrency)]
    for s in servers:
        runs = cell.runs[s.name]
        cols += [f"{_mean(runs, 'rps'):.0f}", f"{_mean(runs, 'p50'):.2f}", f"{_mean(runs, 'p99'):.2f}"]
    first = cell.runs[servers[0].name]
    for s in servers[1:]:
        other = cell.runs[s.name]
        per_round = [a.rps / b.rps for a, b in zip(first, other) if b.rps > 0]
        ratio = _mean(first, "rps") / max(_mean(other, "rps"), 1e-9)
        spread = f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else ""
        cols += [f"**{ratio:.2f}**{spread}", f"{_mean(first, 'p99') / max(_mean(other, 'p99'), 1e-9):.2f}"]
    cols.append("/".join(str(sum(r.errors for r in cell.runs[s.name])) for s in servers))
    return "| " + " | ".join(cols) + " |"


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu})"


def wrk_version() -> str:
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].split(" Copyright")[0] if text else "wrk"


def report(servers: list[Server], cells: list[Cell], starts: dict[str, list[float]], args: argparse.Namespace,
           tool: str, loads: tuple[str, str]) -> str:
    import aiohttp
    import uvloop

    lines = [
        f"Generated by `python benchmarks/compare.py {' '.join(sys.argv[1:])}` on "
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"- machine: {machine()}; load average before/after: {loads[0]} / {loads[1]} (shared with other jobs)",
        f"- versions: {'; '.join(s.version() for s in servers)}; Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}, uvloop {uvloop.__version__}; {wrk_version()}",
        f"- archive: `benchmarks/ts_echo_handler.py` packed by {tool}, registered as echo_b1 (batchSize 1) and "
        "echo_b8 (batchSize 8, maxBatchDelay 5 ms), 1 worker each",
        f"- load: wrk, POST `{{\"text\": \"hello conveyor\"}}` (application/json), threads = min(conc., 2); "
        f"{args.rounds} rounds per cell, servers interleaved; {args.warmup} s warm-up + {args.duration} s "
        f"measured + {args.pause:g} s pause per turn. Values are means over rounds; a ratio is "
        "mean/mean, with the per-round range in brackets; p99 ratio < 1 means Conveyor's tail is shorter.",
        "",
        header(servers),
        *(format_row(cell, servers) for cell in cells),
    ]
    if starts:
        lines += ["", "Cold start (s), launch → ready with the echo model (and, for Conveyor, with the tiny LLM "
                  "archive of examples/tiny_llm): Conveyor = `Model server started` on stdout; TorchServe = "
                  "describe API shows the worker READY (for context). Each value is one start, interleaved.", ""]
        for name, values in starts.items():
            if values:
                lines.append(f"- {name}: " + ", ".join(f"{v:.2f}" for v in values)
                             + f" (median {statistics.median(values):.2f})")
    return "\n".join(lines)


def write_docs(block: str) -> None:
    """Replace the generated block of our section; create the section (or the file) when absent."""
    generated = f"{BEGIN}\n{block}\n{END}"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + generated + rest.split(END, 1)[1]
    elif SECTION in text:
        head, rest = text.split(SECTION, 1)
        first_line, _, body = rest.partition("\n")
        text = f"{head}{SECTION}{first_line}\n\n{generated}\n{body}"
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{generated}\n"
    DOCS.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=5, help="measured seconds per turn (wrk: whole seconds)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded seconds before each turn (0: none)")
    parser.add_argument("--initial-warmup", type=int, default=4, help="discarded seconds per server and model")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between turns")
    parser.add_argument("--rounds", type=int, default=2, help="turns per server and cell (A, B, A, B)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--servers", nargs="+", default=["conveyor", "torchserve"],
                        choices=["conveyor", "torchserve", "baseline", "aiohttp"],
                        help="the first is A in every ratio; aiohttp = a bare aiohttp echo app (the HTTP layer alone: a ceiling)")
    parser.add_argument("--baseline-tree", type=Path, help="another Conveyor source tree, run as 'baseline'")
    parser.add_argument("--cold-starts", type=int, default=2, help="cold starts per server (0: skip)")
    parser.add_argument("--no-load", action="store_true", help="cold starts only")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.relative_to(REPO)}")
    parser.add_argument("--llm", action="store_true",
                        help="instead: the LLM comparison with transformers serve (benchmarks/compare_llm.py)")
    compare_llm.add_arguments(parser)
    args = parser.parse_args()
    if args.llm:
        return compare_llm.run(args)
    if not shutil.which("wrk") and not args.no_load:
        raise SystemExit("wrk is not on PATH (apt-get install -y wrk)")
    ts_bin = find_torchserve()
    names = list(dict.fromkeys(args.servers + (["baseline"] if args.baseline_tree and "baseline" not in args.servers else [])))
    if "torchserve" in names and ts_bin is None:
        print("TorchServe not found: comparing without it", file=sys.stderr)
        names.remove("torchserve")
    if "baseline" in names and args.baseline_tree is None:
        raise SystemExit("--servers baseline needs --baseline-tree")

    root = Path(tempfile.mkdtemp(prefix="conveyor-compare-"))
    store = root / "store"
    store.mkdir()
    tool = build_archive(store, ts_bin)
    script = root / "post.lua"
    script.write_text(WRK_SCRIPT)
    servers: list[Server] = []
    for name in names:
        if name == "conveyor":
            servers.append(Conveyor(name, root, store, REPO))
        elif name == "baseline":
            servers.append(Conveyor(name, root, store, args.baseline_tree.resolve()))
        elif name == "aiohttp":
            servers.append(BareAiohttp(name, root, store))
        else:
            servers.append(TorchServe(name, root, store, ts_bin))  # type: ignore[arg-type]
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cells: list[Cell] = []
    try:
        if not args.no_load:
            for server in servers:
                server.launch([])
                server.wait_started()
                for batch_size in args.batch_sizes:
                    server.register(f"echo_b{batch_size}", batch_size)
            print(header(servers), flush=True)
            cells = measure(servers, args, script)
            for server in servers:
                server.stop()
        starts = {}
        if args.cold_starts > 0:
            llm_archive = build_tiny_llm_archive(store) if any(isinstance(s, Conveyor) for s in servers) else None
            starts = cold_starts(servers, args.cold_starts, llm_archive)
    finally:
        for server in servers:
            server.stop()
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    block = report(servers, cells, starts, args, tool, (load_before, load_after))
    print()
    print(block)
    if args.write_docs:
        write_docs(block)
        print(f"\nwrote {DOCS}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
