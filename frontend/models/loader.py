"""From a model URL (as TorchServe's register API and ``--models`` take it) to an opened archive.

URL forms:
  ``name.mar`` / ``dir``         a file or directory in the model store
  ``/abs/path.mar``, ``file://`` an absolute local path (.mar, .tar.gz/.tgz or a directory)
  ``http(s)://...``             downloaded into the model store, only if it matches ``allowed_urls``

Archive extraction and dependency installation run off the event loop (a thread / a subprocess).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp

from backend.archive import ArchiveError, ModelArchive, open_archive
from frontend.config import ServerConfig
from frontend.errors import BadRequest, ModelLoadError, ModelNotFound

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT = 300.0  # seconds for a remote archive
DEPS_DIR = ".conveyor_deps"  # where install_py_dep_per_model puts a model's requirements


def is_remote(url: str) -> bool:
    return urlsplit(url).scheme in ("http", "https")


def resolve_local(config: ServerConfig, url: str) -> Path:
    """The local path a non-remote URL names; ModelNotFound (404) when nothing is there."""
    if url.startswith("file://"):
        path = Path(unquote(urlsplit(url).path))
    else:
        path = Path(url).expanduser()
    if not path.is_absolute():
        if config.model_store is None:
            raise BadRequest(f"model url '{url}' is relative but no model store is configured (--model-store)")
        path = config.model_store / path
    if not path.exists():
        raise ModelNotFound(f"Model not found in model store: {url}")
    return path


async def download(config: ServerConfig, url: str) -> Path:
    """Fetch a remote archive into the model store (TorchServe keeps remote archives there)."""
    if not config.url_allowed(url):
        raise BadRequest(f"model url '{url}' does not match allowed_urls")
    if config.model_store is None:
        raise BadRequest("remote model urls need a model store (--model-store) to download into")
    name = Path(unquote(urlsplit(url).path)).name
    if not name:
        raise BadRequest(f"model url '{url}' does not name a file")
    target = config.model_store / name
    if target.exists():
        raise ModelLoadError(f"Model file already exists in the model store: {name}")
    partial = target.with_name(f".{name}.part")
    try:
        timeout = aiohttp.ClientTimeout(total=DOWNLOAD_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise ModelLoadError(f"Failed to download model from {url}: HTTP {response.status}")
            with partial.open("wb") as out:
                async for chunk in response.content.iter_chunked(1 << 20):
                    out.write(chunk)
        partial.rename(target)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ModelLoadError(f"Failed to download model from {url}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return target


async def open_model(
    config: ServerConfig, url: str, extract_root: Path, model_name: str | None, handler: str | None,
) -> ModelArchive:
    """Resolve ``url`` and open the archive in a thread; archive problems become ModelLoadError.
    ``extract_root`` is a directory owned by this one registration (removed with the model)."""
    remote = is_remote(url)
    path = await download(config, url) if remote else resolve_local(config, url)
    default_handler = handler or config.default_service_handler or None
    loop = asyncio.get_running_loop()
    try:
        # The fallbacks matter only for a model directory without a manifest.
        fallback_name = model_name or path.name.split(".")[0]
        archive = await loop.run_in_executor(None, open_archive, path, extract_root, fallback_name, default_handler)
    except ArchiveError as exc:
        if remote:
            path.unlink(missing_ok=True)  # a download that is no model must not stay in the store
        raise ModelLoadError(str(exc)) from None
    overrides: dict[str, Any] = {}
    if model_name:
        overrides["model_name"] = model_name
    if handler:
        overrides["handler"] = handler
    if overrides:
        # The API's name / handler win over the manifest's (TorchServe's rule); the manifest sent to
        # workers says the same, so the handler's context agrees with the server.
        manifest = dict(archive.manifest)
        manifest["model"] = {**manifest.get("model", {}), 
            "modelName": overrides.get("model_name", archive.model_name),
            "handler": overrides.get("handler", archive.handler)
        }
        archive = dataclasses.replace(archive, manifest=manifest, **overrides)
    return archive


async def install_dependencies(archive: ModelArchive) -> dict[str, str]:
    """``install_py_dep_per_model``: pip-install the archive's requirements file into the model
    directory (TorchServe installs with ``-t model_dir``); returns the worker environment to use."""
    requirements = archive.requirements_file
    if requirements is None:
        return {}
    target = archive.model_dir / DEPS_DIR
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-U", "-t", str(target),
            "-r", str(requirements)]
    # subprocess.run in a thread, not create_subprocess_exec: see frontend/workers/process.py (ChildProcess).
    proc = await asyncio.get_running_loop().run_in_executor(None, functools.partial(
        subprocess.run, argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    if proc.returncode != 0:
        tail = proc.stdout.decode("utf-8", "replace")[-2000:]
        raise ModelLoadError(f"Custom pip package installation failed for {archive.model_name}: {tail}")
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path}
