"""ssd-stream.json validation: each bad input is refused with a message naming object, actual, expected."""

from __future__ import annotations

import copy
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import BadKitData, KitError
from sglang_ssd_stream.sidecar import (
    SidecarManifestError,
    SidecarPathEscape,
    SidecarShapeMismatch,
    SidecarSizeMismatch,
    SidecarTruncated,
    SidecarWarning,
    check_model_shape,
    filesystem_type,
    load_manifest,
)
from sglang_ssd_stream.sidecar.format import MAX_MANIFEST_BYTES


def _doc(artifact: Path) -> dict:
    return json.loads((artifact / "ssd-stream.json").read_text())


def _write(artifact: Path, doc) -> None:
    (artifact / "ssd-stream.json").write_text(json.dumps(doc) if not isinstance(doc, str) else doc)


def _expect(artifact: Path, doc, exc, *fragments):
    _write(artifact, doc)
    with pytest.raises(exc) as info:
        load_manifest(artifact)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert isinstance(info.value, BadKitData) and info.value.exit_code == 3
    return info.value


def test_valid_manifest_loads(small):
    _, art = small
    m = load_manifest(art)
    assert len(m.tables) == 1 and m.tables[0].layer == 2 and m.tables[0].file.is_file()
    assert load_manifest(art / "ssd-stream.json") == m


@pytest.mark.parametrize("key", ["format", "version", "tables"])
def test_missing_top_field(small, key):
    _, art = small
    doc = _doc(art)
    del doc[key]
    _expect(art, doc, SidecarManifestError, "missing field", key)


@pytest.mark.parametrize("key", ["layer", "path", "sha256", "dtype", "rows", "columns", "bytes"])
def test_missing_table_field(small, key):
    _, art = small
    doc = _doc(art)
    del doc["tables"][0][key]
    _expect(art, doc, SidecarManifestError, "tables[0] missing field", key)


def test_row_start_is_optional(small):
    _, art = small
    doc = _doc(art)
    del doc["tables"][0]["row_start"]
    _write(art, doc)
    assert load_manifest(art).tables[0].row_start == 0


@pytest.mark.parametrize("where", ["top", "table"])
def test_extra_field(small, where):
    _, art = small
    doc = _doc(art)
    (doc if where == "top" else doc["tables"][0])["surprise"] = 1
    _expect(art, doc, SidecarManifestError, "unknown field", "surprise")


def test_duplicate_key_is_refused(small):
    _, art = small
    text = (art / "ssd-stream.json").read_text()
    _expect(art, text.replace('"version": 1', '"version": 1, "version": 1'), SidecarManifestError, "duplicate key")


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("rows", 1 << 41, "tables[0].rows is 2199023255552"),
        ("columns", 1 << 20, "tables[0].columns is 1048576"),
        ("layer", 1 << 20, "tables[0].layer is 1048576"),
        ("bytes", 1 << 51, "tables[0].bytes"),
        ("path", "ple/" + "x" * 5000, "table path length is 5004"),
        ("sha256", "ab" * 1000, "tables[0].sha256"),
        ("rows", True, "tables[0].rows is True"),
        ("rows", 5003.0, "tables[0].rows is 5003.0"),
        ("rows", 0, "tables[0].rows is 0"),
        ("row_start", -1, "tables[0].row_start is -1"),
        ("dtype", "float16", "tables[0].dtype is 'float16'"),
        ("sha256", "A" * 64, "64 lowercase hex"),
    ],
)
def test_oversized_or_mistyped_fields(small, field, value, fragment):
    _, art = small
    doc = _doc(art)
    doc["tables"][0][field] = value
    _expect(art, doc, (SidecarManifestError, SidecarSizeMismatch), fragment)


