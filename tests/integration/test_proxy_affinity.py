"""Sequence affinity through a real proxy (issue 11): 3 Conveyor replicas on 127.0.0.1 behind nginx
and HAProxy, which hash on the ``ts_request_sequence_id`` header with the configs shipped in
``deploy/local/`` (only the addresses replaced).

Each replica serves the running-sum example (``examples/stateful/sequence_batching``) with
``sequenceStrictStart: true`` — the setting for replicas behind a hashing balancer — and the
streaming example. The tests check:

* 20 concurrent sequences each keep their running sum, every request of a sequence reaching one
  replica (the proxy's ``X-Conveyor-Upstream`` header says which);
* a replica killed (SIGKILL): the next mid-sequence request of each of its sequences is re-homed by
  the proxy and refused with 404 ``SequenceUnknownException``; the client restarts the sequence
  (start header) and it succeeds; the other sequences go on unaffected;
* SIGTERM on a replica lets an open stream through the proxy finish before the replica exits, and
  the proxy then sends that hash key to another replica;
* nginx without ``underscores_in_headers on`` drops the sequence headers (the trap the config avoids).

Tool binaries come from Debian (``.ci/run`` installs nginx-light and haproxy); a test whose proxy
binary is missing is skipped with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import requests
import yaml

from tests.integration.server import EXAMPLES, REPO, ConveyorProcess, build_mar, free_port, pid_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LOCAL = REPO / "deploy" / "local"
ID, START = "ts_request_sequence_id", "ts_request_sequence_start"
UPSTREAM = "X-Conveyor-Upstream"
NUM_REPLICAS = 3
NUM_SEQUENCES = 20
STEPS = (1, 2, 3, 4, 5)  # sums 1, 3, 6, 10, 15


# Proxies ------------------------------------------------------------------------------------------


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 15.0) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    if not wait_until(up, timeout=timeout):
        raise TimeoutError(f"proxy did not listen on {port} within {timeout} s:\n{log.read_text(errors='replace')}")


class Proxy:
    """nginx or haproxy in the foreground on a free port, from a deploy/local config."""

    def __init__(self, kind: str, workdir: Path, backends: list[int], *, underscores: bool = True) -> None:
        binary = shutil.which(kind) or (f"/usr/sbin/{kind}" if Path(f"/usr/sbin/{kind}").exists() else None)
        if binary is None:
            pytest.skip(f"{kind} is not installed (.ci/run installs it from Debian packages)")
        self.kind = kind
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"{kind}.log"
        if kind == "nginx":
            text = render_nginx((LOCAL / "nginx.conf").read_text(), self.port, backends)
            if not underscores:
                text, count = re.subn(r"^\s*underscores_in_headers on;\s*$", "", text, flags=re.M)
                assert count == 1
            config = workdir / "nginx.conf"
            config.write_text(text)
            # As root, nginx's workers would switch to "nobody", who cannot enter pytest's 0700 tmp.
            argv = [binary, "-p", str(workdir), "-c", str(config)]
            if os.geteuid() == 0:
                argv += ["-g", "user root;"]
        else:
            config = workdir / "haproxy.cfg"
            config.write_text(render_haproxy((LOCAL / "haproxy.cfg").read_text(), self.port, backends))
            argv = [binary, "-db", "-f", str(config)]
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Proxy:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_listening(self.port, self.proc, self.log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # both exit at once on SIGTERM
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def render_nginx(text: str, port: int, backends: list[int]) -> str:
    """The shipped config with our listen port and upstream servers (nothing else changes)."""
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+ (.*);$", text, flags=re.M)
    assert len(servers) == 3, "deploy/local/nginx.conf must list three upstream servers"
    text = re.sub(r"^(\s*)server 127\.0\.0\.1:\d+ .*;\n", "", text, flags=re.M)
    lines = "".join(f"        server 127.0.0.1:{p} {servers[0]};\n" for p in backends)
    text = text.replace("        keepalive", lines + "        keepalive", 1)
    text, count = re.subn(r"listen 127\.0\.0\.1:8080;", f"listen 127.0.0.1:{port};", text)
    assert count == 1
    return text


def render_haproxy(text: str, port: int, backends: list[int]) -> str:
    text = re.sub(r"^\s*server r\d 127\.0\.0\.1:\d+\n", "", text, flags=re.M)
    text = text.rstrip("\n") + "\n" + "".join(f"    server r{i + 1} 127.0.0.1:{p}\n" for i, p in enumerate(backends))
    text, count = re.subn(r"bind 127\.0\.0\.1:8080", f"bind 127.0.0.1:{port}", text)
    assert count == 1
    return text


# Replicas -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The running-sum example with sequenceStrictStart, one worker; and the streaming example."""
    store = tmp_path_factory.mktemp("affinity_store")
    config = yaml.safe_load((EXAMPLES / "stateful" / "sequence_batching" / "model-config.yaml").read_text())
    config.update(minWorkers=1, maxWorkers=1, maxBatchDelay=1, maxNumSequence=NUM_SEQUENCES + 4,
                  maxSequenceJobQueueSize=4, sequenceStrictStart=True)
    (store / "sum.yaml").write_text(yaml.safe_dump(config))
    build_mar(store, "sum", EXAMPLES / "stateful" / "sequence_batching" / "running_sum_handler.py", store / "sum.yaml")
    shutil.copy(model_store / "streaming.mar", store / "streaming.mar")
    return store


