"""Turn a manifest's ``handler`` string into something the worker can call per frame.

Accepted forms (TorchServe's, plus ``file.py:ClassName``):

=========================  ===================================================================
``echo_handler.py``        module file in the model dir: its module-level ``handle(data, context)``,
``echo_handler``           else the one handler class it defines (instantiated, ``initialize(ctx)``)
``mod:function``           that function is the entry point
``file.py:ClassName``      that class, instantiated
``text_generation``        a built-in: ``handlers.text_generation`` (any name that is not a file in
                           the model dir resolves under ``handlers.`` when that module exists)
``pkg.module``             an importable module
=========================  ===================================================================

Initialisation, as TorchServe: a class handler gets ``initialize(context)``; a function handler is
called once as ``handle(None, context)`` — unless its module defines ``initialize(context)``, which is
then called instead. Cancellation hook: a class's ``cancel(request_ids)`` method, or a module-level
``cancel(request_ids, context)`` function.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Callable

from backend.context import Context

logger = logging.getLogger("conveyor.loader")

TS_COMPAT_DIR = Path(__file__).resolve().parent / "ts_compat"

HandleFn = Callable[[list | None, Context], Any]
CancelFn = Callable[[list[str], Context], None]


class HandlerLoadError(Exception):
    """The handler string does not name a loadable entry point."""


@dataclass(frozen=True, slots=True)
class LoadedHandler:
    description: str  # e.g. "echo_handler.handle" or "streaming_handler.StreamingHandler"
    handle: HandleFn
    cancel: CancelFn | None = None
    instance: Any = None  # the handler object for class handlers


def ensure_ts_namespace() -> str:
    """Offer our ``ts`` compatibility package unless a real ``ts`` is importable (never shadow it)."""
    spec = importlib.util.find_spec("ts")
    if spec is None:
        if str(TS_COMPAT_DIR) not in sys.path:
            sys.path.append(str(TS_COMPAT_DIR))
        return "conveyor compat"
    return f"installed ({spec.origin or spec.submodule_search_locations})"


def _module_exists(name: str) -> bool:
    # find_spec on "a.b" imports "a" and raises if "a" is missing: check each prefix in turn.
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        if importlib.util.find_spec(".".join(parts[:i])) is None:
            return False
    return True


def _resolve_module(name: str, model_dir: Path) -> ModuleType:
    if (model_dir / f"{name}.py").is_file() or (model_dir / name / "__init__.py").is_file():
        return importlib.import_module(name)
    if "." not in name and _module_exists(f"handlers.{name}"):
        return importlib.import_module(f"handlers.{name}")
    if _module_exists(name):
        return importlib.import_module(name)
    raise HandlerLoadError(
        f"no handler module {name!r}: not a file in {model_dir}, not a built-in handlers.{name}, not importable"
    )


def _handler_class(module: ModuleType) -> type | None:
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    if len(classes) == 1:
        return classes[0]
    candidates = [c for c in classes if callable(getattr(c, "handle", None))]
    if len(candidates) > 1:
        base = getattr(sys.modules.get("handlers.base_handler"), "BaseHandler", None)
        if base is not None:
            candidates = [c for c in candidates if issubclass(c, base)]
    if len(candidates) == 1:
        return candidates[0]
    if not classes:
        return None
    raise HandlerLoadError(
        f"module {module.__name__} defines {len(classes)} classes {[c.__name__ for c in classes]}: expected exactly "
        "one handler class (with a handle method) or a module-level handle(data, context)"
    )


def _from_class(cls: type, context: Context) -> LoadedHandler:
    instance = cls()
    if not callable(getattr(instance, "handle", None)):
        raise HandlerLoadError(f"handler class {cls.__module__}.{cls.__name__} has no handle(data, context) method")
    init = getattr(instance, "initialize", None)
    if callable(init):
        init(context)
    method = getattr(instance, "cancel", None)
    cancel: CancelFn | None = (lambda ids, ctx: method(ids)) if callable(method) else None
    return LoadedHandler(f"{cls.__module__}.{cls.__name__}", instance.handle, cancel, instance)


def _from_function(module: ModuleType, fn: HandleFn, context: Context) -> LoadedHandler:
    init = getattr(module, "initialize", None)
    if callable(init) and not inspect.isclass(init):
        init(context)
    else:
        fn(None, context)  # TorchServe's way of initialising a function handler
    cancel = getattr(module, "cancel", None)
    cancel_fn: CancelFn | None = cancel if callable(cancel) and not inspect.isclass(cancel) else None
    return LoadedHandler(f"{module.__name__}.{getattr(fn, '__name__', 'handle')}", fn, cancel_fn)


def load_handler(spec: str, model_dir: str | Path, context: Context) -> LoadedHandler:
    """Import, instantiate and initialise the handler named by ``spec`` (see the module docstring)."""
    if not spec or not spec.strip():
        raise HandlerLoadError("no handler given (the manifest's model.handler is empty)")
    model_dir = Path(model_dir)
    # The model dir goes first so its files (handler, model.py, helpers) win over installed modules.
    if str(model_dir) not in sys.path:
        sys.path.insert(0, str(model_dir))
    logger.info("ts namespace: %s", ensure_ts_namespace())

    module_part, _, attr = spec.strip().partition(":")
    name = module_part.rsplit("/", 1)[-1]
    if name.endswith(".py"):
        name = name[:-3]
    module = _resolve_module(name, model_dir)

    if attr:
        obj = getattr(module, attr, None)
        if obj is None:
            raise HandlerLoadError(f"handler {spec!r}: module {module.__name__} has no attribute {attr!r}")
        if inspect.isclass(obj):
            return _from_class(obj, context)
        if callable(obj):
            return _from_function(module, obj, context)
        raise HandlerLoadError(f"handler {spec!r}: {attr!r} is neither a class nor a function")

    handle = getattr(module, "handle", None)
    if callable(handle) and not inspect.isclass(handle):
        return _from_function(module, handle, context)
    cls = _handler_class(module)
    if cls is None:
        raise HandlerLoadError(
            f"handler {spec!r}: module {module.__name__} has neither a handle(data, context) function nor a handler class"
        )
    return _from_class(cls, context)
