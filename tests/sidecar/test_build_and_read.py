"""Builder -> sidecar -> reader is bit-identical to the rows safetensors reads from the shards."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import BF16_LAYER, BF16_ROWS, COLS, FP8_LAYER, FP8_ROWS

from sglang_ssd_stream.sidecar import (
    PAGE_SIZE,
    SidecarReader,
    find_weight_scales,
    load_manifest,
    rows_for_tokens,
)


def _straddling(row_bytes: int, rows: int, limit: int = 200) -> np.ndarray:
    r = np.arange(rows, dtype=np.int64)
    start = r * row_bytes
    hit = r[(start // PAGE_SIZE) != ((start + row_bytes - 1) // PAGE_SIZE)]
    assert hit.size > 0
    return hit[:: max(1, hit.size // limit)]


def _ids(rows: int, row_bytes: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, rows, n)
    dups = base[rng.integers(0, n, n // 4)]  # duplicates, in scattered positions
    special = np.array([0, 0, rows - 1, 1, rows - 2, rows - 1], dtype=np.int64)
    ids = np.concatenate([base, dups, special, _straddling(row_bytes, rows)])
    rng.shuffle(ids)
    return ids.astype(np.int64)


def test_built_tables_are_the_shards_byte_for_byte(big):
    ck, result, ref = big
    m = result.manifest
    assert [t.layer for t in m.tables] == [FP8_LAYER, BF16_LAYER]
    for t in m.tables:
        data = t.file.read_bytes()
        assert data == ref[t.layer].tobytes() == ck.tables[t.layer].tobytes()
        assert hashlib.sha256(data).hexdigest() == t.sha256
        assert t.row_start == 0 and t.columns == COLS
    assert m.table(FP8_LAYER).dtype == "float8_e4m3fn" and m.table(FP8_LAYER).rows == FP8_ROWS
    assert m.table(BF16_LAYER).dtype == "bfloat16" and m.table(BF16_LAYER).rows == BF16_ROWS
    doc = json.loads(m.path.read_text())
    assert doc["format"] == "sglang-ssd-stream" and doc["version"] == 1
    assert set(doc["tables"][0]) == {"layer", "path", "sha256", "dtype", "rows", "columns", "row_start", "bytes"}
    assert result.verify is not None and all(c.status == "verified" for c in result.verify.tables)


def test_weight_scale_copied_and_located(big):
    import torch
    from safetensors.torch import load_file

    ck, result, _ = big
    scales = find_weight_scales(result.manifest.root)
    assert sorted(scales) == sorted(ck.scales)
    loaded = load_file(result.scale_file)  # a real safetensors file
    for layer, s in scales.items():
        assert s.value == ck.scales[layer]
        assert loaded[s.tensor].dtype == torch.bfloat16 and loaded[s.tensor].item() == ck.scales[layer]
    # the checkpoint itself (no scale file; found through model.safetensors.index.json)
    assert {n: s.value for n, s in find_weight_scales(ck.path).items()} == ck.scales


@pytest.mark.parametrize("layer", [FP8_LAYER, BF16_LAYER])
@pytest.mark.parametrize("workers,direct,max_read,buffer", [(1, False, 256 << 10, None), (4, False, 8192, None),
                                                            (3, True, 64 << 10, None), (2, False, 4096, 3 * 4096)])
def test_reader_matches_shards(big, layer, workers, direct, max_read, buffer):
    _, result, ref = big
    t = result.manifest.table(layer)
    ids = _ids(t.rows, t.row_bytes, 6000, seed=layer + workers)
    out = np.full((ids.size, t.row_bytes), 0xAB, np.uint8)
    with SidecarReader(t, max_rows=4096, workers=workers, direct=direct, max_read_bytes=max_read,
                       buffer_bytes=buffer) as r:
        r.read_rows(ids, out)  # more ids than max_rows: processed in slices
        assert np.array_equal(out, ref[layer][ids])
        s = r.stats
        assert s["rows"] == ids.size and s["reads"] <= s["pages"] + s["waves"]  # a wave may re-read one page
        if buffer is not None:
            assert r.buffer_bytes == buffer and s["waves"] > 100  # tiny buffer: many waves, still exact


def test_coalescing_adjacent_pages(big):
    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    ids = np.arange(10_000, 26_000, dtype=np.int64)  # 2.56 MB contiguous, one wave
    out = np.empty((ids.size, t.row_bytes), np.uint8)
    with SidecarReader(t, max_rows=ids.size, workers=2, max_read_bytes=256 << 10) as r:
        r.read_rows(ids, out)
        s = r.stats
    assert np.array_equal(out, ref[FP8_LAYER][ids])
    first, last = 10_000 * 160 // PAGE_SIZE, (26_000 * 160 - 1) // PAGE_SIZE
    assert s["waves"] == 1 and s["pages"] == last - first + 1 == 626
    assert s["reads"] == -(-626 // 64) == 10  # adjacent pages coalesced into reads of <= 256 KiB


@pytest.mark.parametrize("lo,hi", [(0, 250_001), (250_001, 500_002), (750_002, FP8_ROWS)])
def test_tp_ranges_leave_other_rows_zero(big, lo, hi):
    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    ids = _ids(t.rows, t.row_bytes, 5000, seed=lo)
    out = np.full((ids.size, t.row_bytes), 0x5A, np.uint8)
    with SidecarReader(t, vocab_start=lo, vocab_end=hi, max_rows=ids.size, workers=2) as r:
        r.read_rows(ids, out)
    inside = (ids >= lo) & (ids < hi)
    assert inside.any() and (~inside).any()
    assert np.array_equal(out[inside], ref[FP8_LAYER][ids[inside]])
    assert not out[~inside].any()
    # summing the ranks' outputs (the TP all-reduce) gives the full rows
    total = np.zeros((ids.size, t.row_bytes), np.int64)
    for a, b in [(0, 333_334), (333_334, 666_668), (666_668, FP8_ROWS)]:
        part = np.empty((ids.size, t.row_bytes), np.uint8)
        with SidecarReader(t, vocab_start=a, vocab_end=b, max_rows=ids.size, workers=2) as r:
            r.read_rows(ids, part)
        total += part
    assert np.array_equal(total, ref[FP8_LAYER][ids])


def test_working_set_for_8192_token_chunks(big):
    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    max_rows = rows_for_tokens(8192)
    assert max_rows == 131_072
    with SidecarReader(t, max_rows=max_rows, workers=4) as r:
        assert r.buffer_bytes >= max_rows * t.row_bytes
        assert r.working_set_bytes <= 64 << 20  # the fixed-RAM target
        ids = np.random.default_rng(5).integers(0, t.rows, max_rows)
        out = np.empty((max_rows, t.row_bytes), np.uint8)
        r.read_rows(ids, out)
        assert np.array_equal(out, ref[FP8_LAYER][ids])
        r.read_rows(ids[:0], out[:0])  # empty lookups are fine


def test_decode_sized_reads_and_any_integer_dtype(big):
    _, result, ref = big
    t = result.manifest.table(BF16_LAYER)
    with SidecarReader(t, max_rows=256, workers=4) as r:
        for dtype in (np.int64, np.int32, np.uint32, np.uint64):
            ids = np.random.default_rng(7).integers(0, t.rows, 256).astype(dtype)
            out = np.empty((256, t.row_bytes), np.uint8)
            r.read_rows(ids, out)
            assert np.array_equal(out, ref[BF16_LAYER][ids.astype(np.int64)])


def test_row_start_offset_table(tmp_path, big):
    """A table holding only global rows [row_start, row_end) (e.g. one rank's slice)."""
    _, result, ref = big
    full = result.manifest.table(BF16_LAYER)
    start, stop = 10_000, 20_000
    (tmp_path / "ple").mkdir()
    data = ref[BF16_LAYER][start:stop].tobytes()
    (tmp_path / "ple" / "slice.bin").write_bytes(data)
    (tmp_path / "ssd-stream.json").write_text(json.dumps({"format": "sglang-ssd-stream", "version": 1, "tables": [
        {"layer": 7, "path": "ple/slice.bin", "sha256": hashlib.sha256(data).hexdigest(), "dtype": "bfloat16",
         "rows": stop - start, "columns": 160, "row_start": start, "bytes": len(data)}]}))
    t = load_manifest(tmp_path).table(7)
    ids = np.array([0, start, start + 1, stop - 1, stop, full.rows - 1, 15_000, start], dtype=np.int64)
    out = np.full((ids.size, t.row_bytes), 1, np.uint8)
    with SidecarReader(t, vocab_start=start, vocab_end=stop, max_rows=16, total_rows=full.rows) as r:
        r.read_rows(ids, out)
    inside = (ids >= start) & (ids < stop)
    assert np.array_equal(out[inside], ref[BF16_LAYER][ids[inside]])
    assert not out[~inside].any()


def test_small_batches_read_inline_large_batches_use_the_pool(big, monkeypatch):
    """Decode-sized batches skip the thread pool (its hand-off costs ~1 ms); prefill-sized ones fan out."""
    import threading

    from sglang_ssd_stream.sidecar import reader as reader_mod

    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    threads = set()
    original = reader_mod.SidecarReader._read_runs

    def spy(self, *jobs):
        threads.add(threading.current_thread().name)
        return original(self, *jobs)

    monkeypatch.setattr(reader_mod.SidecarReader, "_read_runs", spy)
    with SidecarReader(t, max_rows=8192, workers=4) as r:
        small = np.random.default_rng(7).integers(0, t.rows, 16)
        out = np.empty((small.size, t.row_bytes), np.uint8)
        r.read_rows(small, out)
        assert np.array_equal(out, ref[FP8_LAYER][small])
        assert threads == {threading.current_thread().name}
        threads.clear()
        large = _ids(t.rows, t.row_bytes, 4000, seed=8)
        out = np.empty((large.size, t.row_bytes), np.uint8)
        r.read_rows(large, out)
        assert np.array_equal(out, ref[FP8_LAYER][large])
        assert len(threads) > 1 and threading.current_thread().name not in threads
