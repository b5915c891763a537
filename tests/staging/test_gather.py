"""The shared staging (``SidecarGather``) on CPU: raw rows (vLLM's delivery) bit-identical to the table,
refused ids with the output untouched, and the captured path's pieces with ``cuLaunchHostFunc`` stood in
for (the native host node runs at once, on this thread).

Both readers (``open_reader``: mapped and ``pread``), whole table and tensor-parallel ranges. The BF16
conversion (SGLang's delivery) is checked through SGLang's own hook tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ssd_stream.sidecar import load_manifest, open_reader
from sglang_ssd_stream.sidecar.errors import SidecarReaderUnusable, SidecarRowOutOfRange
from sglang_ssd_stream.staging import hostfunc
from sglang_ssd_stream.staging.gather import SidecarGather, StagingCapacityError
from sglang_ssd_stream.staging.native_read import NativeRead
from tests.vllm.synthetic import finite_fp8_table, random_table, write_sidecar

ROWS = 5000
IOS = ["mmap", "pread"]
RANGES = [(0, ROWS), (0, 2500), (2500, ROWS), (1234, 3333)]


@pytest.fixture(autouse=True)
def _own_library_cache(tmp_path_factory, monkeypatch):
    """The native host-node library is compiled into a private cache."""
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path_factory.getbasetemp() / "kit-home"))


@pytest.fixture(params=["float8_e4m3fn", "bfloat16"])
def sidecar(request, tmp_path):
    """One table of 10 FP8 or 5 BF16 columns (10-byte rows straddle 4 KiB pages now and then)."""
    dtype = request.param
    data = finite_fp8_table(ROWS, 10, 3) if dtype == "float8_e4m3fn" else random_table(ROWS, 10, 4)
    return load_manifest(write_sidecar(tmp_path, {3: (dtype, data)})).table(3), data


def raw_gather(table, io, lo=0, hi=ROWS, *, capacity=8192, graph_rows=0, **kw) -> SidecarGather:
    reader = open_reader(table, io, vocab_start=lo, vocab_end=hi, total_rows=ROWS, max_rows=capacity, workers=3,
                         rows_per_task=7)
    return SidecarGather(reader, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=capacity,
                         device="cpu", mode="h2d", output="raw", graph_rows=graph_rows, **kw)


def expected(data: np.ndarray, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    out = data[ids].copy()
    out[(ids < lo) | (ids >= hi)] = 0  # other ranks' rows: zero, for the ETP all-reduce
    return out


def id_cases(lo: int, hi: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    edges = np.array(sorted({x for x in (0, lo - 1, lo, lo + 1, hi - 1, hi, ROWS - 1) if 0 <= x < ROWS}))
    return {"random": rng.integers(0, ROWS, 4096), "boundaries": edges,
            "duplicates": rng.choice(edges, 301), "one": np.array([hi - 1]), "empty": np.empty(0, np.int64)}


def poisoned(n: int, row_bytes: int) -> torch.Tensor:
    return torch.full((n, row_bytes), 0xAB, dtype=torch.uint8)  # every row must be written


@pytest.mark.parametrize("lo,hi", RANGES)
@pytest.mark.parametrize("io", IOS)
def test_raw_rows_are_the_table_bytes(sidecar, io, lo, hi):
    table, data = sidecar
    g = raw_gather(table, io, lo, hi)
    for name, ids in id_cases(lo, hi, lo + hi).items():
        out = poisoned(ids.size, table.row_bytes)
        g.begin(torch.from_numpy(ids.astype(np.int64)), out)
        g.wait()
        assert np.array_equal(out.numpy(), expected(data, ids, lo, hi)), name
    assert g.stats.lookups == 5 and g.stats.rows == sum(i.size for i in id_cases(lo, hi, 0).values())
    g.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.uint8])
def test_ids_of_another_dtype_are_refused_and_nothing_is_written(sidecar, dtype):
    table, data = sidecar
    g = raw_gather(table, "mmap")
    out = poisoned(3, table.row_bytes)
    with pytest.raises(TypeError, match=r"PLE row ids must be int64, got torch\.\w+" +
                       (r" \(floating-point ids are refused, not truncated\)" if dtype.is_floating_point else "$")):
        g.begin(torch.tensor([1.7, 2.2, 3.9]).to(dtype), out)
    assert (out == 0xAB).all() and g.stats.lookups == 0
    g.close()


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("bad", [-1, ROWS, 1 << 40])
def test_ids_outside_the_table_are_refused_and_nothing_is_written(sidecar, io, bad):
    table, data = sidecar
    g = raw_gather(table, io, 0, 2500)
    out = poisoned(3, table.row_bytes)
    with pytest.raises(SidecarRowOutOfRange, match=f"row id {bad} .*expected 0 <= id < {ROWS}"):
        g.begin(torch.tensor([3, bad, 4]), out)
        g.wait()
    assert (out == 0xAB).all()  # nothing delivered
    ids = np.array([3, 4])
    g.begin(torch.from_numpy(ids), out[:2])
    assert np.array_equal(out[:2].numpy(), data[ids])  # still usable: nothing was read
    g.close()


def test_output_and_capacity_are_checked(sidecar):
    table, _ = sidecar
    g = raw_gather(table, "pread", capacity=8)
    with pytest.raises(StagingCapacityError, match="needs 9 rows but the sidecar staging holds 8 .*the knob"):
        SidecarGather(g.reader, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=8,
                      device="cpu", mode="h2d", output="raw", capacity_hint="; the knob").begin(
            torch.arange(9), poisoned(9, table.row_bytes))
    for bad in (torch.empty((2, table.row_bytes + 1), dtype=torch.uint8),  # raw: uint8 [n, row_bytes]
                torch.empty((2, table.columns), dtype=torch.bfloat16),
                torch.empty((table.row_bytes, 2), dtype=torch.uint8).t()):  # not contiguous
        with pytest.raises(ValueError, match=rf"PLE output must be contiguous torch.uint8 \[2, {table.row_bytes}\]"):
            g.begin(torch.tensor([1, 2]), bad)
    with pytest.raises(ValueError, match="raw PLE rows are delivered by an H2D copy: use mode 'h2d'"):
        SidecarGather(g.reader, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=8,
                      device="cpu", mode="uva", output="raw")
    g.close()


def test_a_failed_read_fails_closed(sidecar):
    import os

    table, data = sidecar
    g = raw_gather(table, "pread")
    out = poisoned(1, table.row_bytes)
    os.truncate(table.file, 100)  # the file shrinks under a running server
    with pytest.raises(Exception, match="short read|truncated"):
        g.begin(torch.tensor([ROWS - 1]), out)
    assert (out == 0xAB).all()
    with pytest.raises(SidecarReaderUnusable):
        g.begin(torch.tensor([0]), out)


# ------------------------------------------------------------------ the captured path


@pytest.fixture
def host_node_runs_now(monkeypatch):
    """Stand in for cuLaunchHostFunc: run the host node's native function at once, as a replay would."""
    launched = []

    def launch(stream, node):
        launched.append(node)
        node.run()

    monkeypatch.setattr(hostfunc, "launch_native_host_func", launch)
    return launched


