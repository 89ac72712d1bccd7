"""Soak: many clients, disconnects and worker kills against one server; then no request lost, no state left.

    python benchmarks/soak.py                 # 10 minutes, 12 clients, one worker SIGKILL per minute
    python benchmarks/soak.py --short         # ~25 s, 6 clients, one kill (tests/integration/test_soak.py)
    python benchmarks/soak.py --duration 120 --clients 9 --json report.json --workdir /tmp/soak --keep

One server (tests/integration/server.py's ConveyorProcess: bounded waits, its process group killed on
stop) with three models built from the examples' handlers:

* ``echo`` — examples/echo, dynamic batching (batchSize 8). Clients send random bytes and expect them
  back; a few abandon their request after 0-5 ms (a client gone while its job is queued or running).
* ``streaming`` — examples/streaming, continuous batching (batchSize 8). Streams of 3-30 chunks;
  ``--disconnect-rate`` of them are closed by the client after a random number of chunks.
* ``running_sum`` — examples/stateful/sequence_continuous_batching, sequence + continuous batching,
  two workers. A client runs sessions: open (server-made or client-chosen id), a few actions (an even
  number, a stream of ten chunks — some disconnected mid-stream —, or a stream cut by a concurrent
  ``-1``), then end (``0``, or the end header on a last number). Sums are checked whenever the client
  can know them (after a disconnect it resynchronises on the next answer): benchmarks/soak_session.py.

One worker gets SIGKILL at (k + ½) minutes, the models in rotation (``--short``: one kill, halfway).

Each request ends as exactly one of: **ok** (the right answer, complete); **error** (an HTTP error or
an error chunk ending a stream, with TorchServe's JSON ``{"code", "type"}``: counted by kind);
**disconnected** (the client hung up on purpose); **wrong** (answered, but not the right answer);
**lost** — no answer within ``--deadline`` s, a connection closed or reset without an HTTP error, or a
stream that ended without its last chunk or an error chunk.

After the load, every client finishes its session, the server gets ``--quiet`` seconds, and
``GET /models/{m}?state=true`` is read for every model: the frontend's queues, the aggregators' jobs
(running, gathered, CANCELs owed), the streams being timed, the sequence table (open sequences, their
waiting and running jobs, ready lists, unreported failures) and, probed from every worker, its
``active`` table and the handler's ``num_live_requests`` / ``num_live_sequences``. **leaked** is their
sum; tombstones and stale deadline entries are bounded by design and only reported. A worker that does
not answer its probe counts as unverified. RSS (``/proc/<pid>/status``) of the frontend and of the
workers is read at the start and at the end (the frontend's also every 10 s, for the peak).

Exit status 1 if anything was lost, wrong, leaked or unverified; 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend.archiver import main as archive_main  # noqa: E402
from soak_session import JSON, STEP_MS, RunningSumSession  # noqa: E402
from tests.integration.server import EXAMPLES, ConveyorProcess  # noqa: E402

MODELS = ("echo", "streaming", "running_sum")
KILL_ROTATION = ("running_sum", "streaming", "echo")

HANDLERS = {
    "echo": EXAMPLES / "echo" / "echo_handler.py",
    "streaming": EXAMPLES / "streaming" / "streaming_handler.py",
    "running_sum": EXAMPLES / "stateful" / "sequence_continuous_batching" / "running_sum_stream_handler.py",
}
COMMON_YAML = "maxBatchDelay: 5\nresponseTimeout: 60\njobQueueSize: 200\n"
CONFIGS = {
    "echo": COMMON_YAML + "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 8\n",
    "streaming": COMMON_YAML + "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 8\ncontinuousBatching: true\n",
    "running_sum": COMMON_YAML + (
        "minWorkers: 2\nmaxWorkers: 2\nbatchSize: 4\nsequenceBatching: true\ncontinuousBatching: true\n"
        "sequenceMaxIdleMSec: 60000\nmaxNumSequence: 64\nmaxSequenceJobQueueSize: 10\n"
        f"handler:\n  step_ms: {STEP_MS}\n"
    ),
}
# describe?state=true counts that must be 0 once the load ended; the bounded ones are only reported.
MODEL_COUNTS = ("num_queued", "num_sequences_open", "num_sequence_jobs_waiting", "num_sequence_jobs_in_flight",
                "num_ready_sequences", "num_failures_unreported")
BOUNDED_COUNTS = ("num_tombstones", "num_deadline_entries")
WORKER_COUNTS = ("num_running", "num_gathered", "num_cancels_owed", "num_timed_streams")


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    disconnected: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: collections.Counter[str] = field(default_factory=collections.Counter)
    wrong: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Answer:
    outcome: str  # ok, error, disconnected, lost, wrong
    status: int = 0
    kind: str = ""  # error / lost / wrong: what happened
    body: Any = None  # a complete response: its JSON (or bytes when not JSON)
    chunks: list[Any] = field(default_factory=list)  # a streamed one: each chunk's JSON
    streamed: bool = False
    headers: dict[str, str] = field(default_factory=dict)


def rss_mib(pid: int | None) -> float | None:
    if not pid or pid <= 0:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body


def error_kind(status: int, parsed: Any, where: str = "") -> str:
    kind = parsed.get("type", "?") if isinstance(parsed, dict) else "(not JSON)"
    return f"{status} {kind}{where}"


async def results(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The bodies of a chunked response's results, one per HTTP chunk."""
    buf = b""
    async for data, end_of_chunk in response.content.iter_chunks():
        buf += data
        if end_of_chunk and buf:
            yield buf
            buf = b""
    if buf:
        yield buf


