"""The shared staging (``SidecarGather``) on CPU: raw rows (vLLM's delivery) bit-identical to the table,
refused ids with the output untouched, and the captured path's pieces with ``cuLaunchHostFunc`` stood in
for (the native host node runs at once, on this thread).

Both readers (``open_reader``: mapped and ``pread``), whole table and tensor-parallel ranges. The BF16
conversion (SGLang's delivery) is checked through SGLang's own hook tests."""

from __future__ import annotations

import threading
import time

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


# ------------------------------------------------------------------ staged ahead


class Counting:
    """A reader that counts its reads and can be made to fail or to block (a stand-in for nothing: it
    wraps a real reader)."""

    def __init__(self, reader):
        self.inner, self.calls, self.fail, self.gate = reader, 0, None, None
        for name in ("row_bytes", "table", "total_rows", "working_set_bytes"):
            setattr(self, name, getattr(reader, name))

    def read_rows(self, ids, out):
        self.calls += 1
        if self.gate is not None:
            self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.inner.read_rows(ids, out)

    def close(self):
        self.inner.close()


def counting_gather(table, io="mmap", lo=0, hi=ROWS, capacity=64):
    reader = open_reader(table, io, vocab_start=lo, vocab_end=hi, total_rows=ROWS, max_rows=capacity, workers=2)
    src = Counting(reader)
    return SidecarGather(src, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=capacity,
                         device="cpu", mode="h2d", output="raw"), src


@pytest.mark.parametrize("lo,hi", RANGES)
@pytest.mark.parametrize("io", IOS)
def test_rows_staged_ahead_are_delivered_without_a_read(sidecar, io, lo, hi):
    table, data = sidecar
    g, src = counting_gather(table, io, lo, hi)
    ids = np.random.default_rng(lo).integers(0, ROWS, 40)
    assert g.stage_ahead(ids) and src.calls == 1 and g.stats.staged_ahead == 1
    out = poisoned(40, table.row_bytes)
    g.begin(torch.from_numpy(ids), out)
    assert np.array_equal(out.numpy(), expected(data, ids, lo, hi))
    assert src.calls == 1 and g.stats.ahead_used == 1  # no second read
    out[:] = 0xAB
    g.begin(torch.from_numpy(ids), out)  # consumed: the same ids again are read
    assert np.array_equal(out.numpy(), expected(data, ids, lo, hi)) and src.calls == 2 and g.stats.ahead_used == 1
    g.close()


@pytest.mark.parametrize("other", ["one id differs", "a prefix", "longer", "permuted"])
def test_other_ids_than_staged_are_read_never_served_from_the_stage(sidecar, other):
    """A wrong guess costs a read, never rows: any difference in the ids, their count or order."""
    table, data = sidecar
    g, src = counting_gather(table)
    staged = np.arange(100, 132)
    ids = {"one id differs": np.concatenate([staged[:31], [4000]]), "a prefix": staged[:31],
           "longer": np.concatenate([staged, [7]]), "permuted": staged[::-1].copy()}[other]
    g.stage_ahead(staged)
    out = poisoned(ids.size, table.row_bytes)
    g.begin(torch.from_numpy(ids), out)
    assert np.array_equal(out.numpy(), data[ids])
    assert src.calls == 2 and g.stats.ahead_used == 0 and g.stats.ahead_unused == 1
    g.close()


def test_staging_ahead_refuses_what_the_slot_cannot_hold_and_bad_ids(sidecar):
    table, data = sidecar
    g, src = counting_gather(table, capacity=16)
    assert not g.stage_ahead(np.arange(17)) and not g.stage_ahead(np.empty(0, np.int64)) and src.calls == 0
    with pytest.raises(SidecarRowOutOfRange):
        g.stage_ahead(np.array([1, ROWS]))
    assert g._ahead_n == -1  # nothing staged
    out = poisoned(2, table.row_bytes)
    g.begin(torch.tensor([1, 2]), out)
    assert np.array_equal(out.numpy(), data[[1, 2]]) and g.stats.ahead_used == 0
    g.close()


def test_a_staging_that_fails_leaves_nothing_staged(sidecar):
    table, data = sidecar
    g, src = counting_gather(table)
    g.stage_ahead(np.arange(8))  # staged ...
    src.fail = OSError(5, "Input/output error")
    with pytest.raises(OSError):
        g.stage_ahead(np.arange(8))  # ... then a staging of the same ids fails half-way: the slot is not trusted
    src.fail = None
    out = poisoned(8, table.row_bytes)
    g.begin(torch.arange(8), out)
    assert np.array_equal(out.numpy(), data[:8]) and g.stats.ahead_used == 0 and src.calls == 3
    g.close()