@pytest.fixture
def replicas(store: Path, tmp_path: Path) -> Iterator[list[ConveyorProcess]]:
    """Three replicas, started at once, stopped (SIGTERM, then SIGKILL) at the end of the test."""
    models = ["sum=sum.mar", "streaming=streaming.mar"]
    procs = [ConveyorProcess(tmp_path / f"replica{i}", model_store=store, models=models) for i in range(NUM_REPLICAS)]
    errors: list[BaseException] = []

    def start(proc: ConveyorProcess) -> None:
        try:
            proc.start()
        except BaseException as exc:  # reported below, after every replica was given its chance
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    try:
        if errors:
            raise errors[0]
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def ports(replicas: list[ConveyorProcess]) -> list[int]:
    return [r.ports["inference"] for r in replicas]


# Clients ------------------------------------------------------------------------------------------


def send(url: str, sid: str, n: int, start: bool = False) -> requests.Response:
    headers = {ID: sid, "Content-Type": "application/json"}
    if start:
        headers[START] = "true"
    return requests.post(f"{url}/predictions/sum", data=str(n), headers=headers, timeout=30)


def answered_by(response: requests.Response) -> str:
    """The replica that answered: nginx lists every address it tried, the last one answered."""
    return response.headers[UPSTREAM].split(",")[-1].strip()


def run_sequence(url: str, sid: str) -> tuple[list[Any], set[str]]:
    sums: list[Any] = []
    upstreams: set[str] = set()
    for index, n in enumerate(STEPS):
        response = send(url, sid, n, start=index == 0)
        assert response.status_code == 200, f"{sid} step {index}: {response.status_code} {response.text}"
        assert response.headers[ID] == sid
        sums.append(response.json())
        upstreams.add(answered_by(response))
    return sums, upstreams


def replica_of(upstream: str, replicas: list[ConveyorProcess], kind: str) -> int:
    if kind == "nginx":
        return ports(replicas).index(int(upstream.rsplit(":", 1)[1]))
    return int(upstream.lstrip("r")) - 1  # haproxy: server names r1..r3


def kill_replica(replica: ConveyorProcess) -> None:
    """SIGKILL the frontend (its workers exit on socket EOF); wait until nothing listens."""
    assert replica.proc is not None
    worker_pids = replica.worker_pids("sum") + replica.worker_pids("streaming")
    os.killpg(replica.proc.pid, signal.SIGKILL)
    replica.proc.wait(10)
    assert wait_until(lambda: not any(pid_alive(p) for p in worker_pids), timeout=15)


# Tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nginx", "haproxy"])
def test_sequences_keep_affinity_and_fail_over_with_strict_start(kind: str, replicas: list[ConveyorProcess],
                                                                 tmp_path: Path) -> None:
    with Proxy(kind, tmp_path / kind, ports(replicas)) as proxy:
        ids = [f"{kind}-seq-{i}-{uuid.uuid4().hex[:8]}" for i in range(NUM_SEQUENCES)]
        with ThreadPoolExecutor(NUM_SEQUENCES) as pool:
            results = list(pool.map(lambda sid: run_sequence(proxy.url, sid), ids))
        homes: dict[str, int] = {}
        for sid, (sums, upstreams) in zip(ids, results):
            assert sums == [1, 3, 6, 10, 15], sid  # every request in order, on one state
            assert len(upstreams) == 1, f"{sid} reached {upstreams}"
            homes[sid] = replica_of(upstreams.pop(), replicas, kind)
        assert len(set(homes.values())) >= 2, f"the hash put every sequence on one replica: {homes}"
        # Each replica holds exactly the sequences the proxy sent it (describe lists open ids).
        for index, replica in enumerate(replicas):
            held = set(replica.describe("sum")["workers"][0]["sequences"]["ids"])
            assert held == {sid for sid, home in homes.items() if home == index}

        victim = max(range(NUM_REPLICAS), key=lambda i: sum(1 for h in homes.values() if h == i))
        kill_replica(replicas[victim])
        lost = [sid for sid in ids if homes[sid] == victim]
        kept = [sid for sid in ids if homes[sid] != victim]

        with ThreadPoolExecutor(NUM_SEQUENCES) as pool:
            nexts = dict(zip(ids, pool.map(lambda sid: send(proxy.url, sid, 6), ids)))
        for sid in lost:  # re-homed by the proxy: the new replica refuses an id it never saw
            response = nexts[sid]
            assert response.status_code == 404, f"{sid}: {response.status_code} {response.text}"
            assert response.json()["type"] == "SequenceUnknownException"
            assert sid in response.json()["message"] and response.headers[ID] == sid
            assert replica_of(answered_by(response), replicas, kind) != victim
        for sid in kept:  # unaffected: same replica, sum goes on
            assert nexts[sid].status_code == 200 and nexts[sid].json() == 21, sid
            assert replica_of(answered_by(nexts[sid]), replicas, kind) == homes[sid]

        if kind == "haproxy":  # out of the ring before restarts (deploy/local/haproxy.cfg says why)
            assert wait_until(lambda: f"r{victim + 1} is DOWN" in proxy.log.read_text(errors="replace"), timeout=15)
        for sid in lost:  # the client restarts the sequence (start header), on its new home
            restarted, upstreams = run_sequence(proxy.url, sid)
            assert restarted == [1, 3, 6, 10, 15] and len(upstreams) == 1
            assert replica_of(upstreams.pop(), replicas, kind) != victim
        for sid in ids:  # 0 ends a sequence (handler side): nothing left open
            assert send(proxy.url, sid, 0).status_code == 200


