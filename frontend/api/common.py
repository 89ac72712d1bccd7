"""What every HTTP API shares: request ids, the one error → HTTP mapping, metrics and auth hooks.

Error mapping lives in ``error_response`` only: typed ConveyorErrors carry their status; aiohttp's
own HTTP exceptions (unknown route, wrong method, body over client_max_size) are translated into
the same JSON shape ``{"code", "type", "message"}`` that TorchServe clients parse.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web

from frontend.errors import ConveyorError, MethodNotAllowed, RequestTooLarge, ResourceNotFound
from frontend.metrics import ServerMetrics, status_class

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_id(request: web.Request) -> str:
    return request[REQUEST_ID_KEY]


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # indent=2 like TorchServe: humans read describe/list output with curl.
    return web.Response(text=json.dumps(data, indent=2), status=status, content_type="application/json",
                        headers=headers)


def error_response(exc: ConveyorError) -> web.Response:
    """The one place a typed error becomes an HTTP response."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return json_response(exc.to_json(), status=exc.status, headers=headers)


def _from_http_exception(exc: web.HTTPException) -> ConveyorError:
    if exc.status == 404:
        return ResourceNotFound("Requested resource is not found, please refer to API document.")
    if exc.status == 405:
        return MethodNotAllowed("Requested method is not allowed, please refer to API document.")
    if exc.status == 413:
        return RequestTooLarge(f"Request body is too large: {exc.text or ''}".rstrip(": "))
    error = ConveyorError(exc.text or exc.reason)
    error.status, error.error_type = exc.status, type(exc).__name__.removeprefix("HTTP") + "Exception"
    return error


class Authorizer(Protocol):
    """Token auth hook (issue 9: TorchServe's key_file.json). Raises Unauthorized to refuse."""

    def check(self, request: web.Request, api: str) -> None: ...


class NoAuth:
    """Token authorization is not implemented yet: every request is allowed (see docs)."""

    def check(self, request: web.Request, api: str) -> None:
        return None


def make_middlewares(api: str, metrics: ServerMetrics, authorizer: Authorizer) -> list:
    """Request id + error mapping + HTTP metrics, then the auth hook, for one API ("inference", ...)."""
    requests_counter = metrics.http_requests

    @web.middleware
    async def context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        client_id = request.headers.get(REQUEST_ID_HEADER, "")
        # A client's id is echoed when it is sane (tracing across proxies); else we make one.
        request[REQUEST_ID_KEY] = client_id if _CLIENT_ID.fullmatch(client_id) else str(uuid.uuid4())
        try:
            response = await handler(request)
        except ConveyorError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = error_response(_from_http_exception(exc))
        except Exception as exc:  # a bug: answer 500 JSON, keep serving
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = error_response(ConveyorError(f"internal error: {type(exc).__name__}"))
        requests_counter.labels(api, status_class(response.status)).inc()
        return response

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        authorizer.check(request, api)
        return await handler(request)

    return [context_middleware, auth_middleware]


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response, streamed ones included, carries x-request-id."""
    rid = request.get(REQUEST_ID_KEY)
    if rid:
        response.headers[REQUEST_ID_HEADER] = rid


def make_app(api: str, metrics: ServerMetrics, authorizer: Authorizer, client_max_size: int = 1024 ** 2) -> web.Application:
    app = web.Application(middlewares=make_middlewares(api, metrics, authorizer), client_max_size=client_max_size)
    app.on_response_prepare.append(add_request_id)
    return app
