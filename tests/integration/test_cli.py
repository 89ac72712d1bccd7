"""The `conveyor` command: TorchServe-style config + torch-model-archiver .mar in the background,
status, stop (no orphans), and clear errors for bad input."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.integration.server import EXAMPLES, REPO, build_mar, free_port, pid_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def conveyor(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_torchserve_style_config_and_mar_start_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "model-store"
    store.mkdir()
    # A plain TorchServe archive (no model-config.yaml): per-model settings come from `models`.
    build_mar(store, "echo", EXAMPLES / "echo" / "echo_handler.py")
    ports = [free_port() for _ in range(3)]
    (tmp_path / "config.properties").write_text(f"""\
# TorchServe-style configuration
inference_address=http://127.0.0.1:{ports[0]}
management_address=http://127.0.0.1:{ports[1]}
metrics_address=http://127.0.0.1:{ports[2]}
grpc_inference_port={free_port()}
grpc_management_port={free_port()}
number_of_netty_threads=4
netty_client_threads=1
vmargs=-Xmx512m -XX:+ExitOnOutOfMemoryError
job_queue_size=50
model_store={store}
load_models=echo.mar
default_response_timeout=60
install_py_dep_per_model=false
models={{\\
  "echo": {{\\
    "1.0": {{\\
        "defaultVersion": true,\\
        "marName": "echo.mar",\\
        "minWorkers": 1,\\
        "maxWorkers": 2,\\
        "batchSize": 4,\\
        "maxBatchDelay": 20,\\
        "responseTimeout": 30\\
    }}\\
  }}\\
}}
""")
    pid_file = tmp_path / "ts.pid"
    env = {"LOG_LOCATION": str(tmp_path / "logs"), "CONVEYOR_PID_FILE": str(pid_file)}
    # TorchServe's own invocation: config.properties found in the working directory.
    started = conveyor("start", "--ncs", "--disable-token-auth", cwd=tmp_path, env=env)
    try:
        assert started.returncode == 0, started.stderr + started.stdout
        assert "Model server started." in started.stdout
        status = conveyor("status", cwd=tmp_path, env=env)
        assert status.returncode == 0 and "Healthy" in status.stdout

        inference = f"http://127.0.0.1:{ports[0]}"
        reply = requests.post(f"{inference}/predictions/echo", json={"k": "v"}, timeout=10)
        assert reply.status_code == 200 and reply.json() == {"k": "v"}
        desc = requests.get(f"http://127.0.0.1:{ports[1]}/models/echo", timeout=10).json()[0]
        assert (desc["batchSize"], desc["maxBatchDelay"], desc["responseTimeout"]) == (4, 20, 30)
        assert (desc["minWorkers"], desc["maxWorkers"], desc["jobQueueSize"]) == (1, 2, 50)
        assert desc["loadedAtStartup"] is True
        pids = [w["pid"] for w in desc["workers"]]
        server_pid = int(pid_file.read_text().split('"pid": ')[1].split(",")[0])
    finally:
        stopped = conveyor("stop", cwd=tmp_path, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not pid_alive(server_pid) and not pid_file.exists()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)
    assert conveyor("status", cwd=tmp_path, env=env).returncode == 1
    assert "Model server started." in (tmp_path / "logs" / "conveyor.log").read_text()


def test_bad_flags_and_missing_files_fail_clearly(tmp_path: Path) -> None:
    env = {"CONVEYOR_PID_FILE": str(tmp_path / "pid")}
    bad_flag = conveyor("start", "--no-such-flag", cwd=tmp_path, env=env)
    assert bad_flag.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad_flag.stderr

    store = tmp_path / "store"
    store.mkdir()
    missing = conveyor("start", "--foreground", "--model-store", str(store), "--models", "m=nothere.mar",
                       cwd=tmp_path, env=env)
    assert missing.returncode == 2 and "model file not found" in missing.stderr and "nothere.mar" in missing.stderr
    assert "Traceback" not in missing.stderr

    no_store = conveyor("start", "--model-store", str(tmp_path / "absent"), cwd=tmp_path, env=env)
    assert no_store.returncode == 2 and "not a directory" in no_store.stderr

    (tmp_path / "bad.properties").write_text("job_queue_size=plenty\n")
    bad_value = conveyor("start", "--ts-config", "bad.properties", cwd=tmp_path, env=env)
    assert bad_value.returncode == 2
    assert "'job_queue_size'" in bad_value.stderr and "'plenty'" in bad_value.stderr
    assert "bad.properties" in bad_value.stderr

    stop = conveyor("stop", cwd=tmp_path, env=env)
    assert stop.returncode == 1 and "not running" in stop.stdout


def test_invalid_model_config_fails_start_naming_key_and_file(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    bad_yaml = tmp_path / "model-config.yaml"
    bad_yaml.write_text("batchSize: eight\n")
    build_mar(store, "echo", EXAMPLES / "echo" / "echo_handler.py", bad_yaml)
    ports = [free_port() for _ in range(3)]
    (tmp_path / "c.properties").write_text("".join(
        f"{n}_address=http://127.0.0.1:{p}\n" for n, p in zip(("inference", "management", "metrics"), ports))
        + f"grpc_inference_port={free_port()}\ngrpc_management_port={free_port()}\n")
    result = conveyor("start", "--foreground", "--ts-config", "c.properties", "--model-store", str(store),
                      "--models", "echo.mar", "--pid-file", str(tmp_path / "pid"), cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "batchSize" in result.stderr and "'eight'" in result.stderr and "echo.mar" in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_fails_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "c.properties").write_text(f"inference_address=http://127.0.0.1:{port}\n"
                                               f"management_address=http://127.0.0.1:{free_port()}\n"
                                               f"metrics_address=http://127.0.0.1:{free_port()}\n"
                                               f"grpc_inference_port={free_port()}\n"
                                               f"grpc_management_port={free_port()}\n")
        result = conveyor("start", "--foreground", "--ts-config", "c.properties", "--pid-file",
                          str(tmp_path / "pid"), cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and f"cannot listen on http://127.0.0.1:{port}" in result.stderr


def test_archive_subcommand_builds_a_mar(tmp_path: Path) -> None:
    result = conveyor("archive", "--model-name", "echo", "--version", "1.0", "--handler",
                      str(EXAMPLES / "echo" / "echo_handler.py"), "--export-path", str(tmp_path), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "echo.mar").is_file()
