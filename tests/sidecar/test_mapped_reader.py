"""The mapped reader (``io="mmap"``): same rows as the shards and as the ``preadv`` reader, same refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import BF16_LAYER, FP8_LAYER, FP8_ROWS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_build_and_read import _ids

from sglang_ssd_stream.sidecar import (
    IO_MODES,
    MappedReader,
    SidecarIOError,
    SidecarReader,
    SidecarReaderUnusable,
    SidecarRowOutOfRange,
    SidecarShapeMismatch,
    SidecarTruncated,
    open_reader,
)
from sglang_ssd_stream.sidecar import mapped as mapped_mod
from sglang_ssd_stream.sidecar.format import SidecarTable

ALL = -1


@pytest.mark.parametrize("layer", [FP8_LAYER, BF16_LAYER])
@pytest.mark.parametrize("workers,rows_per_task,inline,slow,expect_inline", [
    (1, None, 256, None, ALL),  # no pool: one inline copy
    (4, None, 0, None, 0),  # inline off: everything through the pool
    (3, 97, 0, None, 0),
    (4, None, 500, 0.0, 64),  # every chunk counts as faulting: the 64-row probe inline, then the pool
    (4, None, 40, 0.0, 40),  # a probe never exceeds the chunk size
    (8, None, 500, float("inf"), ALL),  # every chunk counts as warm: all inline, in chunks
])
def test_mapped_rows_match_shards_and_the_pread_reader(big, monkeypatch, layer, workers, rows_per_task, inline, slow,
                                                       expect_inline):
    _, result, ref = big
    t = result.manifest.table(layer)
    ids = _ids(t.rows, t.row_bytes, 6000, seed=layer + workers)  # duplicates, first/last, page-straddling rows
    if slow is not None:
        monkeypatch.setattr(mapped_mod, "SLOW_ROW_S", slow)
    out = np.full((ids.size, t.row_bytes), 0xAB, np.uint8)
    with MappedReader(t, max_rows=ids.size, workers=workers, rows_per_task=rows_per_task, inline_rows=inline) as r:
        r.read_rows(ids, out)
        s = r.stats
    assert np.array_equal(out, ref[layer][ids])
    assert s["rows"] == s["rows_in_range"] == ids.size
    n = ids.size
    inline_expected = n if expect_inline == ALL else expect_inline
    assert s["inline_rows"] == inline_expected
    rest = n - inline_expected
    assert s["tasks"] == (0 if rest == 0 else -(-rest // (rows_per_task or -(-rest // workers))))
    other = np.empty_like(out)
    with SidecarReader(t, max_rows=ids.size, workers=2) as p:
        p.read_rows(ids, other)
    assert np.array_equal(out, other)


@pytest.mark.parametrize("lo,hi", [(0, 250_001), (250_001, 500_002), (750_002, FP8_ROWS)])
def test_tp_ranges_leave_other_rows_zero_and_sum_to_full_rows(big, lo, hi):
    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    ids = _ids(t.rows, t.row_bytes, 5000, seed=lo)
    out = np.full((ids.size, t.row_bytes), 0x5A, np.uint8)
    with MappedReader(t, vocab_start=lo, vocab_end=hi, max_rows=ids.size, workers=3) as r:
        r.read_rows(ids, out)
        assert r.stats["rows_in_range"] == int(((ids >= lo) & (ids < hi)).sum())
    inside = (ids >= lo) & (ids < hi)
    assert inside.any() and (~inside).any()
    assert np.array_equal(out[inside], ref[FP8_LAYER][ids[inside]])
    assert not out[~inside].any()
    total = np.zeros((ids.size, t.row_bytes), np.int64)
    for a, b in [(0, 333_334), (333_334, 666_668), (666_668, FP8_ROWS)]:
        part = np.empty((ids.size, t.row_bytes), np.uint8)
        with open_reader(t, "mmap", vocab_start=a, vocab_end=b, max_rows=ids.size, workers=2) as r:
            r.read_rows(ids, part)
        total += part
    assert np.array_equal(total, ref[FP8_LAYER][ids])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mapped_matches_direct_indexing(tmp_path_factory, data):
    """Any row width, row_start, TP range (mapping offsets not page aligned) and id list."""
    row_bytes = data.draw(st.sampled_from([1, 2, 160, 320, 5000]))
    rows = data.draw(st.integers(1, 3000))
    row_start = data.draw(st.integers(0, 50))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table_bytes = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    path = tmp_path_factory.mktemp("mprop") / "t.bin"
    path.write_bytes(table_bytes.tobytes())
    t = SidecarTable(0, "t.bin", path, "0" * 64, "float8_e4m3fn", rows, row_bytes, row_start, rows * row_bytes)
    lo = data.draw(st.integers(row_start, row_start + rows - 1))
    hi = data.draw(st.integers(lo + 1, row_start + rows))
    ids = np.array(data.draw(st.lists(st.integers(0, row_start + rows - 1), max_size=400)), dtype=np.int64)
    out = np.full((ids.size, row_bytes), 0xEE, np.uint8)
    with MappedReader(t, vocab_start=lo, vocab_end=hi, max_rows=max(1, ids.size), workers=data.draw(st.integers(1, 3)),
                      inline_rows=data.draw(st.integers(0, 50))) as r:
        r.read_rows(ids, out)
    inside = (ids >= lo) & (ids < hi)
    assert np.array_equal(out[inside], table_bytes[ids[inside] - row_start])
    assert not out[~inside].any()
    path.unlink()


@pytest.mark.parametrize("slow,pool_used", [(float("inf"), False), (0.0, True)])
def test_warm_lookups_stay_on_the_calling_thread_faulting_ones_fan_out(big, monkeypatch, slow, pool_used):
    """Warm chunks are copied inline (pool hand-offs fight the engine for the GIL); the first
    faulting chunk sends the rest to the pool (faults overlap). The timing threshold is pinned."""
    _, result, ref = big
    t = result.manifest.table(FP8_LAYER)
    monkeypatch.setattr(mapped_mod, "SLOW_ROW_S", slow)
    threads = set()
    original = MappedReader._take

    def spy(self, local, out):
        threads.add(threading.current_thread().name)
        return original(self, local, out)

    monkeypatch.setattr(MappedReader, "_take", spy)
    with MappedReader(t, max_rows=8192, workers=4, inline_rows=1000) as r:
        ids = np.random.default_rng(8).integers(0, t.rows, 4000)
        out = np.empty((ids.size, t.row_bytes), np.uint8)
        r.read_rows(ids, out)
        assert np.array_equal(out, ref[FP8_LAYER][ids])
        me = threading.current_thread().name
        if pool_used:
            assert r.stats["inline_rows"] == 64 and r.stats["tasks"] == 4  # the probe, then 3,936 rows over 4 workers
            assert me in threads and any(name.startswith("ple-mmap") for name in threads)
        else:
            assert r.stats["inline_rows"] == 4000 and r.stats["tasks"] == 0 and threads == {me}


# ----------------------------------------------------------------------------- refusals


def test_truncated_while_mapped_is_refused_and_fails_closed(table, ref):
    ids = np.array([0, table.rows - 1], dtype=np.int64)
    out = np.empty((2, table.row_bytes), np.uint8)
    with MappedReader(table, max_rows=16, workers=1) as r:
        r.read_rows(ids, out)
        assert np.array_equal(out, ref[ids])
        os.truncate(table.file, 4096)
        out[:] = 0x33
        with pytest.raises(SidecarTruncated, match=r"truncated: it has 4096 bytes, expected 800480"):
            r.read_rows(ids, out)
        assert (out == 0x33).all()  # refused before any copy
        with pytest.raises(SidecarReaderUnusable, match="unusable after an earlier I/O failure"):
            r.read_rows(ids[:1], out[:1])  # even a row that is still on disk


def test_truncated_file_refused_at_open(table):
    os.truncate(table.file, 100)
    with pytest.raises(SidecarTruncated, match="100 bytes, expected 800480"):
        MappedReader(table, max_rows=16)


def test_missing_file_is_an_io_error(table):
    os.unlink(table.file)
    with pytest.raises(SidecarIOError, match="cannot open PLE table"):
        MappedReader(table, max_rows=16)


@pytest.mark.parametrize("bad", [-1, 5003, 10**12])
def test_row_id_outside_table_writes_nothing(table, ref, bad):
    ids = np.array([0, 7, bad, 9], dtype=np.int64)
    out = np.full((4, table.row_bytes), 0x77, np.uint8)
    with MappedReader(table, vocab_start=0, vocab_end=2000, max_rows=16) as r:
        with pytest.raises(SidecarRowOutOfRange,
                           match=rf"row id {bad} \(position 2\) is outside table .*0 <= id < 5003"):
            r.read_rows(ids, out)
        assert (out == 0x77).all()
        r.read_rows(ids[[0, 1, 3]], out[:3])  # a caller bug does not break the reader
        assert np.array_equal(out[:3], ref[[0, 7, 9]])
        with pytest.raises(SidecarRowOutOfRange):
            r.read_rows(np.array([2**64 - 1], dtype=np.uint64), out[:1])


def test_bad_output_ids_and_arguments(table):
    with MappedReader(table, max_rows=16) as r:
        with pytest.raises(SidecarShapeMismatch,
                           match=r"output must be a writable C-contiguous uint8 array of shape \(3, 160\)"):
            r.read_rows(np.array([1, 2, 3]), np.empty((3, 320), np.uint8)[:, :160])
        with pytest.raises(SidecarShapeMismatch, match="1-D integer array"):
            r.read_rows(np.array([1.0]), np.empty((1, 160), np.uint8))
        assert r.usable
    with pytest.raises(SidecarShapeMismatch, match=r"covers rows \[0, 5003\), not this rank's rows \[4000, 6000\)"):
        MappedReader(table, vocab_start=4000, vocab_end=6000, max_rows=16)
    with pytest.raises(SidecarShapeMismatch, match="at least 1"):
        MappedReader(table, max_rows=16, workers=0)
    with pytest.raises(ValueError, match=r"PLE sidecar I/O 'aio': expected one of \('mmap', 'pread'\)"):
        open_reader(table, "aio", max_rows=16, workers=1)
    assert IO_MODES == ("mmap", "pread")


def test_closed_reader_refuses_and_releases_its_fd(table):
    fds = len(os.listdir("/proc/self/fd"))
    r = MappedReader(table, max_rows=16, workers=3)
    r.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(SidecarReaderUnusable, match="is closed"):
        r.read_rows(np.array([1]), np.empty((1, 160), np.uint8))
    r.close()  # idempotent


def test_a_fault_under_the_mapping_kills_the_process_never_returns_zeros(table, tmp_path):
    """What the module docstring promises for a media error: SIGBUS, a traceback, no rows.

    A file shrunk behind the size check stands in for the failing disk (both fault the copy)."""
    script = tmp_path / "fault.py"
    script.write_text(textwrap.dedent(f"""
        import os, numpy as np
        from sglang_ssd_stream.sidecar import load_manifest
        from sglang_ssd_stream.sidecar.mapped import MappedReader
        t = load_manifest({str(table.file.parent.parent)!r}).tables[0]
        import sglang_ssd_stream.sidecar.mapped as m
        r = MappedReader(t, max_rows=16, workers=1)
        m.TableFiles.check_unchanged = lambda self: None  # the disk fails after the check
        os.truncate(t.file, 0)
        out = np.zeros((1, t.row_bytes), np.uint8)
        r.read_rows(np.array([t.rows - 1]), out)
        print("RETURNED", out.any())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -7, (proc.returncode, proc.stdout, proc.stderr)  # SIGBUS
    assert "RETURNED" not in proc.stdout
    assert "Bus error" in proc.stderr and "_take" in proc.stderr  # faulthandler names the frame


def test_module_pool_is_shared_per_size():
    assert mapped_mod.shared_pool(3) is mapped_mod.shared_pool(3)
    assert mapped_mod.shared_pool(3) is not mapped_mod.shared_pool(2)
