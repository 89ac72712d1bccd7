"""Helpers handlers call; TorchServe's names (re-exported by the ``ts`` compatibility namespace)."""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import logging
import os
from types import ModuleType
from typing import Any
from collections.abc import Mapping, Sequence

from backend.context import Context

logger = logging.getLogger("conveyor.handler")


def send_intermediate_predict_response(ret: Sequence[Any], req_id_map: Mapping[int, str], message: str, code: int,
                                       context: Context) -> None:
    """Send a partial result now, before ``handle`` returns: one INFER_REPLY(final=False) for this frame.

    ``ret`` is indexed like ``data`` and ``req_id_map`` maps those indexes to request ids (usually
    ``context.request_ids``). Each result carries the status, headers and content type currently set
    on the context for its index, and ``done=False``; the final result comes from ``handle``'s return.
    Like TorchServe, only rank 0 of a multi-process (torchrun) worker sends.
    """
    if str(os.getenv("LOCAL_RANK", "0")) != "0":
        return None
    sender = context.intermediate_sender
    if sender is None:
        raise RuntimeError("send_intermediate_predict_response called outside a frame (no reply channel)")
    sender(ret, req_id_map, message, code)
    return None


def list_classes_from_module(module: ModuleType, parent_class: type | None = None) -> list[type]:
    """Classes defined in ``module`` itself (not imported), optionally only subclasses of ``parent_class``."""
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    if parent_class is not None:
        classes = [c for c in classes if issubclass(c, parent_class)]
    return classes


def load_label_mapping(mapping_file_path: str) -> dict[str, str] | None:
    """``index_to_name.json`` → ``{"0": "cat", ...}``; None (with a warning) when the file is absent."""
    if not os.path.isfile(mapping_file_path):
        logger.warning("%r is missing. Inference output will not include class name.", mapping_file_path)
        return None
    with open(mapping_file_path, encoding="utf-8") as f:
        mapping = json.load(f)
    if not isinstance(mapping, dict):
        raise ValueError('index->name JSON mapping should be in "class": "label" format.')
    if isinstance(mapping.get("object_type_names"), list):  # an older layout TorchServe accepts
        return {str(k): v for k, v in enumerate(mapping["object_type_names"])}
    out: dict[str, str] = {}
    for key, value in mapping.items():
        label = value[-1] if isinstance(value, list) else value
        if not isinstance(label, str):
            raise ValueError("labels in index->name mapping must be either str or List[str]")
        out[key] = label
    return out


def map_class_to_label(probs: list, mapping: dict | None = None, lbl_classes: list | None = None) -> list[dict]:
    """Rows of probabilities (+ class ids) → ``[{label: prob, ...}, ...]``."""
    if not isinstance(probs, list):
        raise ValueError("Convert classes to list before doing mapping")
    if mapping is not None and not isinstance(mapping, dict):
        raise ValueError("Mapping must be a dict")
    if lbl_classes is None:
        lbl_classes = list(itertools.repeat(range(len(probs[0])), len(probs)))
    return [
        {(mapping[str(c)] if mapping is not None else str(c)): p for c, p in zip(*row)}
        for row in zip(lbl_classes, probs)
    ]


def import_class(class_name: str, module_prefix: str | None = None) -> type:
    """``"pkg.mod.Class"`` (or ``"Class"`` under ``module_prefix``) → the class."""
    module_name, _, name = class_name.rpartition(".")
    if module_prefix:
        module = importlib.import_module(f"{module_prefix}.{module_name}" if module_name else module_prefix)
    elif module_name:
        module = importlib.import_module(module_name)
    else:
        raise ImportError(f"module name is not defined for {class_name!r}")
    cls = getattr(module, name, None)
    if cls is None:
        raise ImportError(f"class:{name} not found in module:{module.__name__}.")
    return cls
