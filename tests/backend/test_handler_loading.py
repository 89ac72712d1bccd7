"""Handler strings → entry points; the ts compatibility namespace; BaseHandler's model loading."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.context import Context
from backend.handler_loader import HandlerLoadError, _resolve_module, ensure_ts_namespace, load_handler
from backend.protocol import InferRequest
from backend.service import Service
from tests.backend.conftest import EXAMPLES, REPO, new

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("isolated_imports")]

MODULES = {
    "fn_plain": "calls = []\ndef handle(data, context):\n    calls.append(data)\n    return data and ['f'] * len(data)\n",
    "fn_init": ("calls = []\ndef initialize(context):\n    calls.append('init')\n"
                "def handle(data, context):\n    calls.append(data)\n    return ['i'] * len(data)\n"
                "def cancel(request_ids, context):\n    calls.append(('cancel', request_ids))\n"),
    "fn_named": "def predict(data, context):\n    return data and ['named'] * len(data)\n",
    "one_class": ("class Only:\n    def initialize(self, ctx):\n        self.ready = ctx.model_name\n"
                  "    def handle(self, data, ctx):\n        return [self.ready] * len(data)\n"
                  "    def cancel(self, ids):\n        self.cancelled = ids\n"),
    "two_classes": ("class Helper:\n    pass\n"
                    "class Real:\n    def handle(self, data, ctx):\n        return ['real'] * len(data)\n"),
    "ambiguous": ("class A:\n    def handle(self, d, c):\n        return d\n"
                  "class B:\n    def handle(self, d, c):\n        return d\n"),
}


def ctx_for(model_dir: Path) -> Context:
    return Context("m", str(model_dir), {"model": {}}, 2, None)


def unique_dir(tmp_path: Path) -> Path:
    # Module names must differ across tests: each test gets its own suffix.
    d = tmp_path / "model"
    d.mkdir()
    return d


def write(model_dir: Path, name: str, suffix: str) -> str:
    (model_dir / f"{name}_{suffix}.py").write_text(MODULES[name])
    return f"{name}_{suffix}"


def run(handler, ctx: Context, n: int = 2, body: str = "1") -> list:
    return [r.body for r in Service(handler, ctx, 10_000).predict(
        InferRequest(1, [new(f"r{i}", body) for i in range(n)])).results]


def test_module_level_handle_is_initialised_torchserve_style(tmp_path: Path) -> None:
    d = unique_dir(tmp_path)
    mod = write(d, "fn_plain", tmp_path.name)
    h = load_handler(f"{mod}.py", d, ctx_for(d))
    assert sys.modules[mod].calls == [None]  # handle(None, context) at load, as TorchServe does
    assert run(h, ctx_for(d)) == [b"f", b"f"] and h.cancel is None


def test_module_initialize_and_cancel(tmp_path: Path) -> None:
    d = unique_dir(tmp_path)
    mod = write(d, "fn_init", tmp_path.name)
    ctx = ctx_for(d)
    h = load_handler(mod, d, ctx)
    assert sys.modules[mod].calls == ["init"]
    assert h.cancel is not None
    h.cancel(["x"], ctx)
    assert sys.modules[mod].calls[-1] == ("cancel", ["x"])


def test_module_colon_function(tmp_path: Path) -> None:
    d = unique_dir(tmp_path)
    mod = write(d, "fn_named", tmp_path.name)
    assert run(load_handler(f"{mod}.py:predict", d, ctx_for(d)), ctx_for(d)) == [b"named", b"named"]
    with pytest.raises(HandlerLoadError, match="no attribute 'missing'"):
        load_handler(f"{mod}:missing", d, ctx_for(d))


def test_class_handlers(tmp_path: Path) -> None:
    d = unique_dir(tmp_path)
    one = write(d, "one_class", tmp_path.name)
    h = load_handler(one, d, ctx_for(d))
    assert h.instance.ready == "m" and run(h, ctx_for(d)) == [b"m", b"m"]
    h.cancel(["a"], ctx_for(d))
    assert h.instance.cancelled == ["a"]
    two = write(d, "two_classes", tmp_path.name)
    assert run(load_handler(f"{two}.py", d, ctx_for(d)), ctx_for(d)) == [b"real", b"real"]
    assert run(load_handler(f"{two}.py:Real", d, ctx_for(d)), ctx_for(d)) == [b"real", b"real"]
    amb = write(d, "ambiguous", tmp_path.name)
    with pytest.raises(HandlerLoadError, match=r"\['A', 'B'\]"):
        load_handler(amb, d, ctx_for(d))


def test_builtin_names_and_missing_modules(tmp_path: Path) -> None:
    d = unique_dir(tmp_path)
    assert _resolve_module("base_handler", d).__name__ == "handlers.base_handler"
    with pytest.raises(HandlerLoadError, match="no handler module 'nowhere_to_be_found'"):
        load_handler("nowhere_to_be_found.py", d, ctx_for(d))
    with pytest.raises(HandlerLoadError, match="no handler given"):
        load_handler("", d, ctx_for(d))


def test_ts_namespace_reexports_conveyor_classes() -> None:
    ensure_ts_namespace()
    import ts.context
    import ts.handler_utils.utils
    import ts.torch_handler.base_handler
    import ts.utils.util

    import backend.context
    import backend.errors
    import backend.handler_utils
    import handlers.base_handler

    assert ts.torch_handler.base_handler.BaseHandler is handlers.base_handler.BaseHandler
    assert ts.context.Context is backend.context.Context
    assert ts.utils.util.PredictionException is backend.errors.PredictionException
    assert ts.handler_utils.utils.send_intermediate_predict_response is \
        backend.handler_utils.send_intermediate_predict_response
    assert ts.utils.util.map_class_to_label([[0.5, 0.5]], {"0": "x", "1": "y"}) == [{"x": 0.5, "y": 0.5}]


@pytest.mark.slow
def test_a_real_ts_package_is_never_shadowed(tmp_path: Path) -> None:
    (tmp_path / "ts").mkdir()
    (tmp_path / "ts" / "__init__.py").write_text("REAL = True\n")
    code = ("from backend.handler_loader import ensure_ts_namespace, TS_COMPAT_DIR\nimport sys, ts\n"
            "print(ensure_ts_namespace().split()[0], ts.REAL, str(TS_COMPAT_DIR) in sys.path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["installed", "True", "False"], out.stderr


def test_setup_ships_the_ts_compat_files() -> None:
    # setuptools' package_data glob "ts_compat/**/*.py" (recursive globs: setuptools >= 62.3)
    files = sorted(p.relative_to(REPO / "backend").as_posix() for p in (REPO / "backend" / "ts_compat").rglob("*.py"))
    assert "ts_compat/ts/torch_handler/base_handler.py" in files and "ts_compat/ts/utils/util.py" in files
    assert 'ts_compat/**/*.py' in (REPO / "setup.py").read_text()


def _copy_ts_style(tmp_path: Path) -> tuple[Path, dict]:
    spec = importlib.util.spec_from_file_location("make_weights_for_test", EXAMPLES / "ts_style" / "make_weights.py")
    assert spec is not None and spec.loader is not None
    make_weights = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_weights)
    d = tmp_path / "tiny"
    make_weights.make(str(d))
    for name in ("model.py", "classifier_handler.py", "index_to_name.json"):
        shutil.copy(EXAMPLES / "ts_style" / name, d / name)
    return d, {"model": {"modelName": "tiny", "handler": "classifier_handler.py"}}


@pytest.mark.parametrize("mode", ["eager", "torchscript"])
def test_base_handler_loads_eager_and_torchscript(tmp_path: Path, mode: str) -> None:
    import torch

    d, manifest = _copy_ts_style(tmp_path)
    if mode == "eager":
        manifest["model"].update(modelFile="model.py", serializedFile="tiny.pth")
    else:
        manifest["model"].update(serializedFile="tiny_scripted.pt")
    ctx = Context("tiny", str(d), manifest, 2, None)
    h = load_handler("classifier_handler.py", d, ctx)
    assert h.instance.initialized and h.instance.device == torch.device("cpu")
    assert h.instance.mapping == {"0": "alpha", "1": "beta", "2": "gamma"}
    out = [json.loads(b) for b in run(h, ctx, body="[1, 1, 1, 1]")]
    assert set(out[0]) == {"alpha", "beta", "gamma"}
    # Both modes carry the same weights: the same probabilities for the same input.
    expected = torch.softmax(h.instance.model(torch.ones(1, 4)), dim=1)[0].tolist()
    assert [out[0][k] for k in ("alpha", "beta", "gamma")] == pytest.approx(expected, abs=1e-6)


def test_base_handler_without_weights_fails_clearly(tmp_path: Path) -> None:
    d, manifest = _copy_ts_style(tmp_path)
    with pytest.raises(RuntimeError, match="No model weights could be loaded"):
        load_handler("classifier_handler.py", d, Context("tiny", str(d), manifest, 2, None))
