"""Model archives: ``.mar`` (zip), ``.tar.gz``/``.tgz`` and plain directories (no-archive).

Pure stdlib + PyYAML (the frontend imports this for registration; it must not pull in torch).

Layout, as torch-model-archiver writes it: the model files at the root and ``MAR-INF/MANIFEST.json``::

    {"createdOn": "...", "runtime": "python", "archiverVersion": "...",
     "model": {"modelName": ..., "modelVersion": ..., "handler": ..., "serializedFile": ...,
               "modelFile": ..., "configFile": ..., "requirementsFile": ...}}

A tar archive may hold everything under one top directory (torch-model-archiver's ``tgz`` does:
``<model-name>/...``); that directory is then the model dir. The manifest's ``configFile``
(model-config.yaml) is parsed into ``model_yaml_config``.

Extraction is all-or-nothing: every entry is checked before anything is written, and an entry that
could escape the target directory (``..``, an absolute path, a symlink or hard link pointing out, a
device or FIFO) fails the whole archive with ``ArchiveError`` naming the archive and the entry.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

MANIFEST_PATH = "MAR-INF/MANIFEST.json"
DEFAULT_CONFIG_FILE = "model-config.yaml"
TAR_SUFFIXES = (".tar.gz", ".tgz")


class ArchiveError(Exception):
    """An archive that cannot be used; the message names the archive (and the entry or key)."""


@dataclass(frozen=True)
class ModelArchive:
    """A model ready to load: where its files are and what its manifest and config say."""

    manifest: dict
    model_dir: Path  # the extracted archive, or the no-archive directory itself
    model_yaml_config: dict
    model_name: str
    model_version: str
    handler: str
    source: Path  # the archive file or directory this came from
    archive_format: str  # "mar", "tgz" or "no-archive"
    extracted: bool  # True: the files are a copy under extract_root (see extract_dir)
    config_file: Path | None = None
    requirements_file: Path | None = None
    extract_dir: Path | None = None  # the directory extraction created (model_dir or its parent): delete this

    @property
    def manifest_json(self) -> str:
        return json.dumps(self.manifest)

    @property
    def model_yaml_config_json(self) -> str:
        # YAML can hold dates and other non-JSON scalars: send them as strings.
        return json.dumps(self.model_yaml_config, default=str)


# ---------------------------------------------------------------------------------------- safety


def _entry_parts(archive: Path, name: str) -> tuple[str, ...]:
    """The relative path parts of an entry name, or ArchiveError if it could land outside the target."""
    unified = name.replace("\\", "/")
    if unified.startswith("/") or re.match(r"^[A-Za-z]:", unified):
        raise ArchiveError(f"archive {archive}: entry {name!r} has an absolute path")
    parts = tuple(p for p in PurePosixPath(unified).parts if p not in ("", "."))
    if ".." in parts:
        raise ArchiveError(f"archive {archive}: entry {name!r} escapes the target directory ('..')")
    return parts


def _link_target_inside(archive: Path, entry: str, target: str, relative_to: tuple[str, ...]) -> None:
    unified = target.replace("\\", "/")
    if unified.startswith("/") or re.match(r"^[A-Za-z]:", unified):
        raise ArchiveError(f"archive {archive}: link {entry!r} points to an absolute path {target!r}")
    resolved = posixpath.normpath(posixpath.join(*relative_to, unified) if relative_to else unified)
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        raise ArchiveError(f"archive {archive}: link {entry!r} points outside the target directory ({target!r})")


def _check_zip(archive: Path, zf: zipfile.ZipFile) -> None:
    for info in zf.infolist():
        parts = _entry_parts(archive, info.filename)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            # zipfile would write the link text as a regular file; refuse rather than mislead.
            target = zf.read(info).decode("utf-8", "replace")
            _link_target_inside(archive, info.filename, target, parts[:-1])
            raise ArchiveError(f"archive {archive}: entry {info.filename!r} is a symlink; symlinks are not "
                               "supported in zip archives")
        if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise ArchiveError(f"archive {archive}: entry {info.filename!r} is a device or special file")


def _check_tar(archive: Path, tf: tarfile.TarFile) -> None:
    for member in tf.getmembers():
        parts = _entry_parts(archive, member.name)
        if member.issym():
            _link_target_inside(archive, member.name, member.linkname, parts[:-1])
        elif member.islnk():
            _link_target_inside(archive, member.name, member.linkname, ())  # hard links are archive-relative
        elif member.isdev() or member.isfifo() or not (member.isfile() or member.isdir()):
            raise ArchiveError(f"archive {archive}: entry {member.name!r} is a device or special file")


# ---------------------------------------------------------------------------------------- reading


def _read_json(path: Path, archive: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"archive {archive}: cannot read {MANIFEST_PATH}: {exc}") from exc
    if not isinstance(data, dict):
        raise ArchiveError(f"archive {archive}: {MANIFEST_PATH} is not a JSON object")
    return data


def load_yaml_config(path: Path) -> dict:
    """A model-config.yaml as a dict ({} when empty); ArchiveError naming the file otherwise."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ArchiveError(f"cannot parse model config {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArchiveError(f"model config {path} must be a YAML mapping, got {type(data).__name__}")
    return data


def _find_model_dir(root: Path) -> Path:
    """The directory holding MAR-INF: the root, or its only subdirectory (torch-model-archiver's tgz)."""
    if (root / MANIFEST_PATH).is_file():
        return root
    children = [p for p in root.iterdir() if not p.name.startswith(".")]
    if len(children) == 1 and children[0].is_dir() and (children[0] / MANIFEST_PATH).is_file():
        return children[0]
    return root


def archive_format_of(path: Path) -> str:
    if path.is_dir():
        return "no-archive"
    name = path.name.lower()
    if name.endswith(TAR_SUFFIXES):
        return "tgz"
    if name.endswith(".mar") or zipfile.is_zipfile(path):
        return "mar"
    raise ArchiveError(f"archive {path}: unknown format (expected .mar, .tar.gz, .tgz or a directory)")


def extract(path: Path, target: Path) -> None:
    """Extract ``path`` into the existing empty directory ``target`` after checking every entry."""
    fmt = archive_format_of(path)
    try:
        if fmt == "mar":
            with zipfile.ZipFile(path) as zf:
                _check_zip(path, zf)
                zf.extractall(target)
        else:
            with tarfile.open(path, "r:*") as tf:
                _check_tar(path, tf)
                tf.extractall(target, filter="data")  # the stdlib's own guard, as a second line
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"archive {path}: cannot extract: {exc}") from exc


