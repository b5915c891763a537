"""Issue 29 item 6: a table written while it is served is detected before its rows are used, on every
read path both engines use (``mmap``, ``pread``, the row cache in front of either).

Measured before this change: ``cp other/… a/…`` over an open table made mmap/pread return 10,006 of 10,006
rows wrong and the row cache 7,756; ``truncate -s 0`` then regrow gave all-zero rows. Each case here
rewrites the file the way an operator would, then asserts the reader refuses (never wrong or zero rows),
stays refused, and that a ``mv`` over the path (a new inode) keeps serving the old, right rows.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest

from sglang_ssd_stream.sidecar import MappedReader, SidecarReader
from sglang_ssd_stream.sidecar.errors import SidecarChanged, SidecarReaderUnusable, SidecarTruncated
from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

IDS = np.array([0, 1, 17, 2500, 5002, 17, 4096], np.int64)
# Timestamps have the filesystem's clock granularity (a few ms): a write within one tick of the table's
# own last write could keep its mtime. A served table was written long before; so here.
SETTLE_S = 0.05


def _open(table, path: str):
    if path == "pread":
        return SidecarReader(table, max_rows=4096, workers=2)
    if path == "mmap":
        return MappedReader(table, max_rows=4096, workers=2)
    inner = SidecarReader(table, max_rows=4096, workers=2) if path == "cache-pread" else \
        MappedReader(table, max_rows=4096, workers=2)
    return RowCache(inner, np.zeros((64, table.row_bytes), np.uint8), RowCacheConfig(workers=2))


def _read(reader, ids=IDS):
    out = np.full((len(ids), reader.row_bytes), 0xAB, np.uint8)
    reader.read_rows(ids, out)
    return out


PATHS = ["pread", "mmap", "cache-pread", "cache-mmap"]


def _other_bytes(table) -> bytes:
    data = bytearray(table.file.read_bytes())
    return bytes(b ^ 0x5A for b in data)


@pytest.mark.parametrize("path", PATHS)
def test_rewritten_in_place_is_refused(table, ref, path):
    time.sleep(SETTLE_S)
    r = _open(table, path)
    assert np.array_equal(_read(r), ref[IDS])
    time.sleep(SETTLE_S)
    with open(table.file, "r+b") as f:  # what `cp other/layer.bin a/layer.bin` does: same inode, same size
        f.write(_other_bytes(table))
    with pytest.raises(SidecarChanged, match="was written while it is served"):
        _read(r)
    with pytest.raises(SidecarReaderUnusable):
        _read(r, IDS[:1])
    r.close()


@pytest.mark.parametrize("path", PATHS)
def test_truncated_then_regrown_is_refused(table, ref, path):
    time.sleep(SETTLE_S)
    r = _open(table, path)
    assert np.array_equal(_read(r), ref[IDS])
    time.sleep(SETTLE_S)
    size = table.file.stat().st_size
    with open(table.file, "r+b") as f:
        f.truncate(0)
        f.truncate(size)  # full size again, all zeros: the size alone would pass
    with pytest.raises((SidecarChanged, SidecarTruncated)):
        _read(r)
    r.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_file_renamed_over_the_path_keeps_the_old_rows(table, ref, path, tmp_path):
    time.sleep(SETTLE_S)
    r = _open(table, path)
    new = tmp_path / "replacement.bin"
    new.write_bytes(_other_bytes(table))
    os.replace(new, table.file)  # a new inode at the path; the reader keeps the one it opened
    assert np.array_equal(_read(r), ref[IDS])
    r.close()


@pytest.mark.parametrize("path", ["pread", "mmap"])
def test_a_write_during_the_read_is_not_served(table, path, monkeypatch):
    """The file changes between the check before the read and the copy out: the check after refuses."""
    time.sleep(SETTLE_S)
    r = _open(table, path)
    name = "_read_slice" if path == "pread" else "_copy"
    real = getattr(r, name)
    other = _other_bytes(table)

    def racing(*a, **kw):
        time.sleep(SETTLE_S)
        with open(table.file, "r+b") as f:
            f.write(other)
        return real(*a, **kw)

    monkeypatch.setattr(r, name, racing)
    with pytest.raises(SidecarChanged):
        _read(r)
    r.close()


def test_a_write_while_the_row_cache_reads_is_not_served(table):
    """The row cache's own reads (C, sleeping inside its read): a write meanwhile fails the lookup."""
    time.sleep(SETTLE_S)
    inner = SidecarReader(table, max_rows=4096, workers=2)
    c = RowCache(inner, np.zeros((64, table.row_bytes), np.uint8), RowCacheConfig(workers=2, debug_delay_us=300_000))
    other = _other_bytes(table)
    outcome = {}

    def lookup():
        try:
            outcome["rows"] = _read(c, np.arange(100, 140, dtype=np.int64))
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    t = threading.Thread(target=lookup)
    t.start()
    time.sleep(0.1)  # inside the read's delay
    with open(table.file, "r+b") as f:
        f.write(other)
    t.join(30)
    assert isinstance(outcome.get("error"), SidecarChanged), outcome
    c.close()


def test_copy_over_with_cp_is_refused(table, ref, tmp_path):
    """The adversary's exact command, through the shell's cp (it truncates and writes the same inode)."""
    other = tmp_path / "other.bin"
    other.write_bytes(_other_bytes(table))
    time.sleep(SETTLE_S)
    r = _open(table, "cache-mmap")
    assert np.array_equal(_read(r), ref[IDS])
    time.sleep(SETTLE_S)
    shutil.copyfile(other, table.file)  # opens the existing path O_TRUNC: same inode
    with pytest.raises((SidecarChanged, SidecarTruncated)):
        _read(r)
    r.close()
