"""Builder: incomplete checkpoints are refused; an interrupted build leaves nothing half-done."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest
from conftest import make_checkpoint, shard_rows_via_safetensors

from sglang_ssd_stream.errors import EnvironmentProblem, RefusedSourceState
from sglang_ssd_stream.sidecar import SidecarCheckpointError, SidecarReader, load_manifest
from sglang_ssd_stream.sidecar import build as build_mod
from sglang_ssd_stream.sidecar.build import build_sidecar, find_ple_shards


def test_trailing_empty_shards_and_no_index(tmp_path):
    # 10 rows in 8 parts: ceil = 2 rows per shard, shards 5..7 are empty and absent
    ck = make_checkpoint(tmp_path / "ck", {0: ("bfloat16", 10, 4)}, parts=8, index=False)
    src = find_ple_shards(ck.path)[0]
    assert (src.rows, src.columns, len(src.shards), src.dtype) == (10, 4, 5, "bfloat16")
    res = build_sidecar(ck.path, tmp_path / "out", progress=False)
    t = res.manifest.table(0)
    assert t.file.read_bytes() == ck.tables[0].tobytes() == shard_rows_via_safetensors(ck.path, 0).tobytes()


def test_parts_from_config_and_override(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 1000, 16)}, parts=7)
    assert len(find_ple_shards(ck.path)[1].shards) == 7
    with pytest.raises(SidecarCheckpointError, match=r"has 7 shards, expected at most split_ngram_parts = 4"):
        find_ple_shards(ck.path, split_ngram_parts=4)
    with pytest.raises(SidecarCheckpointError, match=r"has 143 rows, expected 100 \(ceil\(1000 / 10\) = 100"):
        find_ple_shards(ck.path, split_ngram_parts=10)
    # a last shard shorter than the split rule allows: the rows no longer add up
    ck2 = make_checkpoint(tmp_path / "ck2", {1: ("float8_e4m3fn", 1000, 16)}, parts=7, resize_shard={1: (6, 10)})
    with pytest.raises(SidecarCheckpointError,
                       match=r"shard_0.weight has 143 rows, expected 124 \(ceil\(868 / 7\) = 124"):
        find_ple_shards(ck2.path)


def test_missing_shard(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {4: ("float8_e4m3fn", 1000, 16)}, parts=8, drop_shards={4: [3]})
    with pytest.raises(SidecarCheckpointError, match=r"PLE layer 4 is missing shard\(s\) \[3\]"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "ssd-stream.json").exists()


def test_wrong_shard_size(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {4: ("float8_e4m3fn", 1000, 16)}, parts=8, resize_shard={4: (2, 100)})
    with pytest.raises(SidecarCheckpointError, match=r"shard_2.weight has 100 rows, expected 125 like shard_0"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)


def test_no_ple_tensors(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {4: ("float8_e4m3fn", 100, 16)}, parts=2, drop_shards={4: [0, 1]})
    with pytest.raises(SidecarCheckpointError, match="no PLE shard tensors"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)


def test_expected_shape_and_layer_filter(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 100, 16), 2: ("bfloat16", 50, 16)}, parts=4)
    with pytest.raises(SidecarCheckpointError, match="PLE layer 1 has 100 rows, expected 99"):
        build_sidecar(ck.path, tmp_path / "out", expected_rows=99, progress=False)
    with pytest.raises(SidecarCheckpointError, match="PLE layer 1 has 16 columns, expected 160"):
        build_sidecar(ck.path, tmp_path / "out", expected_columns=160, progress=False)
    with pytest.raises(SidecarCheckpointError, match=r"no PLE shards for layer\(s\) \[9\]"):
        build_sidecar(ck.path, tmp_path / "out", layers=[9], progress=False)
    res = build_sidecar(ck.path, tmp_path / "out", layers=[2], progress=False)
    assert [t.layer for t in res.manifest.tables] == [2] and list(res.scales) == [2]


def test_existing_sidecar_needs_force(small):
    ck, art = small
    before = (art / "ssd-stream.json").read_bytes()
    with pytest.raises(RefusedSourceState, match="already exists; pass --force"):
        build_sidecar(ck.path, art, progress=False)
    assert (art / "ssd-stream.json").read_bytes() == before
    res = build_sidecar(ck.path, art, force=True, progress=False)
    assert (art / "ssd-stream.json").read_bytes() == before and res.verify.ok


def test_interrupted_build_leaves_no_manifest_and_reruns_clean(tmp_path, monkeypatch):
    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 3000, 160), 2: ("bfloat16", 2000, 160)}, parts=4)
    out = tmp_path / "out"
    real = build_mod._copy_layer
    calls = {"n": 0}

    def dies_on_second_layer(src, dest, buf, bar):
        calls["n"] += 1
        if calls["n"] == 2:
            dest.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dest, buf, bar)

    monkeypatch.setattr(build_mod, "_copy_layer", dies_on_second_layer)
    with pytest.raises(EnvironmentProblem, match="No space left on device"):
        build_sidecar(ck.path, out, progress=False)
    assert not (out / "ssd-stream.json").exists()
    assert sorted(p.name for p in (out / "ple").iterdir()) == []  # partials removed, nothing renamed
    monkeypatch.setattr(build_mod, "_copy_layer", real)
    res = build_sidecar(ck.path, out, progress=False)
    for layer in (1, 2):
        assert res.manifest.table(layer).file.read_bytes() == ck.tables[layer].tobytes()


def test_failed_forced_rebuild_keeps_the_old_sidecar(small, monkeypatch, tmp_path):
    from sglang_ssd_stream.sidecar import verify_sidecar

    ck, art = small
    before = {p.relative_to(art): p.read_bytes() for p in art.rglob("*") if p.is_file()}
    monkeypatch.setattr(build_mod, "_copy_layer", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(EnvironmentProblem, match="EIO"):
        build_sidecar(ck.path, art, force=True, progress=False)
    after = {p.relative_to(art): p.read_bytes() for p in art.rglob("*") if p.is_file()}
    assert after == before  # nothing lost, no partial files left
    assert verify_sidecar(art, use_cache=False, progress=False, cache_dir=tmp_path / "c").ok


def test_forced_rebuild_drops_the_old_manifest_before_replacing_tables(small, monkeypatch):
    ck, art = small
    real_replace = build_mod.os.replace

    def crash_on_table_rename(src, dst):
        if str(dst).endswith(".bin"):
            assert not (art / "ssd-stream.json").exists()  # the old manifest is already gone
            raise OSError(errno.EIO, "rename failed")
        return real_replace(src, dst)

    monkeypatch.setattr(build_mod.os, "replace", crash_on_table_rename)
    with pytest.raises(EnvironmentProblem, match="rename failed"):
        build_sidecar(ck.path, art, force=True, progress=False)
    assert not (art / "ssd-stream.json").exists()


def test_not_enough_disk_space(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 3000, 160)}, parts=4)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(EnvironmentProblem, match="needs 480000 bytes, but only 1000 bytes are free"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)


def test_in_place_build_uses_the_checkpoint_scale(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 3000, 160)}, parts=4, files=1)
    res = build_sidecar(ck.path, progress=False)
    assert res.manifest.root == ck.path and not (ck.path / "model-plefp8-scale.safetensors").exists()
    assert res.scale_file == str(ck.path / "model-00001-of-00001.safetensors")
    m = load_manifest(ck.path)
    ids = np.array([2999, 0, 5, 2999])
    out = np.empty((4, 160), np.uint8)
    with SidecarReader(m.table(1), max_rows=4) as r:
        r.read_rows(ids, out)
    assert np.array_equal(out, ck.tables[1][ids])
    json.loads((ck.path / "ssd-stream.json").read_text())


def test_damaged_safetensors_file(tmp_path):
    import struct

    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 100, 16)}, parts=2, files=1)
    f = ck.path / "model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    f.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(SidecarCheckpointError, match="safetensors header length 1000000000000 is invalid"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)
    f.write_bytes(bytes(data[: len(data) - 50]))  # tensor bytes cut off
    with pytest.raises(SidecarCheckpointError, match="does not fit shape"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)


def test_index_naming_a_missing_file(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {1: ("float8_e4m3fn", 100, 16)}, parts=2, files=2)
    (ck.path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SidecarCheckpointError, match="listed in model.safetensors.index.json but missing"):
        build_sidecar(ck.path, tmp_path / "out", progress=False)


def test_safetensors_library_has_the_last_word(tmp_path):
    """A header our parser would accept but the reference library refuses (a gap between tensors)."""
    import struct

    ck = tmp_path / "ck"
    ck.mkdir()
    name = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight"
    header = {name: {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [8, 24]}}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(24))
    (ck / "config.json").write_text(json.dumps({"split_ngram_parts": 1}))
    with pytest.raises(SidecarCheckpointError, match="safetensors refuses the file"):
        build_sidecar(ck, tmp_path / "out", progress=False)