def open_archive(
    path: str | Path,
    extract_root: str | Path,
    model_name: str | None = None,
    handler: str | None = None,
) -> ModelArchive:
    """Open a model archive or directory.

    Archives are extracted into a new directory under ``extract_root`` (created if needed); a
    directory is used in place. ``model_name``/``handler`` are fallbacks for a manifest that lacks
    them (a plain directory may have no manifest at all: then both are needed, and a
    ``model-config.yaml`` in it is used as its config).
    """
    source = Path(path).resolve()
    if not source.exists():
        raise ArchiveError(f"archive {source}: no such file or directory")
    fmt = archive_format_of(source)
    target: Path | None = None
    if fmt == "no-archive":
        model_dir = source
    else:
        root = Path(extract_root)
        root.mkdir(parents=True, exist_ok=True)
        stem = source.name.split(".")[0] or "model"
        target = Path(tempfile.mkdtemp(prefix=f"{stem}-", dir=root))
        try:
            extract(source, target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        model_dir = _find_model_dir(target)
    try:
        return _describe(source, fmt, model_dir, target, model_name, handler)
    except BaseException:
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)
        raise


def _describe(source: Path, fmt: str, model_dir: Path, extract_dir: Path | None, model_name: str | None,
              handler: str | None) -> ModelArchive:
    manifest_file = model_dir / MANIFEST_PATH
    if manifest_file.is_file():
        manifest = _read_json(manifest_file, source)
    elif fmt == "no-archive":
        manifest = {"runtime": "python", "model": {}}
    else:
        raise ArchiveError(f"archive {source}: no {MANIFEST_PATH}")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ArchiveError(f"archive {source}: {MANIFEST_PATH} has no 'model' object")
    name = model.get("modelName") or model_name
    if not name:
        raise ArchiveError(f"archive {source}: no model name (manifest model.modelName) and none given")
    handler_name = model.get("handler") or handler
    if not handler_name:
        raise ArchiveError(f"archive {source}: no handler (manifest model.handler) and none given")
    model.setdefault("modelName", name)
    model.setdefault("handler", handler_name)
    if "configFile" not in model and not manifest_file.is_file() and (model_dir / DEFAULT_CONFIG_FILE).is_file():
        model["configFile"] = DEFAULT_CONFIG_FILE

    config_path: Path | None = None
    config: dict[str, Any] = {}
    if model.get("configFile"):
        config_path = model_dir / str(model["configFile"])
        if not config_path.is_file():
            raise ArchiveError(f"archive {source}: configFile {model['configFile']!r} is not in the archive")
        config = load_yaml_config(config_path)
    requirements = model_dir / str(model["requirementsFile"]) if model.get("requirementsFile") else None
    return ModelArchive(
        manifest=manifest,
        model_dir=model_dir,
        model_yaml_config=config,
        model_name=str(name),
        model_version=str(model.get("modelVersion") or "1.0"),
        handler=str(handler_name),
        source=source,
        archive_format=fmt,
        extracted=extract_dir is not None,
        config_file=config_path,
        requirements_file=requirements,
        extract_dir=extract_dir,
    )