def test_a_lookup_waits_for_a_staging_in_progress_and_uses_it(sidecar):
    """The slot is shared under one lock: a lookup that arrives while its rows are being staged waits
    for the staging (it would read the same rows) and then delivers them."""
    table, data = sidecar
    g, src = counting_gather(table)
    src.gate = threading.Event()
    ids = np.arange(200, 240)
    stager = threading.Thread(target=g.stage_ahead, args=(ids,))
    stager.start()
    while src.calls == 0:
        time.sleep(0.001)
    out = poisoned(40, table.row_bytes)
    looker = threading.Thread(target=g.begin, args=(torch.from_numpy(ids), out))
    looker.start()
    time.sleep(0.05)
    assert looker.is_alive() and (out == 0xAB).all()  # held by the lock, not reading over the staging
    src.gate.set()
    stager.join(10)
    looker.join(10)
    assert np.array_equal(out.numpy(), data[ids]) and src.calls == 1 and g.stats.ahead_used == 1
    g.close()


def test_a_lookup_begun_after_its_batch_was_expected_waits_for_the_staging(sidecar):
    """The scheduler announces the batch (expect) before its forward; the forward's lookup comes before
    the staging thread got to it: the lookup waits for that staging and delivers the staged rows."""
    table, data = sidecar
    g, src = counting_gather(table)
    ids = np.arange(300, 340)
    ticket = g.expect()
    out = poisoned(40, table.row_bytes)
    looker = threading.Thread(target=g.begin, args=(torch.from_numpy(ids), out))
    looker.start()
    time.sleep(0.05)
    assert looker.is_alive() and src.calls == 0  # waiting for the staging, not reading
    assert g.stage_ahead(ids, ticket)
    looker.join(10)
    assert np.array_equal(out.numpy(), data[ids]) and src.calls == 1 and g.stats.ahead_used == 1
    assert g.stats.stage_wait_s > 0
    g.close()


def test_a_lookup_begun_before_a_batch_was_expected_goes_first(sidecar):
    """An overlapping scheduler announces batch N+1 while batch N's lookup is in flight: N's lookup does
    not wait for N+1's staging, and the staging waits for N's lookup to have used the slot; N+1's lookup
    then delivers its staged rows."""
    table, data = sidecar
    g, src = counting_gather(table)
    src.gate = threading.Event()
    ids_n, ids_next = np.arange(10, 50), np.arange(60, 100)
    out_n = poisoned(40, table.row_bytes)
    looker = threading.Thread(target=g.begin, args=(torch.from_numpy(ids_n), out_n))
    looker.start()
    while src.calls == 0:
        time.sleep(0.001)  # lookup N is reading (blocked on the gate)
    ticket = g.expect()
    stager = threading.Thread(target=g.stage_ahead, args=(ids_next, ticket))
    stager.start()
    time.sleep(0.05)
    assert stager.is_alive() and src.calls == 1 and g.stats.staged_ahead == 0  # waits for lookup N
    src.gate.set()
    looker.join(10)
    stager.join(10)
    assert np.array_equal(out_n.numpy(), data[ids_n]) and g.stats.staged_ahead == 1 and src.calls == 2
    out = poisoned(40, table.row_bytes)
    g.begin(torch.from_numpy(ids_next), out)
    assert np.array_equal(out.numpy(), data[ids_next]) and g.stats.ahead_used == 1 and src.calls == 2
    g.close()


def test_an_expectation_ended_without_staging_holds_no_lookup(sidecar, monkeypatch):
    table, data = sidecar
    g, src = counting_gather(table)
    g.end_expected(g.expect())  # dropped (its request finished) or superseded
    out = poisoned(4, table.row_bytes)
    g.begin(torch.arange(4), out)
    assert np.array_equal(out.numpy(), data[:4]) and g.stats.stage_wait_s == 0
    # a staging that never comes (its thread died): the lookup reads after the safety bound
    from sglang_ssd_stream.staging import gather as gather_mod

    monkeypatch.setattr(gather_mod, "STAGE_WAIT_S", 0.2)
    g.expect()
    out[:] = 0xAB
    t = time.perf_counter()
    g.begin(torch.arange(4), out)
    assert 0.2 <= time.perf_counter() - t < 5 and np.array_equal(out.numpy(), data[:4])
    g.close()
