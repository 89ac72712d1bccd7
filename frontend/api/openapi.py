"""``GET /api-description`` (and ``OPTIONS /``): an OpenAPI 3 description of each API, built from
one table so that it lists exactly the routes the server registers."""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

# (method, path, operationId, summary, parameters as (name, in, type, required))
_ROUTES: dict[str, list[tuple[str, str, str, str, list[tuple[str, str, str, bool]]]]] = {
    "inference": [
        ("get", "/ping", "ping", "Health of the server: Healthy, Partial Healthy or Unhealthy", []),
        ("get", "/api-description", "apiDescription", "This document", []),
        ("post", "/predictions/{model_name}", "predictions", "Run inference on the default version", [
            ("model_name", "path", "string", True)]),
        ("post", "/predictions/{model_name}/{model_version}", "versionPredictions", "Run inference on a version", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True)]),
        ("post", "/explanations/{model_name}", "explanations", "Explanations from the default version", [
            ("model_name", "path", "string", True)]),
        ("post", "/explanations/{model_name}/{model_version}", "versionExplanations", "Explanations from a version", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True)]),
    ],
    "management": [
        ("get", "/models", "listModels", "List registered models", [
            ("limit", "query", "integer", False), ("next_page_token", "query", "string", False)]),
        ("post", "/models", "registerModel", "Register a model (needs enable_model_api)", [
            ("url", "query", "string", True), ("model_name", "query", "string", False),
            ("handler", "query", "string", False), ("initial_workers", "query", "integer", False),
            ("synchronous", "query", "boolean", False), ("batch_size", "query", "integer", False),
            ("max_batch_delay", "query", "integer", False), ("response_timeout", "query", "integer", False),
            ("startup_timeout", "query", "integer", False), ("continuous_batching", "query", "boolean", False)]),
        ("get", "/models/{model_name}", "describeModel", "Describe the default version", [
            ("model_name", "path", "string", True), ("state", "query", "boolean", False)]),
        ("get", "/models/{model_name}/{model_version}", "describeVersion", "Describe a version, or all", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True),
            ("state", "query", "boolean", False)]),
        ("put", "/models/{model_name}", "scaleModel", "Scale workers of the default version", [
            ("model_name", "path", "string", True), ("min_worker", "query", "integer", False),
            ("max_worker", "query", "integer", False), ("synchronous", "query", "boolean", False)]),
        ("put", "/models/{model_name}/{model_version}", "scaleVersion", "Scale workers of a version", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True),
            ("min_worker", "query", "integer", False), ("max_worker", "query", "integer", False),
            ("synchronous", "query", "boolean", False)]),
        ("put", "/models/{model_name}/{model_version}/set-default", "setDefault", "Set the default version", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True)]),
        ("delete", "/models/{model_name}", "unregisterModel", "Unregister the default version", [
            ("model_name", "path", "string", True)]),
        ("delete", "/models/{model_name}/{model_version}", "unregisterVersion", "Unregister a version", [
            ("model_name", "path", "string", True), ("model_version", "path", "string", True)]),
    ],
}


def api_description(api: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, op_id, summary, params in _ROUTES[api]:
        paths.setdefault(path, {})[method] = {
            "operationId": op_id,
            "summary": summary,
            "parameters": [
                {"name": n, "in": where, "required": req, "schema": {"type": typ}} for n, where, typ, req in params
            ],
            "responses": {"200": {"description": "OK"}, "default": _ERROR},
        }
    return {
        "openapi": "3.0.1",
        "info": {"title": f"Conveyor {api.capitalize()} API", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": {"Error": {"type": "object", "properties": {
            "code": {"type": "integer"}, "type": {"type": "string"}, "message": {"type": "string"}}}}},
    }