def test_sigterm_drains_an_open_stream_through_the_proxy(replicas: list[ConveyorProcess], tmp_path: Path) -> None:
    with Proxy("nginx", tmp_path / "nginx", ports(replicas)) as proxy:
        victim = 0
        key = pick_key(proxy.url, replicas, victim)
        chunks: list[bytes] = []
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def stream() -> None:
            try:
                with requests.post(f"{proxy.url}/predictions/streaming", json={"n": 10, "step_ms": 100},
                                   headers={ID: key}, stream=True, timeout=60) as response:
                    outcome["status"] = response.status_code
                    outcome["upstream"] = answered_by(response)
                    for chunk in response.iter_content(chunk_size=None):
                        chunks.append(chunk)
            except Exception as exc:  # reported by the assertions below
                outcome["error"] = exc
            finally:
                done.set()

        reader = threading.Thread(target=stream)
        reader.start()
        try:
            assert wait_until(lambda: len(chunks) >= 1 or done.is_set(), timeout=20)
            proc = replicas[victim].proc
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            assert done.wait(45)
        finally:
            reader.join(60)
        assert "error" not in outcome and outcome["status"] == 200
        assert replica_of(outcome["upstream"], replicas, "nginx") == victim
        body = b"".join(chunks).decode()
        assert [int(i) for i in re.findall(r'"i":\s*(\d+)', body)] == list(range(10))  # the stream finished
        assert proc.wait(30) == 0  # then the replica exited cleanly
        # The same key now reaches a live replica (nginx skips the refused one).
        again = requests.post(f"{proxy.url}/predictions/streaming", json={"n": 2}, headers={ID: key}, timeout=30)
        assert again.status_code == 200 and replica_of(answered_by(again), replicas, "nginx") != victim


def pick_key(url: str, replicas: list[ConveyorProcess], target: int) -> str:
    """A header value the proxy hashes to replica ``target`` (asked with cheap /ping requests)."""
    for attempt in range(200):
        key = f"probe-{attempt}"
        response = requests.get(f"{url}/ping", headers={ID: key}, timeout=10)
        if replica_of(answered_by(response), replicas, "nginx") == target:
            return key
    raise AssertionError(f"no key among 200 hashed to replica {target}")


def test_nginx_drops_underscore_headers_without_the_directive(replicas: list[ConveyorProcess],
                                                              tmp_path: Path) -> None:
    """Without ``underscores_in_headers on`` the id and start headers never reach Conveyor: a new
    server-made sequence is opened for every request. The shipped config has the directive."""
    sid = f"trap-{uuid.uuid4().hex[:8]}"
    with Proxy("nginx", tmp_path / "no_underscores", ports(replicas), underscores=False) as proxy:
        response = send(proxy.url, sid, 1, start=True)
        assert response.status_code == 200
        assert response.headers[ID] != sid and response.headers[ID].startswith("ts-seq-")
        second = send(proxy.url, sid, 2)
        assert second.json() == 2 and second.headers[ID] != response.headers[ID]  # no sum: a new sequence again
    with Proxy("nginx", tmp_path / "shipped", ports(replicas)) as proxy:
        assert send(proxy.url, sid, 1, start=True).headers[ID] == sid
        assert send(proxy.url, sid, 2).json() == 3
        assert send(proxy.url, sid, 0).status_code == 200