@pytest.mark.parametrize("lo,hi", RANGES)
@pytest.mark.parametrize("io", IOS)
def test_captured_lookup_is_the_native_host_node(sidecar, host_node_runs_now, io, lo, hi):
    table, data = sidecar
    g = raw_gather(table, io, lo, hi, graph_rows=4096)
    for name, ids in id_cases(lo, hi, 7).items():
        out = poisoned(ids.size, table.row_bytes)
        before = len(host_node_runs_now)
        g.capture(torch.from_numpy(ids.astype(np.int64)), out, None)
        assert np.array_equal(out.numpy(), expected(data, ids, lo, hi)), name
        if ids.size:
            [node] = host_node_runs_now[before:]
            assert isinstance(node, NativeRead) and node.io == io  # C, not Python: no GIL, no CUDA call
            assert node.function == ctypes_address(node.lib.ssd_read_rows)
            assert node._keep[0].ctypes.data == g.graph_ids.data_ptr()  # ids from the graph slot's pinned D2H target
            assert node._keep[1].ctypes.data == g.graph_rows_host.data_ptr()  # rows into the graph slot
            assert node.stats["calls"] == 1
    assert g.stats.captured == 4 and g.stats.lookups == 0  # no eager read was involved
    g.close()
    assert all(n._struct.closed == 1 for n in host_node_runs_now)  # a replay after close() ends the process


def ctypes_address(fn) -> int:
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p).value


def test_captured_lookup_refuses_what_the_graph_slot_cannot_hold(sidecar, host_node_runs_now):
    table, _ = sidecar
    g = raw_gather(table, "mmap", graph_rows=16)
    with pytest.raises(StagingCapacityError, match="captured PLE lookup needs 17 rows but the graph slot holds 16"):
        g.capture(torch.arange(17), poisoned(17, table.row_bytes), None)
    with pytest.raises(TypeError, match="floating-point ids are refused"):
        g.capture(torch.ones(4), poisoned(4, table.row_bytes), None)
    assert host_node_runs_now == []
    g.close()


def test_a_row_source_brings_its_own_host_read(sidecar, host_node_runs_now):
    """The seam a row cache uses: the gather captures whatever ``host_read`` makes of its source."""
    table, data = sidecar

    class Cache:  # a stand-in row source: the whole table in memory
        row_bytes, working_set_bytes = table.row_bytes, 0

        def read_rows(self, ids, out):
            out[:] = data[ids]

        def close(self):
            pass

    made = []

    class CacheRead:  # what a cache's host function would be; here it runs Python, as no graph replays
        def __init__(self, source, ids, rows, what):
            self.source, self.ids, self.rows, self.what = source, ids, rows, what
            made.append(self)

        def run(self):
            self.source.read_rows(self.ids, self.rows)

        def close(self):
            pass

    source = Cache()
    source.table = table
    g = SidecarGather(source, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=64,
                      device="cpu", mode="h2d", output="raw", graph_rows=64,
                      host_read=lambda src, ids, rows, *, what: CacheRead(src, ids, rows, what))
    ids = np.array([5, 5, ROWS - 1, 0])
    out = poisoned(4, table.row_bytes)
    g.capture(torch.from_numpy(ids), out, None)
    assert np.array_equal(out.numpy(), data[ids])
    assert [m.source for m in made] == [source] and made[0].what == "PLE layer 3 sidecar read"
    out[:] = 0xAB
    g.begin(torch.from_numpy(ids), out)  # the eager path reads the same source
    assert np.array_equal(out.numpy(), data[ids])
    g.close()