def test_oversized_manifest_file(small):
    _, art = small
    doc = _doc(art)
    doc["tables"] = [copy.deepcopy(doc["tables"][0]) for _ in range(MAX_MANIFEST_BYTES // 200)]
    text = json.dumps(doc)
    assert len(text) > MAX_MANIFEST_BYTES
    _expect(art, text, SidecarManifestError, "manifest size")


@pytest.mark.parametrize("field,value,fragment", [("format", "safetensors", "format is 'safetensors'"),
                                                  ("version", 3, "version is 3"), ("version", True, "version is True"),
                                                  ("tables", [], "tables is '[]'")])
def test_unknown_format_or_version(small, field, value, fragment):
    _, art = small
    doc = _doc(art)
    doc[field] = value
    _expect(art, doc, SidecarManifestError, fragment)


def test_not_json(small):
    _, art = small
    _expect(art, "{not json", SidecarManifestError, "not valid JSON")


def test_deeply_nested_json_is_refused_not_a_traceback(small):
    _, art = small
    _expect(art, "[" * 100_000, SidecarManifestError, "nested too deeply")


def test_a_fifo_in_place_of_the_manifest_is_refused_without_hanging(small):
    _, art = small
    (art / "ssd-stream.json").unlink()
    os.mkfifo(art / "ssd-stream.json")  # no writer: a blocking open would hang for ever
    with pytest.raises(SidecarManifestError, match="not a regular file"):
        load_manifest(art)


def test_duplicate_layer(small):
    _, art = small
    doc = _doc(art)
    doc["tables"].append(dict(doc["tables"][0]))
    _expect(art, doc, SidecarManifestError, "tables[1].layer is 2")


@pytest.mark.parametrize("path", ["/etc/passwd", "../ckpt/config.json", "ple/../../ckpt/config.json"])
def test_path_escape_lexical(small, path):
    _, art = small
    doc = _doc(art)
    doc["tables"][0]["path"] = path
    e = _expect(art, doc, SidecarPathEscape, repr(path), "leaves the artifact directory")
    assert e.actual == path


def test_path_escape_through_symlink(small, tmp_path):
    _, art = small
    outside = tmp_path / "outside.bin"
    outside.write_bytes((art / "ple" / "layer-2.bin").read_bytes())
    os.symlink(outside, art / "ple" / "link.bin")
    doc = _doc(art)
    doc["tables"][0]["path"] = "ple/link.bin"
    _expect(art, doc, SidecarPathEscape, "symlink escape", str(outside))
    _write(art, doc)  # allowed when the caller names the directory as trusted
    assert load_manifest(art, trusted_roots=[tmp_path]).tables[0].file == outside


def test_symlink_inside_artifact_is_fine(small):
    _, art = small
    os.symlink("layer-2.bin", art / "ple" / "alias.bin")
    doc = _doc(art)
    doc["tables"][0]["path"] = "ple/alias.bin"
    _write(art, doc)
    assert load_manifest(art).tables[0].file.name == "layer-2.bin"


def test_huggingface_snapshot_blobs_are_inside(small, tmp_path):
    """HF snapshot files are symlinks into ../../blobs; that is part of the artifact."""
    _, art = small
    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    (snap / "ple").mkdir(parents=True)
    for src, blob in [(art / "ple" / "layer-2.bin", "b1"), (art / "ssd-stream.json", "b2")]:
        (repo / "blobs" / blob).write_bytes(src.read_bytes())
    os.symlink("../../../blobs/b1", snap / "ple" / "layer-2.bin")
    os.symlink("../../blobs/b2", snap / "ssd-stream.json")
    m = load_manifest(snap)
    assert m.root == snap and m.tables[0].file == (repo / "blobs" / "b1").resolve()


def test_bytes_not_rows_times_columns(small):
    _, art = small
    doc = _doc(art)
    doc["tables"][0]["bytes"] += 160
    _expect(art, doc, SidecarSizeMismatch, "bytes is 800640", "5003 × 160 × 1 = 800480")


def test_dtype_changes_the_expected_size(small):
    _, art = small
    doc = _doc(art)
    doc["tables"][0]["dtype"] = "bfloat16"  # same bytes, but bf16 would need twice as many
    _expect(art, doc, SidecarSizeMismatch, "5003 × 160 × 2 = 1600960")


def test_file_longer_than_declared(small):
    _, art = small
    with open(art / "ple" / "layer-2.bin", "ab") as f:
        f.write(b"\0")
    e = _expect(art, _doc(art), SidecarSizeMismatch, "has 800481 bytes, expected 800480")
    assert not isinstance(e, SidecarTruncated)


def test_truncated_file(small):
    _, art = small
    os.truncate(art / "ple" / "layer-2.bin", 4096)
    e = _expect(art, _doc(art), SidecarTruncated, "truncated", "4096 bytes, expected 800480")
    assert (e.actual, e.expected) == (4096, 800480)


def test_missing_table_file(small):
    _, art = small
    (art / "ple" / "layer-2.bin").unlink()
    _expect(art, _doc(art), SidecarManifestError, "does not exist")


def test_model_shape_mismatch(small):
    _, art = small
    t = load_manifest(art).tables[0]
    check_model_shape(t, dtype="torch.float8_e4m3fn", columns=160, rows=5003, row_range=(0, 5003))
    with pytest.raises(SidecarShapeMismatch, match="is float8_e4m3fn, but the model expects bfloat16"):
        check_model_shape(t, dtype="bfloat16", columns=160)
    with pytest.raises(SidecarShapeMismatch, match="has 160 columns, but the model expects 320"):
        check_model_shape(t, dtype="float8_e4m3fn", columns=320)
    with pytest.raises(SidecarShapeMismatch, match=r"holds rows \[0, 5003\), but the model expects \[0, 5120\)"):
        check_model_shape(t, dtype="float8_e4m3fn", columns=160, rows=5120)
    with pytest.raises(SidecarShapeMismatch, match=r"not this rank's rows \[4000, 6000\)"):
        check_model_shape(t, dtype="float8_e4m3fn", columns=160, row_range=(4000, 6000))
    with pytest.raises(SidecarShapeMismatch, match="no PLE table for layer 5"):
        load_manifest(art).table(5)


def test_errors_pickle_with_their_data(small):
    _, art = small
    os.truncate(art / "ple" / "layer-2.bin", 10)
    with pytest.raises(SidecarTruncated) as info:
        load_manifest(art)
    e2 = pickle.loads(pickle.dumps(info.value))
    assert type(e2) is SidecarTruncated and str(e2) == str(info.value)
    assert (e2.actual, e2.expected, e2.path) == (10, 800480, info.value.path)
    assert isinstance(e2, KitError) and isinstance(e2, ValueError) and e2.exit_code == 3


# ------------------------------------------------------------------ network filesystems

def _mounts(tmp_path: Path, art: Path, fstype: str) -> str:
    p = tmp_path / "mounts"
    mnt = str(art).replace(" ", "\\040")
    p.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {mnt} {fstype} rw,vers=4.2 0 0\n"
                 f"tmpfs {mnt}/other tmpfs rw 0 0\n")
    return str(p)


def test_network_filesystem_warns(small, tmp_path, caplog):
    _, art = small
    mounts = _mounts(tmp_path, art, "nfs4")
    assert filesystem_type(art / "ple" / "layer-2.bin", mounts_path=mounts) == "nfs4"
    with pytest.warns(SidecarWarning, match=r"network filesystem \(nfs4\)"):
        load_manifest(art, mounts_path=mounts)
    assert "network filesystem" in caplog.text


def test_local_filesystem_does_not_warn(small, tmp_path):
    _, art = small
    mounts = _mounts(tmp_path, art, "xfs")
    assert filesystem_type(art / "ple" / "layer-2.bin", mounts_path=mounts) == "xfs"
    assert filesystem_type("/somewhere/else", mounts_path=mounts) == "ext4"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_manifest(art, mounts_path=mounts)


def test_real_proc_mounts_is_parsed():
    assert filesystem_type("/") is not None
