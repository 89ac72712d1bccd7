"""Management API (default 127.0.0.1:8081), TorchServe's routes and response shapes:

  GET    /models?limit=&next_page_token=      list (sorted by name, default versions)
  POST   /models?url=&model_name=&...         register (405 unless enable_model_api)
  GET    /models/{m}[/{v}|/all]?state=        describe (state=true: probe each worker's backend state)
  PUT    /models/{m}[/{v}]?min_worker=&...    scale (scale-down drains first)
  PUT    /models/{m}/{v}/set-default          default version
  DELETE /models/{m}[/{v}]                    unregister (405 unless enable_model_api)
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping

from aiohttp import web

from frontend.api.common import json_response
from frontend.api.openapi import api_description
from frontend.auth import MODEL_NAME, check_registration_url
from frontend.config import ServerConfig
from frontend.errors import BadRequest, MethodNotAllowed, ModelLoadError
from frontend.models import ModelRegistry

# Register parameters that set model-config.yaml keys (and lose to the yaml, as in TorchServe).
_REGISTER_CONFIG_PARAMS = {
    "batch_size": "batchSize",
    "max_batch_delay": "maxBatchDelay",
    "response_timeout": "responseTimeout",
    "startup_timeout": "startupTimeout",
    "continuous_batching": "continuousBatching",
}
# How long describe?state=true waits for each worker's probe answer (a busy worker answers with its
# next step; an idle one at once).
STATE_PROBE_TIMEOUT = 5.0
_MODEL_API_DISABLED = ("Model registration and unregistration are disabled; start the server with "
                       "--enable-model-api or set enable_model_api=true")


def _int_param(params: Mapping[str, Any], name: str, default: int, minimum: int = 0, maximum: int = 1_000_000) -> int:
    value = _opt_int_param(params, name, minimum, maximum)
    return default if value is None else value


def _opt_int_param(params: Mapping[str, Any], name: str, minimum: int = 0, maximum: int = 1_000_000) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return None
    # JSON bodies: true is not 1, and 1.5 is not 1.
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise BadRequest(f"Parameter {name} must be an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"Parameter {name} must be an integer, got {value!r}") from None
    if not minimum <= number <= maximum:
        raise BadRequest(f"Parameter {name} must be between {minimum} and {maximum}, got {number}")
    return number


def _bool_param(params: Mapping[str, Any], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise BadRequest(f"Parameter {name} must be true or false, got {value!r}")
    return text == "true"


class ManagementApi:
    def __init__(self, registry: ModelRegistry, config: ServerConfig) -> None:
        self.registry = registry
        self.config = config

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/api-description", self.describe_api)
        r.add_route("OPTIONS", "/", self.describe_api)
        r.add_get("/models", self.list_models)
        r.add_post("/models", self.register)
        r.add_get("/models/{model}", self.describe)
        r.add_get("/models/{model}/{version}", self.describe)
        r.add_put("/models/{model}", self.scale)
        r.add_put("/models/{model}/{version}", self.scale)
        r.add_put("/models/{model}/{version}/set-default", self.set_default)
        r.add_delete("/models/{model}", self.unregister)
        r.add_delete("/models/{model}/{version}", self.unregister)

    async def describe_api(self, request: web.Request) -> web.Response:
        return json_response(api_description("management"))

    async def list_models(self, request: web.Request) -> web.Response:
        limit = _int_param(request.query, "limit", 100, minimum=0)
        start = _int_param(request.query, "next_page_token", 0, minimum=0)
        limit = min(limit, 100) or 100  # TorchServe: out-of-range limits mean 100
        names = sorted(self.registry.models)
        page = names[start:start + limit]
        body: dict[str, Any] = {}
        if start + limit < len(names):
            body["nextPageToken"] = str(start + limit)
        body["models"] = [{"modelName": n, "modelUrl": self.registry.models[n].default.url} for n in page]
        return json_response(body)

    async def describe(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        entry = self.registry.entry(name)
        if version == "all":
            models = [entry.versions[v] for v in sorted(entry.versions)]
        else:
            models = [self.registry.get(name, version)]
        if _bool_param(request.query, "state", False):
            probed = [await m.probe_workers(STATE_PROBE_TIMEOUT) for m in models]
            return json_response([m.describe(entry.default_version, p) for m, p in zip(models, probed)])
        return json_response([m.describe(entry.default_version) for m in models])

    async def register(self, request: web.Request) -> web.Response:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(_MODEL_API_DISABLED)
        params: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json" and request.can_read_body:
            try:
                body = json.loads(await request.read() or b"{}")
            except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
                raise BadRequest(f"register request body is not valid JSON: {type(exc).__name__}: {exc}") from None
            if not isinstance(body, dict):
                raise BadRequest("register request body must be a JSON object")
            params.update(body)
        url = params.get("url")
        if not url or not isinstance(url, str):
            raise BadRequest("Parameter url is required.")
        check_registration_url(self.config, url)  # allowed_urls, no "..", model store only (frontend/auth.py)
        for name in ("model_name", "handler", "runtime"):
            if params.get(name) is not None and not isinstance(params[name], str):
                raise BadRequest(f"Parameter {name} must be a string")
        model_name = params.get("model_name")
        if model_name and not MODEL_NAME.fullmatch(model_name):
            raise BadRequest(f"Parameter model_name {model_name!r} is invalid: use letters, digits, '_', '-' and '.', "
                             "starting with a letter or digit, at most 128 characters")
        runtime = params.get("runtime")
        if runtime not in (None, "", "python", "python3"):
            raise BadRequest(f"Parameter runtime must be python, got {runtime!r}")
        api_params: dict[str, Any] = {}
        for param, key in _REGISTER_CONFIG_PARAMS.items():
            if param == "continuous_batching":
                if param in params:
                    api_params[key] = _bool_param(params, param, False)
            else:
                value = _opt_int_param(params, param, minimum=1 if param != "max_batch_delay" else 0)
                if value is not None:
                    api_params[key] = value
        initial_workers = _opt_int_param(params, "initial_workers", maximum=1024)
        synchronous = _bool_param(params, "synchronous", True)
        model, _ = await self.registry.register(
            url, model_name=params.get("model_name") or None, handler=params.get("handler") or None,
            api_params=api_params, initial_workers=initial_workers, synchronous=synchronous,
        )
        workers = model.min_workers
        if workers == 0:
            message = (f'Model "{model.name}" Version: {model.version} registered with 0 initial workers. '
                       "Use scale workers API to add workers for the model.")
        elif not synchronous:
            return json_response({"status": "Processing worker updates..."}, status=202)
        else:
            message = f'Model "{model.name}" Version: {model.version} registered with {workers} initial workers'
        return json_response({"status": message})

    async def scale(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        version = version or request.query.get("model_version") or None
        model = self.registry.get(name, version)
        min_workers = _int_param(request.query, "min_worker", 1, maximum=1024)
        max_workers = _int_param(request.query, "max_worker", min_workers, maximum=1024)
        if max_workers < min_workers:
            raise BadRequest("max_worker cannot be less than min_worker.")
        synchronous = _bool_param(request.query, "synchronous", False)
        # Asynchronous: workers start (or drain) in the background and this returns at once.
        errors = await self.registry.scale(model, min_workers, max_workers, synchronous)
        if not synchronous:
            return json_response({"status": "Processing worker updates..."}, status=202)
        if errors:
            raise ModelLoadError(f"Failed to start workers for model '{name}': {errors[0]}")
        message = f"Workers scaled to {min_workers} for model: {name}"
        if version:
            message += f", version: {version}"
        return json_response({"status": message})

    async def set_default(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info["version"]
        self.registry.set_default(name, version)
        return json_response({"status": f'Default version successfully updated for model "{name}" to "{version}"'})

    async def unregister(self, request: web.Request) -> web.Response:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(_MODEL_API_DISABLED)
        name, version = request.match_info["model"], request.match_info.get("version")
        await self.registry.unregister(name, version)
        return json_response({"status": f'Model "{name}" unregistered'})
