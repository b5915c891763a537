"""Streamed PLE rows are the sidecar's bytes, bit for bit (CPU tensors; no vLLM import).

Both row sources (the shared sidecar reader and the mapped file) behind the same
:class:`StreamingGather`, for random ids, duplicates, this rank's boundaries and other ranks' ids.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sglang_ssd_stream.sidecar import load_manifest
from sglang_ssd_stream.sidecar.errors import (SidecarIOError, SidecarReaderUnusable, SidecarRowOutOfRange,
                                              SidecarShapeMismatch)
from tests.vllm.synthetic import finite_fp8_table, write_sidecar
from vllm_ple_offload.row_sources import SOURCES, MmapRows
from vllm_ple_offload.streaming import StreamingGather

ROWS, COLS = 5000, 10  # 10-byte fp8 rows straddle 4 KiB pages now and then


@pytest.fixture
def sidecar(tmp_path):
    table = finite_fp8_table(ROWS, COLS, seed=3)
    manifest = load_manifest(write_sidecar(tmp_path, {3: ("float8_e4m3fn", table)}))
    return manifest.table(3), table


def make(kind, table, lo=0, hi=ROWS, *, workers=4, rows_per_task=7, max_ids=4096):
    source = SOURCES[kind](table, vocab_start=lo, vocab_end=hi, total_rows=ROWS, workers=workers,
                           rows_per_task=rows_per_task)
    return StreamingGather(source, row_bytes=table.row_bytes, max_ids=max_ids, device="cpu", label=f"test-{kind}")


def expected(data: np.ndarray, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    out = data[ids].copy()
    out[(ids < lo) | (ids >= hi)] = 0
    return out


def lookup(gather, ids: np.ndarray) -> np.ndarray:
    out = torch.full((ids.size, gather.row_bytes), 0xAB, dtype=torch.uint8)  # poison: every row must be written
    gather.start(torch.from_numpy(ids))
    gather.finish(out)
    return out.numpy()


KINDS = sorted(SOURCES)


@pytest.mark.parametrize("kind", KINDS)
def test_random_ids_bit_identical(kind, sidecar):
    table, data = sidecar
    g = make(kind, table)
    rng = np.random.default_rng(1)
    for n in (1, 17, 4096):
        ids = rng.integers(0, ROWS, n)
        assert np.array_equal(lookup(g, ids), data[ids])
    assert g.stats.lookups == 3 and g.stats.ids == 1 + 17 + 4096
    g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_duplicates_and_caller_order(kind, sidecar):
    table, data = sidecar
    g = make(kind, table)
    ids = np.array([9, 9, 4999, 0, 9, 1, 0, 4999, 4098, 4097, 4098], dtype=np.int64)
    assert np.array_equal(lookup(g, ids), data[ids])
    assert g.stats.unique == np.unique(ids).size
    g.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lo,hi", [(0, 2500), (2500, 5000), (1234, 3333)])
def test_other_ranks_rows_are_zero(kind, sidecar, lo, hi):
    table, data = sidecar
    g = make(kind, table, lo, hi)
    rng = np.random.default_rng(lo)
    boundary = np.array([0, lo - 1, lo, lo + 1, hi - 1, hi, ROWS - 1], dtype=np.int64)
    ids = np.concatenate([boundary[(boundary >= 0) & (boundary < ROWS)], rng.integers(0, ROWS, 3000)])
    got = lookup(g, ids)
    assert np.array_equal(got, expected(data, ids, lo, hi))
    assert g.stats.owned == np.unique(ids[(ids >= lo) & (ids < hi)]).size
    g.close()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_lookup(kind, sidecar):
    table, _ = sidecar
    g = make(kind, table)
    assert lookup(g, np.empty(0, dtype=np.int64)).shape == (0, table.row_bytes)
    g.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [-1, ROWS])
def test_ids_outside_the_table_are_refused(kind, sidecar, bad):
    table, data = sidecar
    g = make(kind, table, 0, 2500)
    g.start(torch.tensor([3, bad]))  # the ids reach the host in the background: refused at finish()
    out = torch.full((2, table.row_bytes), 0xAB, dtype=torch.uint8)
    with pytest.raises(SidecarRowOutOfRange, match=f"row id {bad} is outside the table"):
        g.finish(out)
    assert (out == 0xAB).all()  # nothing delivered
    ids = np.array([3, 4])
    assert np.array_equal(lookup(g, ids), data[ids])  # still usable: nothing was read
    g.close()


def test_call_order_is_enforced(sidecar):
    table, _ = sidecar
    g = make("pread", table)
    with pytest.raises(RuntimeError, match="without a pending start"):
        g.finish(torch.empty(0, table.row_bytes, dtype=torch.uint8))
    g.start(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="start\\(\\) called twice"):
        g.start(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"output must be uint8 \[1, 10\]"):
        g.finish(torch.empty(2, table.row_bytes, dtype=torch.uint8))
    g.close()


def test_capacity_is_enforced(sidecar):
    table, _ = sidecar
    g = make("mmap", table, max_ids=8)
    with pytest.raises(ValueError, match="exceeds the staging capacity of 8"):
        g.start(torch.arange(9))
    g.close()


def test_sidecar_read_failure_fails_closed(sidecar):
    table, data = sidecar
    g = make("pread", table)
    assert np.array_equal(lookup(g, np.array([4999])), data[[4999]])
    os.truncate(table.file, 100)  # the file shrinks under a running server
    g.start(torch.tensor([4999]))
    with pytest.raises(SidecarIOError, match="short read"):
        g.finish(torch.empty(1, table.row_bytes, dtype=torch.uint8))
    g.start(torch.tensor([0]))
    with pytest.raises(SidecarReaderUnusable, match="unusable after an earlier I/O failure"):
        g.finish(torch.empty(1, table.row_bytes, dtype=torch.uint8))


def test_mmap_refuses_a_range_the_table_does_not_cover(sidecar):
    table, _ = sidecar
    with pytest.raises(SidecarShapeMismatch, match=r"not this rank's rows \[4000, 6000\)"):
        MmapRows(table, vocab_start=4000, vocab_end=6000, total_rows=6000, workers=2, rows_per_task=4)


def test_mmap_refuses_unsorted_or_foreign_ids(sidecar):
    table, _ = sidecar
    src = MmapRows(table, vocab_start=100, vocab_end=200, total_rows=ROWS, workers=2, rows_per_task=4)
    with pytest.raises(SidecarShapeMismatch, match=r"must lie in \[100, 200\)"):
        src.read(np.array([50, 150]), np.empty((2, COLS), np.uint8))
    src.close()


def test_mmap_missing_file_is_an_io_error(sidecar):
    table, _ = sidecar
    os.unlink(table.file)
    with pytest.raises(SidecarIOError, match="cannot open PLE table"):
        MmapRows(table, vocab_start=0, vocab_end=ROWS, total_rows=ROWS, workers=2, rows_per_task=4)


def test_stats_line_splits_the_timing(sidecar):
    table, _ = sidecar
    g = make("pread", table)
    lookup(g, np.arange(100))
    line = g.stats.line()
    assert "D2H" in line and "gather" in line and "H2D" in line and "us/row" in line
    assert g.stats.d2h_s > 0 and g.stats.gather_s > 0 and g.stats.h2d_s > 0
    g.close()


class _HeldSource:
    """A row source whose reads wait until the test releases them."""

    kind = "held"

    def __init__(self, data):
        import threading

        self.data, self.vocab_start, self.vocab_end, self.total_rows = data, 0, data.shape[0], data.shape[0]
        self.release, self.reading = threading.Event(), threading.Event()

    def read(self, ids, out):
        self.reading.set()
        assert self.release.wait(30)
        out[:] = self.data[ids]

    def close(self):
        pass


def test_start_returns_before_the_gather_and_dedupes_on_the_host(sidecar, monkeypatch):
    """start() only enqueues the ids copy: no device-side unique (it synchronises a GPU), no waiting for rows."""
    table, data = sidecar
    src = _HeldSource(data)
    g = StreamingGather(src, row_bytes=table.row_bytes, max_ids=64, device="cpu", label="held")

    def no_device_unique(*a, **k):
        raise AssertionError("torch.unique in start(): a device-side unique blocks the host on the GPU")

    monkeypatch.setattr(torch, "unique", no_device_unique)
    ids = np.array([7, 3, 7, 4999, 3], dtype=np.int64)
    g.start(torch.from_numpy(ids))
    assert src.reading.wait(30)  # the background thread is inside the read; start() has long returned
    out = torch.empty((ids.size, table.row_bytes), dtype=torch.uint8)
    src.release.set()
    g.finish(out)
    assert np.array_equal(out.numpy(), data[ids])
    assert g.stats.unique == 3
    g.close()
