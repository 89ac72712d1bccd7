"""``conveyor archive`` (also ``python -m backend.archiver``): write a model archive.

Same flags and the same MANIFEST.json as TorchServe's ``torch-model-archiver``, so an archive made
by either tool loads in either server::

    conveyor archive --model-name echo --version 1.0 --handler examples/echo/echo_handler.py \\
        --config-file examples/echo/model-config.yaml --export-path model_store

Layout: every given file at the archive root (``--extra-files`` directories contribute their
contents), plus ``MAR-INF/MANIFEST.json``. Formats: ``default`` (.mar, deflated zip), ``zip-store``
(.mar, stored), ``tgz`` (.tar.gz, under a ``<model-name>/`` top directory, as torch-model-archiver
does) and ``no-archive`` (the directory ``<export-path>/<model-name>/``). Differences from
torch-model-archiver: ``--version`` defaults to 1.0 instead of being required, and the archive is
written to a temporary name and renamed, so a failed run never leaves a half-written file.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import zipfile
from datetime import datetime
from pathlib import Path
from collections.abc import Sequence

from backend.archive import MANIFEST_PATH

ARCHIVER_VERSION = "conveyor-0.1.0"
EXTENSIONS = {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")
_SKIP_DIRS = {"__pycache__", "__MACOSX"}


class ArchiverError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor archive", description="Create a model archive (.mar / .tar.gz / dir)")
    p.add_argument("--model-name", required=True, help="model name; the archive is <model-name>.mar")
    p.add_argument("-v", "--version", default="1.0", help="model version (default 1.0)")
    p.add_argument("--handler", required=True,
                   help="handler file (file.py, file.py:Class, file.py:function) or a built-in name")
    p.add_argument("--serialized-file", help="weights: a state dict (eager) or a TorchScript .pt")
    p.add_argument("--model-file", help="python file defining the model's one nn.Module class (eager mode)")
    p.add_argument("--extra-files", help="comma-separated files, directories or globs to include")
    p.add_argument("-c", "--config-file", help="model-config.yaml")
    p.add_argument("-r", "--requirements-file", help="requirements.txt for the model")
    p.add_argument("--runtime", default="python", choices=["python", "python3", "LSP"])
    p.add_argument("--archive-format", default="default", choices=sorted(EXTENSIONS))
    p.add_argument("--export-path", default=os.getcwd(), help="directory to write to (default: cwd)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite an existing archive")
    return p


def _handler_file(handler: str) -> Path | None:
    """The file to ship for ``handler``, or None for a built-in/importable name."""
    module_part = handler.split(":", 1)[0]
    for candidate in (module_part, module_part + ".py"):
        if Path(candidate).is_file():
            return Path(candidate)
    if module_part.endswith(".py") or os.sep in module_part:
        raise ArchiverError(f"handler file not found: {module_part}")
    return None  # e.g. "text_generation": resolved by the worker under handlers.


def _add_tree(files: dict[str, Path], root: Path, prefix: str = "") -> None:
    for entry in sorted(root.iterdir()):
        if (entry.is_dir() and entry.name.startswith(".")) or entry.name in _SKIP_DIRS:
            continue
        arc = f"{prefix}{entry.name}"
        if entry.is_dir():
            _add_tree(files, entry, arc + "/")
        elif not entry.name.endswith(".pyc"):
            files[arc] = entry


def collect_files(args: argparse.Namespace) -> dict[str, Path]:
    """Archive name → source file, every one checked to exist."""
    files: dict[str, Path] = {}
    for flag in ("serialized_file", "model_file", "requirements_file", "config_file"):
        value = getattr(args, flag)
        if value:
            path = Path(value)
            if not path.is_file():
                raise ArchiverError(f"--{flag.replace('_', '-')}: file not found: {value}")
            files[path.name] = path
    handler_file = _handler_file(args.handler)
    if handler_file is not None:
        files[handler_file.name] = handler_file
    for item in (args.extra_files or "").split(","):
        item = item.strip()
        if not item:
            continue
        matches = sorted(glob.glob(item))
        if not matches:
            raise ArchiverError(f"--extra-files: nothing matches {item}")
        for match in map(Path, matches):
            if match.is_dir():
                _add_tree(files, match)  # a directory contributes its contents, as torch-model-archiver does
            else:
                files[match.name] = match
    return files


def build_manifest(args: argparse.Namespace) -> dict:
    """torch-model-archiver's manifest: same keys, same order, basenames only."""
    model: dict[str, str] = {"modelName": args.model_name}
    if args.serialized_file:
        model["serializedFile"] = os.path.basename(args.serialized_file)
    model["handler"] = os.path.basename(args.handler)
    if args.model_file:
        model["modelFile"] = os.path.basename(args.model_file)
    if args.version:
        model["modelVersion"] = args.version
    if args.requirements_file:
        model["requirementsFile"] = os.path.basename(args.requirements_file)
    if args.config_file:
        model["configFile"] = os.path.basename(args.config_file)
    return {
        "createdOn": datetime.now().strftime("%d/%m/%Y %H:%M:%S"),
        "runtime": args.runtime,
        "model": model,
        "archiverVersion": ARCHIVER_VERSION,
    }


def write_archive(args: argparse.Namespace, files: dict[str, Path], manifest: dict) -> Path:
    export = Path(args.export_path)
    out = export / f"{args.model_name}{EXTENSIONS[args.archive_format]}"
    if out.exists() and not args.force:
        raise ArchiverError(f"{out} already exists; use -f/--force to overwrite it")
    manifest_bytes = json.dumps(manifest, indent=2).encode("utf-8")
    if args.archive_format == "no-archive":
        staging = Path(tempfile.mkdtemp(prefix=f".{args.model_name}-", dir=export))
        for arc, src in files.items():
            (staging / arc).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, staging / arc)
        (staging / "MAR-INF").mkdir()
        (staging / MANIFEST_PATH).write_bytes(manifest_bytes)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
        return out
    fd, tmp_name = tempfile.mkstemp(prefix=f".{args.model_name}-", dir=export)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if args.archive_format == "tgz":
            with tarfile.open(tmp, "w:gz") as tf:
                for arc, src in files.items():
                    tf.add(src, arcname=f"{args.model_name}/{arc}", recursive=False)
                info = tarfile.TarInfo(f"{args.model_name}/{MANIFEST_PATH}")
                info.size = len(manifest_bytes)
                info.mtime = int(datetime.now().timestamp())
                tf.addfile(info, io.BytesIO(manifest_bytes))
        else:
            method = zipfile.ZIP_STORED if args.archive_format == "zip-store" else zipfile.ZIP_DEFLATED
            with zipfile.ZipFile(tmp, "w", method) as zf:
                for arc, src in files.items():
                    zf.write(src, arc)
                zf.writestr(MANIFEST_PATH, manifest_bytes)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not _NAME_RE.match(args.model_name):
            raise ArchiverError(f"model name {args.model_name!r} must match {_NAME_RE.pattern}")
        if not Path(args.export_path).is_dir():
            raise ArchiverError(f"--export-path {args.export_path} is not a directory")
        out = write_archive(args, collect_files(args), build_manifest(args))
    except (ArchiverError, OSError) as exc:
        print(f"conveyor archive: error: {exc}", file=sys.stderr)
        return 1
    print(f"Model archive written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
