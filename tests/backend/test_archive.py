"""Archives: safe extraction, manifest + YAML parsing, interop with torch-model-archiver both ways."""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from backend.archive import ArchiveError, open_archive
from backend.archiver import main as archiver_main

pytestmark = pytest.mark.timeout(30)

MANIFEST = {"runtime": "python", "model": {"modelName": "m", "handler": "h.py", "modelVersion": "2.0",
                                           "configFile": "model-config.yaml"}}
CONFIG = "batchSize: 4\nmaxBatchDelay: 50\ncontinuousBatching: true\nhandler:\n  cache: {capacity: 3}\n"


def make_mar(path: Path, extra: dict[str, bytes] | None = None, manifest: dict | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest or MANIFEST))
        zf.writestr("h.py", "def handle(data, context):\n    return data\n")
        zf.writestr("model-config.yaml", CONFIG)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return path


def tar_add(tf: tarfile.TarFile, name: str, data: bytes = b"", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data) if data else None)


def make_tgz(path: Path, prefix: str = "m/", evil: tuple | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        tar_add(tf, f"{prefix}MAR-INF/MANIFEST.json", json.dumps(MANIFEST).encode())
        tar_add(tf, f"{prefix}h.py", b"def handle(data, context):\n    return data\n")
        tar_add(tf, f"{prefix}model-config.yaml", CONFIG.encode())
        if evil:
            tar_add(tf, evil[0], **evil[1])
    return path


def test_mar_manifest_and_yaml(tmp_path: Path) -> None:
    archive = open_archive(make_mar(tmp_path / "m.mar"), tmp_path / "x")
    assert archive.model_name == "m" and archive.model_version == "2.0" and archive.handler == "h.py"
    assert archive.archive_format == "mar" and archive.extracted
    assert archive.model_yaml_config == {"batchSize": 4, "maxBatchDelay": 50, "continuousBatching": True,
                                         "handler": {"cache": {"capacity": 3}}}
    assert (archive.model_dir / "h.py").is_file() and archive.model_dir.parent == tmp_path / "x"
    assert json.loads(archive.model_yaml_config_json)["batchSize"] == 4
    assert json.loads(archive.manifest_json)["model"]["modelName"] == "m"


def test_tgz_with_top_directory(tmp_path: Path) -> None:
    archive = open_archive(make_tgz(tmp_path / "m.tar.gz"), tmp_path / "x")
    assert archive.archive_format == "tgz" and archive.model_dir.name == "m"
    assert archive.extract_dir == archive.model_dir.parent and archive.extract_dir.parent == tmp_path / "x"
    assert archive.model_yaml_config["continuousBatching"] is True


def test_plain_directory_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text("def handle(d, c):\n    return d\n")
    (tmp_path / "model-config.yaml").write_text("batchSize: 2\n")
    with pytest.raises(ArchiveError, match="no handler"):
        open_archive(tmp_path, tmp_path / "x", model_name="d")
    archive = open_archive(tmp_path, tmp_path / "x", model_name="d", handler="h.py")
    assert archive.model_dir == tmp_path.resolve() and not archive.extracted
    assert archive.model_name == "d" and archive.model_yaml_config == {"batchSize": 2}
    assert archive.manifest["model"] == {"modelName": "d", "handler": "h.py", "configFile": "model-config.yaml"}


@pytest.mark.parametrize("name", ["../evil.py", "a/../../evil.py", "/etc/evil.py", "..\\evil.py", "C:/evil.py"])
def test_zip_slip_refused(tmp_path: Path, name: str) -> None:
    mar = make_mar(tmp_path / "bad.mar", {name: b"x"})
    with pytest.raises(ArchiveError) as err:
        open_archive(mar, tmp_path / "x")
    assert str(mar) in str(err.value) and repr(name) in str(err.value)
    assert not (tmp_path / "evil.py").exists()
    assert list((tmp_path / "x").iterdir()) == []  # nothing left behind


def test_zip_symlink_refused(tmp_path: Path) -> None:
    mar = make_mar(tmp_path / "bad.mar")
    with zipfile.ZipFile(mar, "a") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "../../etc/passwd")
    with pytest.raises(ArchiveError, match="'link' points outside"):
        open_archive(mar, tmp_path / "x")


@pytest.mark.parametrize("evil, message", [
    (("../evil.py", {}), "escapes"),
    (("/tmp/evil.py", {}), "absolute"),
    (("m/link", {"type": tarfile.SYMTYPE, "linkname": "../../outside"}), "points outside"),
    (("m/abs", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}), "absolute"),
    (("m/hard", {"type": tarfile.LNKTYPE, "linkname": "../outside"}), "points outside"),
    (("m/dev", {"type": tarfile.CHRTYPE}), "device"),
    (("m/fifo", {"type": tarfile.FIFOTYPE}), "device"),
])
def test_tar_escapes_refused(tmp_path: Path, evil: tuple, message: str) -> None:
    tgz = make_tgz(tmp_path / "bad.tgz", evil=evil)
    with pytest.raises(ArchiveError, match=message) as err:
        open_archive(tgz, tmp_path / "x")
    assert str(tgz) in str(err.value) and repr(evil[0]) in str(err.value)
    assert list((tmp_path / "x").iterdir()) == []


def test_tar_symlink_inside_is_fine(tmp_path: Path) -> None:
    tgz = make_tgz(tmp_path / "ok.tgz", evil=("m/alias.py", {"type": tarfile.SYMTYPE, "linkname": "h.py"}))
    archive = open_archive(tgz, tmp_path / "x")
    assert (archive.model_dir / "alias.py").read_text().startswith("def handle")


