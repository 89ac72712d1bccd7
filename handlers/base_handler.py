"""BaseHandler: TorchServe's default handler behaviour, for Conveyor and for ported TorchServe handlers.

``ts.torch_handler.base_handler.BaseHandler`` in the compatibility namespace is this same class, so a
TorchServe handler subclassing it runs unchanged.

``initialize(context)`` loads the model named by the manifest:

* eager: ``modelFile`` (a .py in the model dir defining exactly one ``torch.nn.Module`` subclass) is
  instantiated and ``serializedFile`` (if given) is loaded into it as a state dict;
* TorchScript: no ``modelFile`` and a ``serializedFile`` ending in ``.pt`` → ``torch.jit.load``.

Then ``handle(data, context)`` runs ``preprocess`` → ``inference`` → ``postprocess`` (or
``explain_handle`` when the request header ``explain`` is ``True``, ``describe_handle`` for
``describe``), as TorchServe does.
"""

from __future__ import annotations

import abc
import functools
import importlib
import logging
import os
import time
from typing import Any
from collections.abc import Callable

import torch

from backend.context import Context
from backend.handler_utils import list_classes_from_module, load_label_mapping

logger = logging.getLogger(__name__)


def timed(func: Callable) -> Callable:
    """Record ``ts_handler_<name>`` (ms) in the context's metrics when model-config.yaml says
    ``handler: {profile: true}``; otherwise just call through. TorchServe's decorator."""

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = getattr(self, "context", None)
        handler_cfg = (getattr(ctx, "model_yaml_config", None) or {}).get("handler") if ctx is not None else None
        if not (isinstance(handler_cfg, dict) and handler_cfg.get("profile")):
            return func(self, *args, **kwargs)
        start = time.perf_counter()
        result = func(self, *args, **kwargs)
        ctx.metrics.add_time("ts_handler_" + func.__name__, (time.perf_counter() - start) * 1000)
        return result

    return wrapper


class BaseHandler(abc.ABC):
    """Loads an eager or TorchScript model and runs preprocess → inference → postprocess per frame."""

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict | None = None
        self.device: torch.device | None = None
        self.initialized = False
        self.context: Context | None = None
        self.model_pt_path: str | None = None
        self.manifest: dict | None = None
        self.map_location: str | None = None
        self.explain = False
        self.target = 0
        self.model_yaml_config: dict = {}

    # -------------------------------------------------------------------------------- loading

    def initialize(self, context: Context) -> None:
        self.context = context
        self.model_yaml_config = context.model_yaml_config or {}
        properties = context.system_properties
        gpu_id = properties.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available():
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        elif gpu_id is not None and torch.backends.mps.is_available():
            self.map_location = "mps"
            self.device = torch.device("mps")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")

        self.manifest = context.manifest
        model_info = (self.manifest or {}).get("model", {})
        model_dir = properties.get("model_dir") or "."
        serialized = model_info.get("serializedFile")
        self.model_pt_path = os.path.join(model_dir, serialized) if serialized else None
        model_file = model_info.get("modelFile", "")

        if model_file:
            logger.debug("Loading eager model from %s", model_file)
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
            self.model.eval()
        elif self.model_pt_path and self.model_pt_path.endswith(".pt"):
            self.model = self._load_torchscript_model(self.model_pt_path)
            self.model.eval()
        else:
            raise RuntimeError("No model weights could be loaded: the manifest has no modelFile and no .pt "
                               f"serializedFile (serializedFile={serialized!r})")
        logger.debug("Model file %s loaded successfully", self.model_pt_path)
        self.mapping = load_label_mapping(os.path.join(model_dir, "index_to_name.json"))
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        return torch.jit.load(model_pt_path, map_location=self.device)

    def _load_pickled_model(self, model_dir: str, model_file: str, model_pt_path: str | None) -> torch.nn.Module:
        if not os.path.isfile(os.path.join(model_dir, model_file)):
            raise RuntimeError(f"Missing the model definition file {model_file} in {model_dir}")
        module = importlib.import_module(os.path.splitext(os.path.basename(model_file))[0])
        classes = list_classes_from_module(module, torch.nn.Module)
        if len(classes) != 1:
            raise ValueError(f"Expected only one nn.Module class as model definition in {model_file}, "
                             f"found {[c.__name__ for c in classes]}")
        model = classes[0]()
        if model_pt_path:
            state_dict = torch.load(model_pt_path, map_location=self.device, weights_only=True)
            model.load_state_dict(state_dict)
        return model

    # -------------------------------------------------------------------------------- per frame

    @timed
    def preprocess(self, data: list) -> Any:
        return torch.as_tensor(data, device=self.device)

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return self.model(data.to(self.device), *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> list:
        return data.tolist()

    def handle(self, data: list, context: Context) -> list:
        start = time.time()
        self.context = context
        if self._is_describe():
            output = [self.describe_handle()]
        else:
            data_preprocess = self.preprocess(data)
            if not self._is_explain():
                output = self.postprocess(self.inference(data_preprocess))
            else:
                output = self.explain_handle(data_preprocess, data)
        context.metrics.add_time("HandlerTime", round((time.time() - start) * 1000, 2), None, "ms")
        return output

    # -------------------------------------------------------------------------------- explain / describe

    def explain_handle(self, data_preprocess: Any, raw_data: list) -> Any:
        """Captum-style explanations: calls ``self.get_insights(tensor, inputs, target)`` (subclasses provide it)."""
        inputs, target = None, 0
        row = raw_data[0]
        if isinstance(row, dict):
            inputs = row.get("data") or row.get("body")
            target = row.get("target") or 0
        get_insights = getattr(self, "get_insights", None)
        if get_insights is None:
            raise NotImplementedError(f"{type(self).__name__} does not implement get_insights for explanations")
        return get_insights(data_preprocess, inputs, target)

    def _is_explain(self) -> bool:
        if self.context is not None and self.context.request_processor \
                and self.context.get_request_header(0, "explain") == "True":
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return bool(self.context is not None and self.context.request_processor
                    and self.context.get_request_header(0, "describe") == "True")

    def describe_handle(self) -> Any:
        """Override to answer describe requests."""
        return None

    def get_device(self) -> torch.device | None:
        return self.device
