"""The reader fails closed and refuses bad requests clearly."""

from __future__ import annotations

import errno
import os
import pickle

import numpy as np
import pytest

from sglang_ssd_stream.errors import EnvironmentProblem
from sglang_ssd_stream.sidecar import (
    SidecarIOError,
    SidecarReader,
    SidecarReaderUnusable,
    SidecarRowOutOfRange,
    SidecarShapeMismatch,
    SidecarTruncated,
)
from sglang_ssd_stream.sidecar import reader as reader_mod


def _spread_ids(rows: int, n: int = 2000) -> np.ndarray:
    return np.random.default_rng(11).integers(0, rows, n)


@pytest.mark.parametrize("workers,fail_on", [(1, 1), (1, 5), (4, 3)])
def test_io_error_mid_read_fails_closed(table, ref, monkeypatch, workers, fail_on):
    ids = _spread_ids(table.rows)
    out = np.zeros((ids.size, table.row_bytes), np.uint8)
    r = SidecarReader(table, max_rows=4096, workers=workers, max_read_bytes=4096, buffer_bytes=64 * 4096)
    r.read_rows(ids, out)  # healthy first
    assert np.array_equal(out, ref[ids])
    real = os.preadv
    calls = {"n": 0}

    def flaky(fd, buffers, offset, *a):
        calls["n"] += 1
        if calls["n"] == fail_on:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(reader_mod.os, "preadv", flaky)
    with pytest.raises(SidecarIOError, match="I/O error reading PLE table .*Input/output error") as info:
        r.read_rows(ids, out)
    assert isinstance(info.value, EnvironmentProblem) and info.value.os_errno == errno.EIO
    assert info.value.exit_code == 4
    again = pickle.loads(pickle.dumps(info.value))  # crosses from a worker process intact
    assert type(again) is SidecarIOError and str(again) == str(info.value) and again.os_errno == errno.EIO
    monkeypatch.setattr(reader_mod.os, "preadv", real)  # the disk "recovers"; the reader must not
    assert not r.usable
    for _ in range(2):
        with pytest.raises(SidecarReaderUnusable, match="unusable after an earlier I/O failure: I/O error"):
            r.read_rows(ids[:5], out[:5])
    r.close()


def test_file_truncated_while_open_fails_closed(table):
    ids = np.array([0, table.rows - 1], dtype=np.int64)
    out = np.empty((2, table.row_bytes), np.uint8)
    with SidecarReader(table, max_rows=16, workers=1) as r:
        r.read_rows(ids, out)
        os.truncate(table.file, 4096)
        out[:] = 0x33
        with pytest.raises(SidecarTruncated, match=r"truncated: it has 4096 bytes, expected 800480"):
            r.read_rows(ids, out)  # the identity check before the read (the short read behind it: below)
        assert (out == 0x33).all()
        with pytest.raises(SidecarReaderUnusable):
            r.read_rows(ids[:1], out[:1])  # even a row that is still on disk


def test_file_shrunk_behind_the_identity_check_is_a_short_read(table, monkeypatch):
    ids = np.array([0, table.rows - 1], dtype=np.int64)
    out = np.empty((2, table.row_bytes), np.uint8)
    with SidecarReader(table, max_rows=16, workers=1) as r:
        r.read_rows(ids, out)
        monkeypatch.setattr(reader_mod.TableFiles, "check_unchanged", lambda self: None)  # shrinks after the check
        os.truncate(table.file, 4096)
        with pytest.raises(SidecarIOError, match="short read from PLE table .* truncated"):
            r.read_rows(ids, out)
        with pytest.raises(SidecarReaderUnusable):
            r.read_rows(ids[:1], out[:1])


def test_unexpected_exception_also_fails_closed(table, monkeypatch):
    r = SidecarReader(table, max_rows=16, workers=1)
    monkeypatch.setattr(reader_mod.os, "preadv", lambda *a: (_ for _ in ()).throw(MemoryError("boom")))
    with pytest.raises(MemoryError):
        r.read_rows(np.array([1]), np.empty((1, 160), np.uint8))
    with pytest.raises(SidecarReaderUnusable, match="MemoryError: boom"):
        r.read_rows(np.array([1]), np.empty((1, 160), np.uint8))


