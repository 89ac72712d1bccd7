"""Token authorization (TorchServe 0.12's key_file.json and Bearer keys) and exposure rules.

In-process: the key checks (expiry with a fake clock), the key file, the register-URL rules and
the loopback defaults. Real servers: every API with and without the right key, the open routes,
the token API, the key file's lifetime, and auth turned off by configuration. (The shared fixtures
run with ``--disable-token-auth``, as TorchServe's own tests do; gRPC checks the same keys through
``authorizer.check_token``, tested with the gRPC APIs.)
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from collections.abc import Iterator

import pytest
import requests

from frontend.api.common import NoAuth
from frontend.auth import TokenAuthorizer, check_registration_url, make_authorizer
from frontend.config import load_server_config
from frontend.errors import BadRequest, ModelNotFound, Unauthorized
from tests.integration.server import ConveyorProcess

KEY_FILE = "key_file.json"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


# In-process ----------------------------------------------------------------------------------


def test_keys_expire_and_regenerate(tmp_path: Path) -> None:
    clock = FakeClock()
    auth = TokenAuthorizer(tmp_path / KEY_FILE, expiration_min=60, clock=clock)
    auth.start()
    keys = json.loads((tmp_path / KEY_FILE).read_text())
    assert set(keys) == {"management", "inference", "API"} and set(keys["API"]) == {"key"}
    assert set(keys["inference"]) == {"key", "expiration time"} and keys["inference"]["expiration time"].endswith("Z")
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    inference, management, api = (keys[k]["key"] for k in ("inference", "management", "API"))
    assert len({inference, management, api}) == 3

    auth.check_token("inference", f"Bearer {inference}")
    auth.check_token("management", f"bearer   {management}")  # the scheme is case-insensitive
    auth.check_token("token", f"Bearer {api}")
    auth.check_token("metrics", None)  # the metrics API is open
    for api_name, header, says in [
        ("inference", None, "no 'Authorization: Bearer <key>' header"),
        ("inference", "", "no 'Authorization: Bearer <key>' header"),
        ("inference", f"Basic {inference}", "must be 'Bearer <key>'"),
        ("inference", f"Bearer {inference} extra", "must be 'Bearer <key>'"),
        ("inference", f"Bearer {management}", "not the current inference key"),
        ("management", f"Bearer {inference}", "not the current management key"),
        ("token", f"Bearer {management}", "not the current API key"),
        ("inference", "Bearer \udcff\u00e9", "not the current inference key"),  # undecodable bytes: no crash
    ]:
        with pytest.raises(Unauthorized, match=re.escape(says)) as caught:
            auth.check_token(api_name, header)
        assert caught.value.to_json()["code"] == 401 and caught.value.error_type == "InvalidKeyException"

    clock.now += 3600  # TorchServe's default: keys live 60 minutes; the API key never expires
    with pytest.raises(Unauthorized, match="inference key expired at .*GET /token\\?type=inference"):
        auth.check_token("inference", f"Bearer {inference}")
    auth.check_token("token", f"Bearer {api}")
    fresh = auth.regenerate("inference")["inference"]["key"]
    assert json.loads((tmp_path / KEY_FILE).read_text())["inference"]["key"] == fresh
    auth.check_token("inference", f"Bearer {fresh}")
    with pytest.raises(BadRequest):
        auth.regenerate("API")

    other = TokenAuthorizer(tmp_path / KEY_FILE, expiration_min=60)
    other.start()  # another server took over the file: this one's stop must leave it alone
    auth.stop()
    assert (tmp_path / KEY_FILE).exists()
    other.stop()
    assert not (tmp_path / KEY_FILE).exists()


def test_make_authorizer_follows_the_config(tmp_path: Path) -> None:
    assert isinstance(make_authorizer(load_server_config(None, {"disable_token_authorization": "true"})), NoAuth)
    default = make_authorizer(load_server_config(None), cwd=tmp_path)
    assert isinstance(default, TokenAuthorizer) and default.key_file == tmp_path / KEY_FILE
    placed = make_authorizer(load_server_config(None, {"token_key_file": str(tmp_path / "k" / "keys.json"),
                                                      "token_expiration_min": "0.5"}))
    assert isinstance(placed, TokenAuthorizer) and placed.key_file == tmp_path / "k" / "keys.json"
    assert placed.expiration_s == 30


def test_defaults_bind_loopback_with_auth_on_and_model_api_off() -> None:
    config = load_server_config(None)
    assert {a.host for a in (config.inference_address, config.management_address, config.metrics_address)} == {
        "127.0.0.1"}
    assert not config.disable_token_authorization and not config.enable_model_api
    assert not config.allow_paths_outside_model_store


def test_registration_url_rules(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    config = load_server_config(None, {"model_store": str(store), "allowed_urls": r"file://.*,https://models\.example/.*"})
    for ok in ("echo.mar", "sub/echo.mar", str(store / "echo.mar"), f"file://{store}/echo.mar",
               "https://models.example/echo.mar", "my..model.mar"):
        check_registration_url(config, ok)
    for bad, error, says in [
        ("../echo.mar", ModelNotFound, "Relative path is not allowed"),
        ("sub/../../echo.mar", ModelNotFound, "Relative path is not allowed"),
        (f"{store}/../elsewhere.mar", ModelNotFound, "Relative path is not allowed"),
        (f"file://{store}/%2e%2e/x.mar", ModelNotFound, "Relative path is not allowed"),
        ("https://models.example/a/../b.mar", ModelNotFound, "Relative path is not allowed"),
        ("/etc/passwd", BadRequest, "outside the model store"),
        ("~/echo.mar", BadRequest, "outside the model store"),
        ("file:///etc/passwd", BadRequest, "outside the model store"),
        ("http://evil.example/echo.mar", BadRequest, "does not match any allowed URL"),
        ("echo.mar\x00.txt", BadRequest, "control characters"),
        ("s3://bucket/echo.mar", BadRequest, "Unsupported url scheme"),
    ]:
        with pytest.raises(error, match=says):
            check_registration_url(config, bad)
    opened = load_server_config(None, {"model_store": str(store), "allow_paths_outside_model_store": "true"})
    check_registration_url(opened, "/srv/models/echo.mar")
    with pytest.raises(ModelNotFound):
        check_registration_url(opened, "/srv/models/../echo.mar")  # ".." stays refused
    no_store = load_server_config(None)
    with pytest.raises(BadRequest, match="none is configured"):
        check_registration_url(no_store, "/srv/models/echo.mar")


# Real servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def authed(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    with ConveyorProcess(tmp_path_factory.mktemp("authed"), model_store=model_store, models=["echo=echo.mar"],
                         properties={"default_workers_per_model": "1",
                                     "allowed_urls": r"file://.*,http://127\.0\.0\.1:9/.*"},
                         token_auth=True) as server:
        yield server


def keys(server: ConveyorProcess) -> dict[str, str]:
    data = json.loads((server.workdir / KEY_FILE).read_text())
    return {name: entry["key"] for name, entry in data.items()}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(response: requests.Response) -> None:
    assert response.status_code == 401, response.text
    body = response.json()
    assert body["code"] == 401 and body["type"] == "InvalidKeyException" and "Token Authorization failed" in body["message"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_inference_api_needs_the_inference_key(authed: ConveyorProcess) -> None:
    k = keys(authed)
    url = f"{authed.inference}/predictions/echo"
    for headers in ({}, bearer("nope"), bearer(k["management"]), bearer(k["API"]), {"Authorization": k["inference"]}):
        assert_401(requests.post(url, data=b"x", headers=headers, timeout=10))
    assert_401(requests.post(f"{authed.inference}/predictions/nope", data=b"x", timeout=10))  # 401 before 404
    assert_401(requests.get(f"{authed.inference}/no/such/route", timeout=10))
    ok = requests.post(url, data=b"x", headers={**bearer(k["inference"]), "Content-Type": "text/plain"}, timeout=10)
    assert ok.status_code == 200 and ok.text == "x"
    # Open: health checks, the API description, and the whole metrics API.
    assert requests.get(f"{authed.inference}/ping", timeout=10).json()["status"] == "Healthy"
    assert requests.get(f"{authed.inference}/api-description", timeout=10).status_code == 200
    assert requests.options(f"{authed.inference}/", timeout=10).status_code == 200
    assert "conveyor_http_requests_total" in requests.get(f"{authed.metrics}/metrics", timeout=10).text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_management_api_needs_the_management_key(authed: ConveyorProcess) -> None:
    k = keys(authed)
    mgmt = authed.management
    calls = [("GET", "/models"), ("GET", "/models/echo"), ("PUT", "/models/echo?min_worker=1"),
             ("POST", "/models?url=echo.mar&model_name=e2"), ("DELETE", "/models/echo"), ("GET", "/nowhere")]
    for method, path in calls:
        for headers in ({}, bearer(k["inference"]), bearer(k["API"])):
            assert_401(requests.request(method, mgmt + path, headers=headers, timeout=10))
    listed = requests.get(f"{mgmt}/models", headers=bearer(k["management"]), timeout=10)
    assert listed.status_code == 200 and listed.json()["models"][0]["modelName"] == "echo"
    assert requests.get(f"{mgmt}/api-description", timeout=10).status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_token_api_regenerates_keys(authed: ConveyorProcess) -> None:
    old = keys(authed)
    token = f"{authed.management}/token"
    assert_401(requests.get(token, params={"type": "inference"}, headers=bearer(old["management"]), timeout=10))
    assert requests.get(token, params={"type": "API"}, headers=bearer(old["API"]), timeout=10).status_code == 400
    assert requests.get(token, headers=bearer(old["API"]), timeout=10).status_code == 400
    for kind, port_url, probe in (("inference", authed.inference, "/predictions/echo"),
                                  ("management", authed.management, "/models")):
        made = requests.get(token, params={"type": kind}, headers=bearer(old["API"]), timeout=10)
        assert made.status_code == 200, made.text
        new_key = made.json()[kind]["key"]
        assert new_key != old[kind] and keys(authed)[kind] == new_key
        method = "POST" if kind == "inference" else "GET"
        assert_401(requests.request(method, port_url + probe, data=b"x", headers=bearer(old[kind]), timeout=10))
        assert requests.request(method, port_url + probe, data=b"x", headers=bearer(new_key), timeout=10).status_code == 200
    assert keys(authed)["API"] == old["API"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_register_api_exposure_rules(authed: ConveyorProcess, tmp_path: Path) -> None:
    outside = tmp_path / "outside.mar"
    outside.write_bytes(b"not even a zip")
    headers = bearer(keys(authed)["management"])
    for url, status, says in [(str(outside), 400, "outside the model store"),
                              (f"file://{outside}", 400, "outside the model store"),
                              ("../echo.mar", 404, "Relative path is not allowed"),
                              ("http://example.com/echo.mar", 400, "does not match any allowed URL")]:
        response = requests.post(f"{authed.management}/models", params={"url": url}, headers=headers, timeout=10)
        assert response.status_code == status and says in response.json()["message"], (url, response.text)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_key_file_lives_with_the_server_and_auth_can_be_turned_off(model_store: Path, tmp_path: Path) -> None:
    with ConveyorProcess(tmp_path / "on", model_store=model_store, models=["echo=echo.mar"],
                         properties={"default_workers_per_model": "1"}, token_auth=True) as server:
        assert (server.workdir / KEY_FILE).is_file()
    assert not (server.workdir / KEY_FILE).exists()  # removed at shutdown, as TorchServe does

    # disable_token_authorization in config.properties (the fixtures use --disable-token-auth).
    with ConveyorProcess(tmp_path / "off", model_store=model_store, models=["echo=echo.mar"],
                         properties={"default_workers_per_model": "1", "disable_token_authorization": "true"},
                         token_auth=True) as server:
        assert not (server.workdir / KEY_FILE).exists()
        reply = requests.post(f"{server.inference}/predictions/echo", data=b"x", timeout=10)
        assert reply.status_code == 200
        assert requests.get(f"{server.management}/models", timeout=10).status_code == 200
        assert requests.get(f"{server.management}/token", params={"type": "inference"}, timeout=10).status_code == 404


def test_health_probes_need_no_key(model_store: Path, tmp_path: Path) -> None:
    """Kubernetes / KServe probes carry no token: /ping, /health and the v2 health routes stay open."""
    with ConveyorProcess(tmp_path / "srv", model_store=model_store, models=["echo=echo.mar"], token_auth=True) as proc:
        for path in ("/ping", "/health", "/v2/health/live", "/v2/health/ready", "/v2/models/echo/ready"):
            assert requests.get(proc.inference + path, timeout=10).status_code == 200, path
        assert requests.get(proc.inference + "/v2/models/echo", timeout=10).status_code == 401
