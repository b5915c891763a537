"""An in-place PLE sidecar (issue 41) through the real sglang 0.5.23 PLE path (CPU, TRITON_INTERPRET=1).

The checkpoint directory itself is ``--model-path``, holding ``ssd-stream.json`` written by
``build_in_place`` (regions of its own shards, no copy). The reference is sglang's own offload table,
unhooked, filled by its real ``load_weights`` from the same shards, gathered by its real kernel
(``check_ple_hook.py``'s stand-ins and helpers, imported from there so both files prove the same path).
"""

from __future__ import annotations

import shutil

import check_ple_hook as hook
import pytest
import torch
from check_ple_hook import COLS, LAYER, PARTS, ROWS, _config, _gather, _ids, _Model

env = hook.env  # the same checkpoints and installed hooks (a module-scoped fixture: built once here too)
_uncached = hook._uncached  # autouse: the uncached readers unless a test sets a budget


def _in_place(env, tmp_path, dtype):
    """A copy of the checkpoint (the shared one stays without a manifest) with its in-place manifest."""
    from sglang_ssd_stream.sidecar.in_place import build_in_place

    ckpt = tmp_path / "ckpt"
    shutil.copytree(env.ck[dtype].path, ckpt)
    build_in_place(ckpt, progress=False)
    return ckpt


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("tp", [(0, 1), (0, 2), (1, 2)])
def test_in_place_lookup_bit_identical_to_sglang_own_table(env, tmp_path, monkeypatch, dtype, tp, io):
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ssd_stream.staging.gather import SidecarGather

    q = env.q
    monkeypatch.delenv("SGLANG_SSD_STREAM_SIDECAR", raising=False)
    monkeypatch.setenv("SGLANG_SSD_STREAM_IO", io)
    ref = _Model(q, _config(dtype, table_dir=str(tmp_path / "tbl")), tp)
    ref.load(q, env.ck[dtype].path)
    ids = _ids(q, ref.ngram, 96, seed=tp[0] * 10 + tp[1] + 3)
    ids[0, 0], ids[1, 0], ids[2, 0] = 0, ROWS - 1, ids[3, 0]  # first/last rows, a duplicate
    expected = _gather(ref.ngram.ngram_embedding, ids)

    ckpt = _in_place(env, tmp_path, dtype)
    with get_context().override_server_args():
        get_context().set_server_args(ServerArgs(model_path=str(ckpt)))  # the checkpoint holds ssd-stream.json
        ours = _Model(q, _config(dtype, table_dir=str(tmp_path / "must-not-exist")), tp)
        emb = ours.ngram.ngram_embedding
        loaded = ours.load(q, ckpt)
        got = _gather(emb, ids)
    assert not (tmp_path / "must-not-exist").exists()
    assert isinstance(emb._ssd_stream, SidecarGather)
    table = emb._ssd_stream.reader.table
    assert table.in_place and len(table.regions) == PARTS and len(table.files) == 2 and table.columns == COLS
    assert f"model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight" not in loaded
    assert ours._ssd_stream_spot_checks == PARTS // tp[1]  # each shard this rank holds, read back in place
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # bit for bit


def test_a_tampered_region_is_refused_before_it_serves(env, tmp_path, monkeypatch):
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ssd_stream.sidecar import load_manifest
    from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch

    monkeypatch.delenv("SGLANG_SSD_STREAM_SIDECAR", raising=False)
    ckpt = _in_place(env, tmp_path, "float8_e4m3fn")
    region = load_manifest(ckpt).tables[0].regions[2]
    with open(region.file, "r+b") as f:
        f.seek(region.offset + 4321)
        b = f.read(1)
        f.seek(region.offset + 4321)
        f.write(bytes([b[0] ^ 1]))
    with get_context().override_server_args():
        get_context().set_server_args(ServerArgs(model_path=str(ckpt)))
        with pytest.raises(SidecarChecksumMismatch, match=f"tensor {region.tensor}"):
            _Model(env.q, _config("float8_e4m3fn"), (0, 1))


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_in_place_through_the_row_cache_bit_identical(env, tmp_path, monkeypatch, tp):
    """The default read path: the C row cache reads misses at each region's offset."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ssd_stream.sidecar.row_cache import RowCache

    q, dtype = env.q, "float8_e4m3fn"
    monkeypatch.delenv("SGLANG_SSD_STREAM_SIDECAR", raising=False)
    monkeypatch.setenv("SGLANG_SSD_STREAM_ROW_CACHE_MB", "64")
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "home"))
    ref = _Model(q, _config(dtype, table_dir=str(tmp_path / "tbl")), tp)
    ref.load(q, env.ck[dtype].path)
    ids = _ids(q, ref.ngram, 96, seed=41 + tp[0])
    expected = _gather(ref.ngram.ngram_embedding, ids)
    ckpt = _in_place(env, tmp_path, dtype)
    with get_context().override_server_args():
        get_context().set_server_args(ServerArgs(model_path=str(ckpt)))
        ours = _Model(q, _config(dtype), tp)
        ours.load(q, ckpt)
        emb = ours.ngram.ngram_embedding
        got = [_gather(emb, ids) for _ in range(2)]  # misses read from the shards, then hits from the cache
    cache = emb._ssd_stream.reader
    assert isinstance(cache, RowCache) and cache.table.in_place and cache.stats["hits"] > 0
    assert all(torch.equal(g.view(torch.int16), expected.view(torch.int16)) for g in got)


def _engine_default(name: str):
    """sglang's own default of a model-loading server argument (``--weight-loader-disable-mmap`` etc.)."""
    import msgspec
    from sglang.srt.arg_groups.fields.model import Model

    return next(f.default for f in msgspec.structs.fields(Model) if f.name == name)


@pytest.mark.parametrize("disable_mmap", [None, True], ids=["default", "disable-mmap"])
def test_sglangs_weight_iterator_maps_a_ple_shard_unless_mmap_is_disabled(tmp_path, disable_mmap):
    """Serving the checkpoint itself (``--model-path`` the checkpoint, its in-place manifest there): the default
    loader's iterator hands each PLE shard to the load hook as a view of the file's mapping, of which the hook
    reads one row (the spot check): the table is not read into memory. ``--weight-loader-disable-mmap`` reads
    each shard file whole into anonymous memory instead (docs/sidecar.md says so)."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from tests.loader_residency import residency, write_ple_shard

    path = tmp_path / "model-00001-of-00001.safetensors"
    nbytes = write_ple_shard(path)
    if disable_mmap is None:
        disable_mmap = _engine_default("weight_loader_disable_mmap")
        assert disable_mmap is False
    r = residency(safetensors_weights_iterator([str(path)], disable_mmap=disable_mmap), path)
    if disable_mmap:
        assert r.mapped_file is None and r.anon_growth >= nbytes, r
    else:
        assert r.mapped_file == str(path) and r.anon_growth < nbytes // 8, r
