"""Access control: TorchServe's token authorization, and which model URLs the register API may load.

Token authorization (TorchServe 0.12's, on by default; ``--disable-token-auth`` or
``disable_token_authorization=true`` turns it off). At start the server writes ``key_file.json``
(mode 0600; in the working directory, or ``token_key_file``) holding three keys::

    {"management": {"key": "...", "expiration time": "2026-01-01T12:00:00.000000Z"},
     "inference":  {"key": "...", "expiration time": "..."},
     "API":        {"key": "..."}}

A request carries one as ``Authorization: Bearer <key>``:

    inference API (:8080)     the inference key    — except ``GET /ping``, ``GET /api-description``
                                                     and ``OPTIONS /`` (health checks, API description)
    management API (:8081)    the management key   — except ``GET /api-description`` / ``OPTIONS /``
    ``GET :8081/token?type=inference|management``  the API key: replaces that key (new expiry), answers
                                                     it and rewrites the key file
    metrics API (:8082)       no key (TorchServe's metrics endpoint has no token either)

The inference and management keys expire ``token_expiration_min`` minutes (default 60) after they
were made; the API key never does. A missing, malformed, wrong or expired key is a 401
``InvalidKeyException`` whose message says which of these it was (never which key was expected).
The key file is removed at shutdown if it still holds this server's keys.

The gRPC layer checks the same keys with ``authorizer.check_token(api, authorization_header)``.
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from aiohttp import web

from frontend.api.common import NoAuth, json_response
from frontend.config import ServerConfig
from frontend.errors import BadRequest, ModelNotFound, Unauthorized

log = logging.getLogger(__name__)

KEY_FILE_NAME = "key_file.json"
KEY_BYTES = 18  # 24 URL-safe characters (TorchServe uses 6 bytes; a longer key costs nothing)
_BEARER = re.compile(r"Bearer[ \t]+(\S+)[ \t]*", re.IGNORECASE)

# (api, canonical route, method or None for any) that need no key: health checks and API descriptions.
_OPEN_ROUTES = frozenset({
    ("inference", "/ping", None), ("inference", "/api-description", None), ("inference", "/", "OPTIONS"),
    # Health probes of KServe / Kubernetes (frontend/api/kserve.py): like /ping, no key needed.
    ("inference", "/health", "GET"), ("inference", "/v2/health/live", "GET"), ("inference", "/v2/health/ready", "GET"),
    ("inference", "/v2/models/{model}/ready", "GET"), ("inference", "/v2/models/{model}/versions/{version}/ready", "GET"),
    ("management", "/api-description", None), ("management", "/", "OPTIONS"),
})
TOKEN_ROUTE = "/token"


@dataclass(slots=True)
class _Key:
    value: str
    expires_at: float | None  # clock() seconds; None: never expires

    def describe(self) -> dict[str, str]:
        entry = {"key": self.value}
        if self.expires_at is not None:
            entry["expiration time"] = _iso(self.expires_at)
        return entry


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TokenAuthorizer:
    """The three keys of one server and the checks against them. ``clock`` is wall time (the key
    file states expiry as a UTC timestamp)."""

    # Which key each API takes ("token" is the key-regeneration route of the management API).
    _KEY_FOR_API = {"inference": "inference", "management": "management", "token": "API"}

    def __init__(self, key_file: Path, expiration_min: float, clock: Callable[[], float] = time.time) -> None:
        self.key_file = key_file
        self.expiration_s = expiration_min * 60.0
        self.clock = clock
        self._keys: dict[str, _Key] = {"management": self._new_key(), "inference": self._new_key(),
                                       "API": _Key(secrets.token_urlsafe(KEY_BYTES), None)}

    def _new_key(self) -> _Key:
        return _Key(secrets.token_urlsafe(KEY_BYTES), self.clock() + self.expiration_s)

    # Checks -----------------------------------------------------------------------------------

    def check(self, request: web.Request, api: str) -> None:
        """The HTTP hook (called by the request middleware in ``frontend/api/common.py``): raise Unauthorized unless the request may pass."""
        if api == "metrics":
            return
        resource = request.match_info.route.resource
        canonical = resource.canonical if resource is not None else None
        if canonical is not None and ((api, canonical, None) in _OPEN_ROUTES
                                      or (api, canonical, request.method) in _OPEN_ROUTES):
            return
        if api == "management" and canonical == TOKEN_ROUTE:
            api = "token"
        self.check_token(api, request.headers.get("Authorization"))

    def check_token(self, api: str, authorization_header: str | None) -> None:
        """Raise Unauthorized unless ``authorization_header`` is ``Bearer <the key of api>``.
        ``api``: "inference", "management", "token" (the key-regeneration route) or "metrics"
        (always allowed). For the gRPC APIs pass the ``authorization`` metadata value."""
        if api == "metrics":
            return
        name = self._KEY_FOR_API.get(api)
        if name is None:
            raise ValueError(f"unknown API {api!r}")
        what = "API" if name == "API" else name
        if not authorization_header:
            raise Unauthorized(f"Token Authorization failed: no 'Authorization: Bearer <key>' header; this API needs "
                               f"the {what} key from {KEY_FILE_NAME}")
        match = _BEARER.fullmatch(authorization_header)
        if match is None:
            raise Unauthorized("Token Authorization failed: the Authorization header must be 'Bearer <key>'")
        key = self._keys[name]
        offered = match.group(1).encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(offered, key.value.encode()):
            raise Unauthorized(f"Token Authorization failed: the token is not the current {what} key")
        if key.expires_at is not None and self.clock() >= key.expires_at:
            raise Unauthorized(f"Token Authorization failed: the {what} key expired at {_iso(key.expires_at)}; "
                               f"get a new one with GET {TOKEN_ROUTE}?type={name} on the management API")

    # Keys and the key file --------------------------------------------------------------------

    def keys(self) -> dict[str, dict[str, str]]:
        """The key file's content (TorchServe's layout)."""
        return {name: key.describe() for name, key in self._keys.items()}

    def regenerate(self, kind: str) -> dict[str, dict[str, str]]:
        """Replace the inference or management key (new expiry), rewrite the key file."""
        if kind not in ("inference", "management"):
            raise BadRequest(f"Parameter type must be inference or management, got {kind!r}")
        self._keys[kind] = self._new_key()
        self.write_key_file()
        log.info("the %s key was regenerated (%s)", kind, self.key_file)
        return {kind: self._keys[kind].describe()}

    def write_key_file(self) -> None:
        """Write the keys, readable by the owner only, replacing the file atomically."""
        self.key_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.key_file.with_name(f".{self.key_file.name}.{os.getpid()}.part")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(self.keys(), out, indent=2)
            out.write("\n")
        os.replace(partial, self.key_file)

    def start(self) -> None:
        self.write_key_file()
        log.info("Token authorization is enabled: send 'Authorization: Bearer <key>' with the keys in %s "
                 "(inference key for :inference, management key for :management; see docs/reliability.md)",
                 self.key_file)

    def stop(self) -> None:
        """Remove the key file, unless another server has replaced it since."""
        try:
            current = json.loads(self.key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(current, dict) and current.get("API", {}).get("key") == self._keys["API"].value:
            self.key_file.unlink(missing_ok=True)

    # The token API ----------------------------------------------------------------------------

    def add_routes(self, management: web.Application) -> None:
        management.router.add_get(TOKEN_ROUTE, self._token_api)

    async def _token_api(self, request: web.Request) -> web.Response:
        # The middleware already checked the API key (``check`` maps this route to "token").
        return json_response(self.regenerate(request.query.get("type", "")))


def make_authorizer(config: ServerConfig, cwd: Path | None = None) -> TokenAuthorizer | NoAuth:
    """The authorizer the configuration asks for: keys, or none when token auth is disabled."""
    if config.disable_token_authorization:
        return NoAuth()
    key_file = config.token_key_file or Path(KEY_FILE_NAME)
    if not key_file.is_absolute():
        key_file = (cwd or Path.cwd()) / key_file
    return TokenAuthorizer(key_file, config.token_expiration_min)


# Exposure: what the register API may load ---------------------------------------------------------

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # TorchServe's model-name rule, bounded


def check_registration_url(config: ServerConfig, url: str) -> None:
    """Refuse a register-API URL the server must not load (raises the client's 4xx).

    * control characters (NUL, newlines...) → 400;
    * ``http(s)://`` and ``file://`` URLs must match ``allowed_urls`` (TorchServe's rule) → 400;
    * a ``..`` path segment → 404 "Relative path is not allowed in url" (TorchServe's answer);
    * a local path (absolute, ``~``, or ``file://``) outside the model store → 400, unless
      ``allow_paths_outside_model_store=true``; relative paths resolve inside the store.
    Startup models (``--models`` / ``load_models``) are the operator's own choice and skip this.
    The gRPC register call must apply it too."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise BadRequest("Parameter url contains control characters")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https", "file") and not config.url_allowed(url):
        raise BadRequest(f"Given URL {url} does not match any allowed URL(s) (allowed_urls)")
    path = unquote(parts.path) if scheme in ("http", "https", "file") else url
    if ".." in Path(path).parts or ".." in path.split("\\"):
        raise ModelNotFound(f"Relative path is not allowed in url: {url}")
    if scheme in ("http", "https"):
        return
    if scheme not in ("", "file"):
        raise BadRequest(f"Unsupported url scheme '{parts.scheme}' in {url} (use a file in the model store, "
                         "an http(s):// URL, or file://)")
    local = Path(path).expanduser()
    if not local.is_absolute() or config.allow_paths_outside_model_store:
        return  # relative: inside the model store (no "..")
    store = config.model_store
    normalized = Path(os.path.normpath(local))
    if store is None or not normalized.is_relative_to(store):
        where = f"the model store ({store})" if store is not None else "any model store (none is configured)"
        raise BadRequest(f"Model url {url} is outside {where}; copy it into the store, or set "
                         "allow_paths_outside_model_store=true")
