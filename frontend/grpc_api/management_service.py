"""gRPC management API (TorchServe's ``ManagementAPIsService``): the REST management operations
over the same registry, with TorchServe's JSON-in-``msg`` results and the same ``enable_model_api``
rule (register and unregister refused unless enabled)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from frontend.auth import check_registration_url
from frontend.config import ServerConfig
from frontend.errors import BadRequest, ConveyorError, MethodNotAllowed, ModelLoadError
from frontend.grpc_api.inference_service import Authorize
from frontend.grpc_api.protos import management_pb2, management_pb2_grpc
from frontend.grpc_api.status_mapping import code_for_error
from frontend.models import ModelRegistry

_MODEL_API_DISABLED = ("Model registration and unregistration are disabled; start the server with "
                       "--enable-model-api or set enable_model_api=true")
MAX_WORKERS = 1024


def _reply(body: Any) -> management_pb2.ManagementResponse:
    return management_pb2.ManagementResponse(msg=json.dumps(body, indent=2))


class ManagementService(management_pb2_grpc.ManagementAPIsServiceServicer):
    def __init__(self, registry: ModelRegistry, config: ServerConfig, authorize: Authorize | None = None) -> None:
        self.registry = registry
        self.config = config
        self.authorize = authorize

    async def _call(self, context: grpc.aio.ServicerContext, operation: Any) -> management_pb2.ManagementResponse:
        """Run one operation; typed errors become the matching gRPC status (one place)."""
        try:
            if self.authorize is not None:
                metadata = dict(context.invocation_metadata() or ())
                self.authorize("management", metadata.get("authorization"))
            return _reply(await operation())
        except ConveyorError as exc:
            await context.abort(code_for_error(exc), exc.message)
            raise  # unreachable: abort raises

    async def DescribeModel(self, request: management_pb2.DescribeModelRequest,
                            context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def describe() -> Any:
            entry = self.registry.entry(request.model_name)
            if request.model_version == "all":
                models = [entry.versions[v] for v in sorted(entry.versions)]
            else:
                models = [self.registry.get(request.model_name, request.model_version or None)]
            return [m.describe(entry.default_version) for m in models]

        return await self._call(context, describe)

    async def ListModels(self, request: management_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def list_models() -> Any:
            limit = request.limit if 0 < request.limit <= 1000 else 100
            start = max(request.next_page_token, 0)
            names = sorted(self.registry.models)
            body: dict[str, Any] = {}
            if start + limit < len(names):
                body["nextPageToken"] = str(start + limit)
            body["models"] = [{"modelName": n, "modelUrl": self.registry.models[n].default.url}
                              for n in names[start:start + limit]]
            return body

        return await self._call(context, list_models)

    async def RegisterModel(self, request: management_pb2.RegisterModelRequest,
                            context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def register() -> Any:
            if not self.config.enable_model_api:
                raise MethodNotAllowed(_MODEL_API_DISABLED)
            if not request.url:
                raise BadRequest("Parameter url is required.")
            check_registration_url(self.config, request.url)  # the REST register API's rule (frontend/auth.py)
            if request.runtime not in ("", "python", "python3"):
                raise BadRequest(f"Parameter runtime must be python, got {request.runtime!r}")
            for name in ("batch_size", "max_batch_delay", "response_timeout", "initial_workers"):
                if getattr(request, name) < 0:
                    raise BadRequest(f"Parameter {name} must not be negative, got {getattr(request, name)}")
            api_params: dict[str, Any] = {}
            if request.batch_size:
                api_params["batchSize"] = request.batch_size
            if request.max_batch_delay:
                api_params["maxBatchDelay"] = request.max_batch_delay
            if request.response_timeout:
                api_params["responseTimeout"] = request.response_timeout
            model, errors = await self.registry.register(
                request.url, model_name=request.model_name or None, handler=request.handler or None,
                api_params=api_params, initial_workers=min(request.initial_workers, MAX_WORKERS) or None,
                synchronous=request.synchronous,  # TorchServe's default: false
            )
            if errors:
                raise ModelLoadError(f"Failed to start workers for model '{model.name}': {errors[0]}")
            if model.min_workers and not request.synchronous:
                return {"status": "Processing worker updates..."}
            if model.min_workers == 0:
                return {"status": f'Model "{model.name}" Version: {model.version} registered with 0 initial workers. '
                                  "Use scale workers API to add workers for the model."}
            return {"status": f'Model "{model.name}" Version: {model.version} registered with '
                              f"{model.min_workers} initial workers"}

        return await self._call(context, register)

    async def ScaleWorker(self, request: management_pb2.ScaleWorkerRequest,
                          context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def scale() -> Any:
            model = self.registry.get(request.model_name, request.model_version or None)
            min_workers = request.min_worker
            max_workers = request.max_worker or min_workers
            if not 0 <= min_workers <= MAX_WORKERS or not 0 <= max_workers <= MAX_WORKERS:
                raise BadRequest(f"min_worker and max_worker must be between 0 and {MAX_WORKERS}")
            if max_workers < min_workers:
                raise BadRequest("max_worker cannot be less than min_worker.")
            errors = await self.registry.scale(model, min_workers, max_workers, request.synchronous)
            if not request.synchronous:
                return {"status": "Processing worker updates..."}
            if errors:
                raise ModelLoadError(f"Failed to start workers for model '{model.name}': {errors[0]}")
            return {"status": f"Workers scaled to {min_workers} for model: {model.name}"}

        return await self._call(context, scale)

    async def SetDefault(self, request: management_pb2.SetDefaultRequest,
                         context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def set_default() -> Any:
            self.registry.set_default(request.model_name, request.model_version)
            return {"status": f'Default version successfully updated for model "{request.model_name}" '
                              f'to "{request.model_version}"'}

        return await self._call(context, set_default)

    async def UnregisterModel(self, request: management_pb2.UnregisterModelRequest,
                              context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def unregister() -> Any:
            if not self.config.enable_model_api:
                raise MethodNotAllowed(_MODEL_API_DISABLED)
            await self.registry.unregister(request.model_name, request.model_version or None)
            return {"status": f'Model "{request.model_name}" unregistered'}

        return await self._call(context, unregister)