class Soak:
    def __init__(self, args: argparse.Namespace, server: ConveyorProcess) -> None:
        self.args = args
        self.server = server
        self.tallies = {model: Tally() for model in MODELS}
        self.stopping = False
        self.kills: list[dict[str, Any]] = []
        self.rss_samples: list[tuple[float, float | None]] = []
        self.session: aiohttp.ClientSession | None = None
        self.started = 0.0

    # Requests ---------------------------------------------------------------------------------------

    async def call(self, model: str, data: bytes, headers: dict[str, str], *, disconnect_after: int | None = None,
                   abandon_after: float | None = None, chunk_event: tuple[int, asyncio.Event] | None = None) -> Answer:
        """One request; never raises. Lost / disconnected are decided here, wrong by the caller."""
        self.tallies[model].sent += 1
        task = asyncio.ensure_future(self._exchange(model, data, headers, disconnect_after, chunk_event))
        try:
            if abandon_after is not None:
                done, _ = await asyncio.wait({task}, timeout=abandon_after)
                if not done:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return Answer("disconnected")
            return await asyncio.wait_for(task, self.args.deadline)
        except TimeoutError:
            return Answer("lost", kind=f"no answer within {self.args.deadline:g} s")
        except aiohttp.ClientPayloadError as exc:
            return Answer("lost", kind=f"response cut short ({type(exc).__name__})")
        except (aiohttp.ClientConnectionError, ConnectionError) as exc:
            return Answer("lost", kind=f"connection closed without an HTTP error ({type(exc).__name__})")
        finally:
            if chunk_event is not None:
                chunk_event[1].set()

    async def _exchange(self, model: str, data: bytes, headers: dict[str, str], disconnect_after: int | None,
                        chunk_event: tuple[int, asyncio.Event] | None) -> Answer:
        assert self.session is not None
        url = f"{self.server.inference}/predictions/{model}"
        async with self.session.post(url, data=data, headers=headers) as response:
            answer = Answer("ok", response.status, headers=dict(response.headers))
            if response.headers.get("ts_stream_next", "").lower() != "true":
                answer.body = parse(await response.read())
                if response.status >= 400:
                    answer.outcome, answer.kind = "error", error_kind(response.status, answer.body)
                return answer
            answer.streamed = True
            async for chunk in results(response):
                parsed = parse(chunk)
                if isinstance(parsed, dict) and "code" in parsed and "type" in parsed:
                    answer.status = int(parsed["code"])
                    answer.outcome, answer.kind = "error", error_kind(answer.status, parsed, " (in a stream)")
                    return answer
                answer.chunks.append(parsed)
                if chunk_event is not None and len(answer.chunks) >= chunk_event[0]:
                    chunk_event[1].set()
                if disconnect_after is not None and len(answer.chunks) >= disconnect_after:
                    response.close()  # closes the connection: the server sees the client go
                    answer.outcome = "disconnected"
                    return answer
            return answer

    def record(self, model: str, answer: Answer) -> None:
        tally = self.tallies[model]
        if answer.outcome == "ok":
            tally.ok += 1
        elif answer.outcome == "error":
            tally.errors[answer.kind] += 1
        elif answer.outcome == "disconnected":
            tally.disconnected += 1
        elif answer.outcome == "lost":
            tally.lost[answer.kind] += 1
        else:
            tally.wrong[answer.kind] += 1

    async def think(self, rng: random.Random) -> None:
        await asyncio.sleep(rng.uniform(0, self.args.think_ms / 1000))

    # Clients ----------------------------------------------------------------------------------------

    async def echo_client(self, rng: random.Random) -> None:
        while not self.stopping:
            body = rng.randbytes(rng.randint(1, 2048))
            abandon = rng.uniform(0, 0.005) if rng.random() < self.args.abandon_rate else None
            answer = await self.call("echo", body, {"Content-Type": "application/octet-stream"}, abandon_after=abandon)
            if answer.outcome == "ok" and answer.body != body and parse(body) != answer.body:
                answer.outcome, answer.kind = "wrong", "echo body differs"
            self.record("echo", answer)
            await self.think(rng)

    async def streaming_client(self, rng: random.Random) -> None:
        while not self.stopping:
            n = rng.randint(3, 30)
            cut = rng.randint(1, n - 1) if rng.random() < self.args.disconnect_rate else None
            answer = await self.call("streaming", json.dumps({"n": n, "step_ms": STEP_MS}).encode(), JSON,
                                     disconnect_after=cut)
            if answer.outcome == "ok":
                expected = [{"i": k, "of": n} for k in range(n)]
                got = answer.chunks if answer.streamed else [answer.body]
                if got != expected:
                    truncated = got == expected[:len(got)]
                    answer.outcome = "lost" if truncated else "wrong"
                    answer.kind = ("stream ended without its last chunk or an error chunk" if truncated
                                   else f"stream of {n} chunks differs")
            self.record("streaming", answer)
            await self.think(rng)

    async def sequence_client(self, rng: random.Random, index: int) -> None:
        number = 0
        while not self.stopping:
            number += 1
            await RunningSumSession(self, rng, f"soak-{index}-{number}-{uuid.uuid4().hex[:8]}").run()
            await self.think(rng)

    # Worker kills -------------------------------------------------------------------------------------

    async def describe(self, model: str, state: bool = False) -> dict[str, Any]:
        assert self.session is not None
        url = f"{self.server.management}/models/{model}" + ("?state=true" if state else "")
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            return (await response.json())[0]

    async def killer(self, plan: list[tuple[float, str]], rng: random.Random) -> None:
        try:
            await self._kill_in_turn(plan, rng)
        except (aiohttp.ClientError, OSError) as exc:  # reported, not swallowed by the task
            self.kills.append({"at": round(time.monotonic() - self.started, 1), "model": None, "pid": None,
                               "back_in": None, "error": repr(exc)})

    async def _kill_in_turn(self, plan: list[tuple[float, str]], rng: random.Random) -> None:
        for at, model in plan:
            await asyncio.sleep(max(0.0, self.started + at - time.monotonic()))
            if self.stopping:
                return
            workers = [w for w in (await self.describe(model))["workers"] if w["status"] == "READY" and w["pid"] > 0]
            if not workers:
                self.kills.append({"at": round(at, 1), "model": model, "pid": None, "back_in": None})
                continue
            pid = rng.choice(sorted(w["pid"] for w in workers))
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            kill = {"at": round(killed_at - self.started, 1), "model": model, "pid": pid, "back_in": None}
            self.kills.append(kill)
            while time.monotonic() - killed_at < 60:  # bounded: the replacement is READY
                workers = (await self.describe(model))["workers"]
                if all(w["status"] == "READY" and w["pid"] not in (pid, -1) for w in workers):
                    kill["back_in"] = round(time.monotonic() - killed_at, 2)
                    break
                await asyncio.sleep(0.1)

    async def sample_rss(self) -> None:
        while not self.stopping:
            self.rss_samples.append((round(time.monotonic() - self.started, 1), rss_mib(self.server.proc.pid)))
            await asyncio.sleep(10)

    # State --------------------------------------------------------------------------------------------

    async def worker_rss(self) -> dict[str, float]:
        out = {}
        for model in MODELS:
            values = [rss_mib(w["pid"]) for w in (await self.describe(model))["workers"]]
            out[model] = round(sum(v for v in values if v is not None), 1)
        return out

    async def live_state(self) -> tuple[int, int, dict[str, Any], dict[str, int]]:
        """(leaked, unverified, what is non-zero, bounded counts) from describe?state=true."""
        leaked = unverified = 0
        details: dict[str, Any] = {}
        bounded: dict[str, int] = {}
        for model in MODELS:
            described = await self.describe(model, state=True)
            state = described["state"]
            for key in MODEL_COUNTS:
                if state.get(key):
                    leaked += state[key]
                    details[f"{model}.{key}"] = state[key]
            for key in BOUNDED_COUNTS:
                if key in state:
                    bounded[f"{model}.{key}"] = state[key]
            for worker in described["workers"]:
                where = f"{model}.worker {worker['id']}"
                for key in WORKER_COUNTS:
                    if worker["state"].get(key):
                        leaked += worker["state"][key]
                        details[f"{where}.{key}"] = worker["state"][key]
                backend = worker["state"].get("backend")
                if backend is None:
                    unverified += 1
                    details[f"{where}.backend"] = f"no probe answer (status {worker['status']})"
                    continue
                for key, value in backend.items():
                    if value:
                        leaked += value
                        details[f"{where}.backend.{key}"] = value
        return leaked, unverified, details, bounded

    async def all_ready(self) -> bool:
        for model in MODELS:
            if any(w["status"] != "READY" for w in (await self.describe(model))["workers"]):
                return False
        return True

    # The run ------------------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        args = self.args
        rng = random.Random(args.seed)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self.session = session
            rss_start = {"frontend": rss_mib(self.server.proc.pid), **await self.worker_rss()}
            self.started = time.monotonic()
            if args.short:
                plan = [(args.duration / 2, KILL_ROTATION[0])]
            else:
                plan = [((k + 0.5) * 60, KILL_ROTATION[k % len(KILL_ROTATION)]) for k in range(int(args.duration // 60))]
            per_model = [args.clients // 3 + (1 if i < args.clients % 3 else 0) for i in range(3)]
            clients: list[asyncio.Task[None]] = []
            for i in range(per_model[0]):
                clients.append(asyncio.create_task(self.echo_client(random.Random(rng.random()))))
            for i in range(per_model[1]):
                clients.append(asyncio.create_task(self.streaming_client(random.Random(rng.random()))))
            for i in range(per_model[2]):
                clients.append(asyncio.create_task(self.sequence_client(random.Random(rng.random()), i)))
            killer = asyncio.create_task(self.killer(plan, random.Random(rng.random())))
            sampler = asyncio.create_task(self.sample_rss())
            try:
                await asyncio.sleep(args.duration)
            finally:
                self.stopping = True  # clients finish their current request (sequences: their session)
                load_time = time.monotonic() - self.started
                await asyncio.wait([*clients, killer], timeout=args.deadline * 3 + 30)
                for task in (*clients, killer, sampler):
                    task.cancel()
                await asyncio.gather(*clients, killer, sampler, return_exceptions=True)
            await asyncio.sleep(args.quiet)
            deadline = time.monotonic() + 60  # a worker killed late may still be restarting
            while not await self.all_ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
            leaked, unverified, details, bounded = await self.live_state()
            rss_end = {"frontend": rss_mib(self.server.proc.pid), **await self.worker_rss()}
        frontend_rss = [v for _, v in self.rss_samples if v is not None] + [v for v in (rss_end["frontend"],) if v]
        totals = Tally()
        for tally in self.tallies.values():
            totals.sent += tally.sent
            totals.ok += tally.ok
            totals.disconnected += tally.disconnected
            totals.errors.update(tally.errors)
            totals.lost.update(tally.lost)
            totals.wrong.update(tally.wrong)
        return {
            "duration_s": round(load_time, 1), "clients": dict(zip(MODELS, per_model)), "seed": args.seed,
            "models": {m: _tally_dict(t) for m, t in self.tallies.items()},
            "sent": totals.sent, "served_ok": totals.ok, "errors": sum(totals.errors.values()),
            "disconnected": totals.disconnected, "lost": sum(totals.lost.values()), "wrong": sum(totals.wrong.values()),
            "kills": self.kills, "leaked": leaked, "unverified": unverified, "leak_details": details,
            "bounded": bounded, "quiet_s": args.quiet, "tombstone_ttl_ms": args.tombstone_ttl_ms,
            "rss_mib": {"start": rss_start, "end": rss_end,
                        "frontend_peak": max(frontend_rss) if frontend_rss else None,
                        "frontend_samples": self.rss_samples},
            "server_log": str(self.server.log_path),
        }


def _tally_dict(tally: Tally) -> dict[str, Any]:
    return {"sent": tally.sent, "ok": tally.ok, "disconnected": tally.disconnected,
            **{key: dict(sorted(getattr(tally, key).items())) for key in ("errors", "lost", "wrong")}}


def build_store(root: Path, tombstone_ttl_ms: int | None) -> Path:
    store = root / "model_store"
    store.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        config = root / f"{model}.yaml"
        extra = f"sequenceTombstoneTtlMSec: {tombstone_ttl_ms}\n" if tombstone_ttl_ms and model == "running_sum" else ""
        config.write_text(CONFIGS[model] + extra)
        code = archive_main(["--model-name", model, "--version", "1.0", "--handler", str(HANDLERS[model]),
                             "--config-file", str(config), "--export-path", str(store), "--force"])
        if code:
            raise SystemExit(f"archiving {model} failed ({code})")
    return store


def print_report(report: dict[str, Any]) -> None:
    clients = ", ".join(f"{m} {n}" for m, n in report["clients"].items())
    print(f"soak: {report['duration_s']} s of load, {sum(report['clients'].values())} clients ({clients}), "
          f"seed {report['seed']}")
    print(f"{'model':<12} {'sent':>7} {'ok':>7} {'errors':>7} {'disconn.':>8} {'lost':>5} {'wrong':>5}")
    for model, t in report["models"].items():
        print(f"{model:<12} {t['sent']:>7} {t['ok']:>7} {sum(t['errors'].values()):>7} {t['disconnected']:>8} "
              f"{sum(t['lost'].values()):>5} {sum(t['wrong'].values()):>5}")
    print(f"{'all':<12} {report['sent']:>7} {report['served_ok']:>7} {report['errors']:>7} "
          f"{report['disconnected']:>8} {report['lost']:>5} {report['wrong']:>5}")
    for what in ("errors", "lost", "wrong"):
        rows = [(m, kind, n) for m, t in report["models"].items() for kind, n in t[what].items()]
        if rows:
            print(f"{what} by kind:")
            for model, kind, n in rows:
                print(f"  {model:<12} {kind:<58} {n:>6}")
    kills = "; ".join(f"{k['model']} pid {k['pid']} at {k['at']} s, back in {k['back_in']} s" for k in report["kills"])
    print(f"worker kills: {len(report['kills'])} ({kills or 'none'})")
    print(f"requests lost: {report['lost']}   wrong answers: {report['wrong']}")
    bounded = ", ".join(f"{k} {v}" for k, v in report["bounded"].items())
    print(f"leaked state after {report['quiet_s']:g} s quiet: {report['leaked']}, unverified workers: "
          f"{report['unverified']}   (bounded: {bounded or 'none'})")
    for key, value in report["leak_details"].items():
        print(f"  {key}: {value}")
    rss = report["rss_mib"]
    workers = ", ".join(f"{m} {rss['start'].get(m)} → {rss['end'].get(m)}" for m in MODELS)
    warm = [v for t, v in rss["frontend_samples"] if t >= 60]  # after the first minute's warm-up
    at_1min = f" → {_mib(warm[0])} at 1 min" if warm else ""
    print(f"RSS MiB: frontend {_mib(rss['start']['frontend'])}{at_1min} → {_mib(rss['end']['frontend'])} at the end "
          f"(peak {_mib(rss['frontend_peak'])}); workers {workers}")


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", action="store_true", help="CI mode: 25 s, 6 clients, one kill (unless set explicitly)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 600; --short: 25)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients, split over the 3 models "
                   "(default 12; --short: 6)")
    p.add_argument("--disconnect-rate", type=float, default=0.2, help="share of streams the client closes mid-way")
    p.add_argument("--abandon-rate", type=float, default=0.05, help="share of echo requests abandoned after 0-5 ms")
    p.add_argument("--think-ms", type=float, default=20.0, help="max pause between a client's requests")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds after which a request counts as lost")
    p.add_argument("--quiet", type=float, default=5.0, help="seconds of quiet before the state is read")
    p.add_argument("--tombstone-ttl-ms", type=int, default=None,
                   help="running_sum's sequenceTombstoneTtlMSec (default: the server's, 600000); a shorter one lets "
                        "the tombstones (~220 B each) reach their steady state early, so RSS shows anything else")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="archives, server config and log (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (the server log) afterwards")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    args.duration = args.duration if args.duration is not None else (25.0 if args.short else 600.0)
    args.clients = args.clients if args.clients is not None else (6 if args.short else 12)
    if args.clients < 3:
        p.error("--clients must be at least 3 (one per model)")
    return args


async def _run_cancellable(soak: Soak) -> dict[str, Any]:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # finally blocks stop the server
    return await soak.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    store = build_store(workdir, args.tombstone_ttl_ms)
    server = ConveyorProcess(workdir / "server", model_store=store, models=[f"{m}={m}.mar" for m in MODELS])
    server.start(timeout=180)
    try:
        report = asyncio.run(_run_cancellable(Soak(args, server)))
    finally:
        server.stop()
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    failed = report["lost"] or report["wrong"] or report["leaked"] or report["unverified"]
    if failed:
        print(f"FAILED; server log: {server.log_path}")
    elif args.workdir is None and not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
