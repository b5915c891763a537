"""Guards of the CUDA-graph read path that run without a GPU: the graph slot's capacity and
evicting a mapped table for cold benchmarks (the host node itself: test_native_read.py)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from sglang_ssd_stream.sidecar.mapped import MappedReader, drop_page_cache


def test_a_capture_larger_than_the_graph_slot_is_refused(table):
    torch = pytest.importorskip("torch")
    from sglang_ssd_stream.staging.gather import SidecarGather, StagingCapacityError

    for graph_rows in (0, 16):
        g = SidecarGather(MappedReader(table, max_rows=64, workers=1), columns=table.columns, is_fp8=True,
                          capacity_rows=64, device="cpu", graph_rows=graph_rows)
        n = graph_rows + 1
        with pytest.raises(StagingCapacityError,
                           match=f"captured PLE lookup needs {n} rows but the graph slot holds {graph_rows}"):
            g.capture(torch.zeros(n, dtype=torch.int64), torch.empty((n, table.columns), dtype=torch.bfloat16), None)
        g.close()


def _resident(path) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    vec = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, dtype=np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                            ctypes.c_void_p(vec.ctypes.data)) == 0
        del view
    return float((vec & 1).mean())


def test_drop_page_cache_evicts_pages_a_mapped_reader_holds(table):
    with open(table.file, "rb+") as f:
        os.fsync(f.fileno())  # dirty pages cannot be dropped; the fixture's file must be on disk first
    with MappedReader(table, max_rows=table.rows, workers=1) as r:
        out = np.empty((table.rows, table.row_bytes), np.uint8)
        r.read_rows(np.arange(table.rows), out)  # every page now mapped by the reader
        assert _resident(table.file) > 0.9
        drop_page_cache(table.file, [type("Wrapper", (), {"reader": r})()])  # through a wrapper, as vLLM holds it
        assert _resident(table.file) < 0.1
        r.read_rows(np.arange(table.rows), out)  # and the reader still reads after the eviction
        assert np.array_equal(out, np.frombuffer(table.file.read_bytes(), np.uint8).reshape(out.shape))
