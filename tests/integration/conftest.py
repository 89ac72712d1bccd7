"""Integration fixtures: example archives built with the real torch-model-archiver, and servers."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Iterator

import pytest

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """echo.mar and streaming.mar, as a user would build them."""
    store = tmp_path_factory.mktemp("model_store")
    build_mar(store, "echo", EXAMPLES / "echo" / "echo_handler.py", EXAMPLES / "echo" / "model-config.yaml")
    build_mar(store, "streaming", EXAMPLES / "streaming" / "streaming_handler.py",
              EXAMPLES / "streaming" / "model-config.yaml")
    return store


@pytest.fixture(scope="module")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    """One shared server per test module: echo + streaming at start, model API enabled."""
    workdir = tmp_path_factory.mktemp("server")
    with ConveyorProcess(workdir, model_store=model_store, models=["echo=echo.mar", "streaming=streaming.mar"],
                         properties={"default_workers_per_model": "1"}) as proc:
        yield proc