def test_bad_manifest_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="no 'model' object"):
        open_archive(make_mar(tmp_path / "a.mar", manifest={"runtime": "python"}), tmp_path / "x")
    bad_config = {**MANIFEST, "model": {**MANIFEST["model"], "configFile": "bad.yaml"}}
    mar = make_mar(tmp_path / "b.mar", {"bad.yaml": b"batchSize: [unclosed\n"}, manifest=bad_config)
    with pytest.raises(ArchiveError, match="bad.yaml"):
        open_archive(mar, tmp_path / "x")
    (tmp_path / "c.mar").write_bytes(b"not a zip")
    with pytest.raises(ArchiveError, match="c.mar"):
        open_archive(tmp_path / "c.mar", tmp_path / "x")


def run_torch_model_archiver(tmp_path: Path, fmt: str) -> dict:
    """torch-model-archiver itself, in a subprocess (as a user runs it); returns the flags used."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "my_handler.py").write_text("def handle(data, context):\n    return data\n")
    (src / "model-config.yaml").write_text("batchSize: 3\n")
    (src / "weights.pt").write_bytes(b"w")
    (tmp_path / "out").mkdir()
    # Its staging dir is /tmp/<model-name>: a unique name keeps parallel runs apart.
    flags = {"--model-name": f"tma_{fmt.replace('-', '')}_{tmp_path.name}", "--version": "1.5",
             "--handler": str(src / "my_handler.py"), "--serialized-file": str(src / "weights.pt"),
             "--config-file": str(src / "model-config.yaml"), "--export-path": str(tmp_path / "out"),
             "--archive-format": fmt}
    done = subprocess.run([sys.executable, "-m", "model_archiver.model_packaging",
                           *[x for kv in flags.items() for x in kv]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return flags


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_torch_model_archiver_output_loads(tmp_path: Path, fmt: str) -> None:
    flags = run_torch_model_archiver(tmp_path, fmt)
    produced = next((tmp_path / "out").iterdir())
    archive = open_archive(produced, tmp_path / "x")
    assert archive.model_name == flags["--model-name"] and archive.model_version == "1.5"
    assert archive.handler == "my_handler.py" and archive.model_yaml_config == {"batchSize": 3}
    assert (archive.model_dir / "weights.pt").read_bytes() == b"w"


@pytest.mark.slow
def test_our_archiver_matches_torch_model_archiver_manifest(tmp_path: Path) -> None:
    flags = run_torch_model_archiver(tmp_path, "default")
    name = flags["--model-name"]
    theirs = open_archive(tmp_path / "out" / f"{name}.mar", tmp_path / "x").manifest
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    flags["--export-path"] = str(ours_dir)
    assert archiver_main([x for kv in flags.items() for x in kv]) == 0
    ours = open_archive(ours_dir / f"{name}.mar", tmp_path / "x").manifest
    assert list(ours) == list(theirs)  # same keys, same order
    assert ours["model"] == theirs["model"]
    assert ours["runtime"] == theirs["runtime"] == "python"
    with zipfile.ZipFile(ours_dir / f"{name}.mar") as a, zipfile.ZipFile(tmp_path / "out" / f"{name}.mar") as b:
        assert sorted(a.namelist()) == sorted(b.namelist())


@pytest.mark.parametrize("fmt, suffix", [("tgz", ".tar.gz"), ("no-archive", ""), ("zip-store", ".mar")])
def test_our_archiver_formats_load(tmp_path: Path, fmt: str, suffix: str) -> None:
    src = tmp_path / "src"
    (src / "assets" / "sub").mkdir(parents=True)
    (src / "h.py").write_text("def handle(data, context):\n    return data\n")
    (src / "assets" / "vocab.txt").write_text("v")
    (src / "assets" / "sub" / "deep.txt").write_text("d")
    args = ["--model-name", "ours", "--handler", f"{src / 'h.py'}:handle", "--extra-files", str(src / "assets"),
            "--archive-format", fmt, "--export-path", str(tmp_path)]
    assert archiver_main(args) == 0
    assert archiver_main(args) == 1  # exists: refused without --force
    assert archiver_main([*args, "-f"]) == 0
    archive = open_archive(tmp_path / f"ours{suffix}", tmp_path / "x")
    assert archive.handler == "h.py:handle" and archive.model_version == "1.0"
    assert (archive.model_dir / "vocab.txt").read_text() == "v"
    assert (archive.model_dir / "sub" / "deep.txt").read_text() == "d"


def test_archiver_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert archiver_main(["--model-name", "bad name", "--handler", "x", "--export-path", str(tmp_path)]) == 1
    assert archiver_main(["--model-name", "m", "--handler", "missing.py", "--export-path", str(tmp_path)]) == 1
    assert "handler file not found" in capsys.readouterr().err
    # A built-in handler name is not a file: nothing to copy, the manifest keeps the name.
    assert archiver_main(["--model-name", "tg", "--handler", "text_generation", "--export-path", str(tmp_path)]) == 0
    assert open_archive(tmp_path / "tg.mar", tmp_path / "x").handler == "text_generation"


@pytest.mark.slow
def test_python_dash_m_archiver(tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text("def handle(d, c):\n    return d\n")
    done = subprocess.run([sys.executable, "-m", "backend.archiver", "--model-name", "cli", "--handler",
                           str(tmp_path / "h.py"), "--export-path", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli.mar").is_file()
