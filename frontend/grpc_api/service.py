"""The gRPC listeners: ``grpc.aio`` servers in the frontend's own event loop (no second process,
no thread pool per message), inference on ``grpc_inference_port`` (7070) and management on
``grpc_management_port`` (7071), bound to the host of the matching REST address. Plugged into
``ConveyorServer`` as a Service (frontend/server.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from frontend.errors import InvalidConfig
from frontend.grpc_api.inference_service import Authorize, InferenceService
from frontend.grpc_api.management_service import ManagementService
from frontend.grpc_api.protos import inference_pb2_grpc, management_pb2_grpc

if TYPE_CHECKING:
    from frontend.server import ConveyorServer

log = logging.getLogger(__name__)

# Bodies as large as the REST API accepts (gRPC's default is 4 MiB).
_MESSAGE_OPTIONS = ("grpc.max_receive_message_length", "grpc.max_send_message_length")


class GrpcService:
    name = "gRPC APIs"

    def __init__(self, server: ConveyorServer) -> None:
        self.server = server
        self._servers: list[grpc.aio.Server] = []
        self.ports: dict[str, int] = {}

    def _authorize(self) -> Authorize | None:
        check = getattr(self.server.authorizer, "check_token", None)
        return check if callable(check) else None

    async def start(self) -> None:
        cfg = self.server.config
        limit = max(cfg.max_request_size, cfg.max_response_size) + 1024 * 1024
        options = [(name, limit) for name in _MESSAGE_OPTIONS]
        authorize = self._authorize()
        plan = [
            ("inference", cfg.inference_address.host, cfg.grpc_inference_port,
             lambda s: inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
                 InferenceService(self.server.registry, cfg, self.server.metrics, authorize), s)),
            ("management", cfg.management_address.host, cfg.grpc_management_port,
             lambda s: management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(
                 ManagementService(self.server.registry, cfg, authorize), s)),
        ]
        for api, host, port, add in plan:
            server = grpc.aio.server(options=options)
            add(server)
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                bound = server.add_insecure_port(target)
            except RuntimeError as exc:
                bound = 0
                log.debug("gRPC bind failed: %s", exc)
            if bound == 0:
                await self.stop(0)
                raise InvalidConfig(f"cannot listen on {target} (gRPC {api} API): port in use or not allowed")
            await server.start()
            self._servers.append(server)
            self.ports[api] = bound
            log.info("gRPC %s API listening on %s:%d", api, host, bound)

    async def stop(self, grace: float) -> None:
        for server in self._servers:
            await server.stop(grace)
        self._servers.clear()