@pytest.mark.parametrize("bad", [-1, 5003, 10**12])
def test_row_id_outside_table(table, ref, bad):
    ids = np.array([0, 7, bad, 9], dtype=np.int64)
    out = np.full((4, table.row_bytes), 0x77, np.uint8)
    with SidecarReader(table, vocab_start=0, vocab_end=2000, max_rows=16) as r:
        with pytest.raises(SidecarRowOutOfRange,
                           match=rf"row id {bad} \(position 2\) is outside table .*0 <= id < 5003"):
            r.read_rows(ids, out)
        assert (out == 0x77).all()  # nothing written
        r.read_rows(ids[[0, 1, 3]], out[:3])  # a caller bug does not break the reader
        assert np.array_equal(out[:3], ref[[0, 7, 9]])
        with pytest.raises(SidecarRowOutOfRange):
            r.read_rows(np.array([2**64 - 1], dtype=np.uint64), out[:1])


def test_bad_output_or_ids(table):
    with SidecarReader(table, max_rows=16) as r:
        ids = np.array([1, 2, 3])
        for out in [np.empty((3, 159), np.uint8), np.empty((3, 160), np.int8), np.empty((2, 160), np.uint8),
                    np.empty((3, 320), np.uint8)[:, :160], [[0] * 160] * 3]:
            with pytest.raises(SidecarShapeMismatch,
                               match=r"output must be a writable C-contiguous uint8 array of shape \(3, 160\)"):
                r.read_rows(ids, out)
        with pytest.raises(SidecarShapeMismatch, match="1-D integer array"):
            r.read_rows(np.array([1.0, 2.0]), np.empty((2, 160), np.uint8))
        with pytest.raises(SidecarShapeMismatch, match="1-D integer array"):
            r.read_rows(np.array([[1, 2]]), np.empty((2, 160), np.uint8))
        assert r.usable


def test_closed_reader_refuses(table):
    fds = len(os.listdir("/proc/self/fd"))
    r = SidecarReader(table, max_rows=16, workers=3)
    r.close()
    assert len(os.listdir("/proc/self/fd")) == fds  # no fd leak
    with pytest.raises(SidecarReaderUnusable, match="is closed"):
        r.read_rows(np.array([1]), np.empty((1, 160), np.uint8))
    r.close()  # idempotent


def test_tp_range_outside_table(table):
    with pytest.raises(SidecarShapeMismatch, match=r"covers rows \[0, 5003\), not this rank's rows \[4000, 6000\)"):
        SidecarReader(table, vocab_start=4000, vocab_end=6000, max_rows=16)
    with pytest.raises(SidecarShapeMismatch, match="max_read_bytes is 1000"):
        SidecarReader(table, max_rows=16, max_read_bytes=1000)
    with pytest.raises(SidecarShapeMismatch, match="at least 1"):
        SidecarReader(table, max_rows=0)


def test_truncated_file_refused_at_open(table):
    os.truncate(table.file, 100)
    with pytest.raises(SidecarTruncated, match="100 bytes, expected 800480"):
        SidecarReader(table, max_rows=16)


def test_o_direct_unsupported_is_a_clear_error(table, monkeypatch):
    real = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    with pytest.raises(SidecarIOError, match="O_DIRECT: the filesystem does not support it"):
        SidecarReader(table, max_rows=16, direct=True)
    SidecarReader(table, max_rows=16, direct=False).close()


def test_concurrent_callers_are_serialised(table, ref):
    import threading

    r = SidecarReader(table, max_rows=512, workers=2, buffer_bytes=8 * 4096)
    bad = []

    def worker(seed):
        ids = np.random.default_rng(seed).integers(0, table.rows, 700)
        out = np.empty((700, table.row_bytes), np.uint8)
        for _ in range(5):
            r.read_rows(ids, out)
            if not np.array_equal(out, ref[ids]):
                bad.append(seed)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    r.close()
    assert bad == []
