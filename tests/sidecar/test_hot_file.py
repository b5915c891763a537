"""Issue 27 item 1 (groundwork): the hot file's format, its atomic writer and its one-pass, fail-closed reader.

Every bad file reads as None with exactly one warning line and no exception; no row comes back unchecked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import struct
import time
import types

import numpy as np
import pytest

from sglang_ssd_stream import atomic_file
from sglang_ssd_stream.sidecar import hot_file as hf
from sglang_ssd_stream.sidecar import load_manifest
from sglang_ssd_stream.sidecar.errors import SidecarRowOutOfRange, SidecarShapeMismatch
from tests.vllm.synthetic import random_table, write_sidecar

FP8, BF16 = 2, 5  # layers: an fp8 table of 160 B rows and a bf16 one of 320 B rows
ROWS = 3001
RANGE = (0, ROWS)
BLOCK = 100  # small blocks: several segments per table, and cuts that fall inside one
LOGGER = "sglang_ssd_stream.sidecar.hot_file"


@pytest.fixture
def sidecar(tmp_path):
    """A two-table sidecar (fp8 and bf16 rows): (manifest, {layer: table bytes})."""
    tables = {FP8: random_table(ROWS, 160, 1), BF16: random_table(ROWS, 320, 2)}
    write_sidecar(tmp_path / "art", {FP8: ("float8_e4m3fn", tables[FP8]), BF16: ("bfloat16", tables[BF16])})
    return load_manifest(tmp_path / "art"), tables


def _hot(tables, counts=(750, 433), seed=0, lo=0, hi=ROWS):
    """``{layer: (ids, rows)}``: distinct ids of the range in a random ("hottest first") order, rows from the table."""
    rng = np.random.default_rng(seed)
    out = {}
    for (layer, table), n in zip(sorted(tables.items()), counts, strict=True):
        ids = rng.choice(np.arange(lo, hi), size=n, replace=False).astype(np.int64)
        out[layer] = (ids, table[ids])
    return out


@pytest.fixture
def written(sidecar, tmp_path):
    """A hot file of both tables: (path, manifest, the rows written)."""
    manifest, tables = sidecar
    rows = _hot(tables)
    path = tmp_path / "hot" / "a.plehot"
    hf.write_hot_file(path, manifest, RANGE, rows, role="test", block_rows=BLOCK)
    return path, manifest, rows


def _ignored(caplog, path, manifest, why, row_range=RANGE, budget=1 << 30):
    """Read ``path``: None, one warning line from the hot-file logger, naming ``why``."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got = hf.read_hot_file(path, manifest, row_range, budget)
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert got is None
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert why in lines[0].getMessage(), lines[0].getMessage()
    return lines[0].getMessage()


def _layout(path):
    """Offsets of a written file: (header end, [(segment start, ids bytes, rows bytes)])."""
    raw = path.read_bytes()
    _, _, meta_len, nseg = struct.unpack_from("<8sIIQ", raw)
    meta = json.loads(raw[24:24 + meta_len])
    header_end = 24 + meta_len + 32 * nseg + 32
    tables = [(t["row_bytes"], t["count"]) for t in meta["tables"]]
    segs, pos = [], header_end
    for t, a, b in hf._segments([n for _, n in tables], meta["block_rows"]):
        segs.append((pos, (b - a) * 8, (b - a) * tables[t][0]))
        pos += (b - a) * (8 + tables[t][0])
    assert pos == len(raw)
    return header_end, segs


def _Os(**overrides):
    """The module's ``os`` with some functions replaced (the real ``os`` module stays untouched)."""
    return types.SimpleNamespace(**{**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")}, **overrides})


def _flip(path, offset, bit=0):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


# ----------------------------------------------------------------------------- round trip and budget


def test_round_trip_exact_bytes(written, caplog):
    path, manifest, rows = written
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got = hf.read_hot_file(path, manifest, RANGE, 1 << 30)
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert got is not None and not got.cut and set(got.layers) == {FP8, BF16}
    for layer, (ids, data) in rows.items():
        gids, gdata = got.layers[layer]
        assert gids.dtype == np.int64 and gdata.dtype == np.uint8 and gdata.flags.c_contiguous
        np.testing.assert_array_equal(gids, ids)  # order kept: hottest first
        assert gdata.tobytes() == data.tobytes()
    assert got.rows == got.rows_in_file == 750 + 433
    assert got.nbytes == 750 * (8 + 160) + 433 * (8 + 320)


def test_round_trip_of_a_built_sidecar(small, tmp_path, ref):
    """The sidecar the builder makes (conftest's ``small``), one table, one block, the default block size."""
    _, art = small
    manifest = load_manifest(art)
    ids = np.array([5002, 0, 17, 4096, 2500], np.int64)
    path = tmp_path / "h.plehot"
    size = hf.write_hot_file(path, manifest, (0, 5003), {2: (ids, ref[ids])})
    assert size == path.stat().st_size
    got = hf.read_hot_file(path, manifest, (0, 5003), 1 << 20)
    np.testing.assert_array_equal(got.layers[2][0], ids)
    np.testing.assert_array_equal(got.layers[2][1], ref[ids])


@pytest.mark.parametrize("ranks", [0, 1, 99, 100, 101, 250, 433, 434, 600, 749, 750])
def test_budget_takes_the_hottest_first(written, ranks):
    """The budget that fits exactly ``ranks`` ranks of both tables (a table with fewer rows gives all of them)
    takes the first ``ranks`` rows of each, and one more byte of budget does not take another rank."""
    path, manifest, rows = written
    budget = min(ranks, 750) * 168 + min(ranks, 433) * 328
    for b in (budget, budget + 167):  # 167 B more than the exact fit: still no room for one more row
        got = hf.read_hot_file(path, manifest, RANGE, b)
        assert got is not None and got.nbytes <= b
        assert got.cut == (ranks < 750)
        for layer, (ids, data) in rows.items():
            n = min(ranks, ids.size)
            np.testing.assert_array_equal(got.layers[layer][0], ids[:n])
            assert got.layers[layer][1].tobytes() == data[:n].tobytes()


def test_budget_cut_reads_only_the_prefix_it_needs(written, monkeypatch):
    """A cut reads no block past it: a flipped bit after the cut is never read, and every row returned is right."""
    path, manifest, rows = written
    _, segs = _layout(path)
    start, nid, nrow = segs[-1]
    _flip(path, start + nid + nrow - 1)  # the last row of the last segment
    got = hf.read_hot_file(path, manifest, RANGE, 100 * (168 + 328))  # one block of each table
    for layer, (ids, data) in rows.items():
        np.testing.assert_array_equal(got.layers[layer][0], ids[:100])
        assert got.layers[layer][1].tobytes() == data[:100].tobytes()


def test_a_cut_inside_a_segment_still_checks_its_tail(written, caplog):
    """The cut at rank 150 falls inside block 1 (ranks 100..199): that segment is read whole and checked whole,
    so a flipped bit in a row the budget leaves out still refuses the file."""
    path, manifest, _ = written
    _, segs = _layout(path)
    start, nid, _ = segs[2]  # block 1 of the fp8 table
    _flip(path, start + nid + 90 * 160 + 3)  # row 190, past the cut
    _ignored(caplog, path, manifest, "corrupt rows", budget=150 * (168 + 328))


def test_empty_hot_file_and_empty_tables(sidecar, tmp_path):
    manifest, tables = sidecar
    path = tmp_path / "e.plehot"
    hf.write_hot_file(path, manifest, RANGE, {})
    got = hf.read_hot_file(path, manifest, RANGE, 1 << 20)
    assert got is not None and got.layers == {} and got.rows == 0
    hf.write_hot_file(path, manifest, RANGE, {FP8: (np.empty(0, np.int64), np.empty((0, 160), np.uint8))})
    got = hf.read_hot_file(path, manifest, RANGE, 1 << 20)
    assert got.layers[FP8][0].size == 0


# ----------------------------------------------------------------------------- bad files


def test_missing(sidecar, tmp_path, caplog):
    _ignored(caplog, tmp_path / "none.plehot", sidecar[0], "missing")


@pytest.mark.parametrize("where", ["empty", "mid-prefix", "mid-meta", "mid-digests", "at-header-end", "mid-ids",
                                   "between-ids-and-rows", "mid-rows", "mid-last-segment", "last-byte"])
def test_truncated(written, caplog, where):
    path, manifest, _ = written
    header_end, segs = _layout(path)
    meta_len = struct.unpack_from("<8sIIQ", path.read_bytes())[2]
    start, nid, nrow = segs[1]
    cut = {"empty": 0, "mid-prefix": 11, "mid-meta": 24 + meta_len // 2, "mid-digests": 24 + meta_len + 40,
           "at-header-end": header_end, "mid-ids": start + nid // 2, "between-ids-and-rows": start + nid,
           "mid-rows": start + nid + nrow // 2, "mid-last-segment": segs[-1][0] + 3,
           "last-byte": path.stat().st_size - 1}[where]
    os.truncate(path, cut)
    _ignored(caplog, path, manifest, "truncated")


def test_truncation_is_seen_before_any_row_is_read(written, caplog, monkeypatch):
    path, manifest, _ = written
    os.truncate(path, path.stat().st_size - 1)
    spy = _OsSpy()
    monkeypatch.setattr(hf, "os", spy)
    _ignored(caplog, path, manifest, "truncated (")
    assert len(spy.reads) == 2  # the header's two reads, then the size check


def test_trailing_bytes(written, caplog):
    path, manifest, _ = written
    with open(path, "ab") as f:
        f.write(b"\0")
    _ignored(caplog, path, manifest, "corrupt (")


def test_a_file_that_shrinks_while_read_is_truncated(written, caplog, monkeypatch):
    """The size check passes (fstat says the old size), then the file ends early: the short read is caught."""
    path, manifest, _ = written
    size, ino = path.stat().st_size, path.stat().st_ino
    os.truncate(path, size - 1000)

    def old_size(fd):  # of the hot file only (the tables' are checked against their recorded identity)
        st = os.fstat(fd)
        return st if st.st_ino != ino else os.stat_result((st.st_mode, *st[1:6], size, *st[7:]))
    monkeypatch.setattr(hf, "os", _Os(fstat=old_size))
    _ignored(caplog, path, manifest, "truncated in layer")


@pytest.mark.parametrize("where,why", [
    ("magic", "bad magic"), ("version", "another version"), ("meta_len", "corrupt header"),
    ("meta", "corrupt header"), ("digests", "corrupt header (checksum mismatch)"),
    ("checksum", "corrupt header (checksum mismatch)"), ("ids", "corrupt rows"), ("rows", "corrupt rows"),
    ("last-row", "corrupt rows"),
])
@pytest.mark.parametrize("bit", [0, 7])
def test_one_flipped_bit(written, caplog, where, why, bit):
    path, manifest, _ = written
    header_end, segs = _layout(path)
    meta_len = struct.unpack_from("<8sIIQ", path.read_bytes())[2]
    off = {"magic": 3, "version": 8, "meta_len": 13, "meta": 24 + meta_len // 2, "digests": 24 + meta_len + 5,
           "checksum": header_end - 1, "ids": segs[2][0] + 17, "rows": segs[3][0] + segs[3][1] + 1000,
           "last-row": path.stat().st_size - 1}[where]
    _flip(path, off, bit)
    _ignored(caplog, path, manifest, why)


def test_every_byte_flipped_is_caught(sidecar, tmp_path, caplog):
    """A bit flipped in any byte of the header, or in every 151st byte of the rows, never gives a HotSet."""
    manifest, tables = sidecar
    path = tmp_path / "small.plehot"
    hf.write_hot_file(path, manifest, RANGE, _hot(tables, (150, 80)), block_rows=BLOCK)
    good = path.read_bytes()
    header_end, _ = _layout(path)
    for off in [*range(header_end), *range(header_end, len(good), 151)]:
        raw = bytearray(good)
        raw[off] ^= 0x10
        path.write_bytes(bytes(raw))
        _ignored(caplog, path, manifest, "")


def test_another_sidecar(written, tmp_path, caplog):
    """A sidecar with other bytes in one table (so another SHA-256) refuses the file; so does one with a table
    the file has but that the sidecar lacks."""
    path, manifest, _ = written
    other = {FP8: random_table(ROWS, 160, 1), BF16: random_table(ROWS, 320, 3)}
    write_sidecar(tmp_path / "other", {FP8: ("float8_e4m3fn", other[FP8]), BF16: ("bfloat16", other[BF16])})
    _ignored(caplog, path, load_manifest(tmp_path / "other"), "another sidecar")
    write_sidecar(tmp_path / "one", {FP8: ("float8_e4m3fn", other[FP8])})
    _ignored(caplog, path, load_manifest(tmp_path / "one"), "another sidecar")


def test_another_sidecar_same_identity_but_other_table_hash(written, caplog, monkeypatch):
    """Belt and braces: even were two sidecars' identities equal, each table's own SHA-256 is checked."""
    path, manifest, _ = written
    forged = dataclasses.replace(manifest, tables=tuple(
        dataclasses.replace(t, sha256="0" * 64) if t.layer == BF16 else t for t in manifest.tables))
    identity = hf.manifest_identity(manifest)
    monkeypatch.setattr(hf, "manifest_identity", lambda m: identity)
    _ignored(caplog, path, forged, "layer 5: table SHA-256")


def _identity(manifest):
    """The identity as the module documents it, computed here independently."""
    doc = [hf.SIDECAR_FORMAT] + [[t.layer, t.sha256, t.dtype, t.rows, t.columns, t.row_start, t.bytes]
                                 for t in sorted(manifest.tables, key=lambda t: t.layer)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def test_identity_is_the_tables_not_the_path(sidecar, tmp_path):
    manifest, tables = sidecar
    assert _identity(manifest) == hf.manifest_identity(manifest)
    write_sidecar(tmp_path / "moved", {FP8: ("float8_e4m3fn", tables[FP8]), BF16: ("bfloat16", tables[BF16])})
    assert hf.manifest_identity(load_manifest(tmp_path / "moved")) == hf.manifest_identity(manifest)


def test_another_row_range(sidecar, tmp_path, caplog):
    manifest, tables = sidecar
    path = tmp_path / "tp.plehot"
    hf.write_hot_file(path, manifest, (0, 1500), _hot(tables, (100, 50), hi=1500), block_rows=BLOCK)
    assert hf.read_hot_file(path, manifest, (0, 1500), 1 << 20) is not None
    _ignored(caplog, path, manifest, "another row range", row_range=(1500, ROWS))
    _ignored(caplog, path, manifest, "another row range", row_range=(0, ROWS))


def test_another_version(written, caplog, monkeypatch):
    """A whole, consistent file of another version (its header checksum right for its bytes)."""
    path, manifest, rows = written
    monkeypatch.setattr(hf, "VERSION", 2)
    hf.write_hot_file(path, manifest, RANGE, rows, block_rows=BLOCK)
    monkeypatch.setattr(hf, "VERSION", 1)
    assert "another version (2; this kit reads version 1)" in _ignored(caplog, path, manifest, "another version")


def test_not_a_hot_file(written, caplog):
    path, manifest, _ = written
    path.write_bytes(b'{"format": "sglang-ssd-stream"}' * 10)
    _ignored(caplog, path, manifest, "bad magic")


def test_a_directory_at_the_path(sidecar, tmp_path, caplog):
    (tmp_path / "d.plehot").mkdir()
    _ignored(caplog, tmp_path / "d.plehot", sidecar[0], "not a regular file")


def test_a_fifo_at_the_path_does_not_hang(sidecar, tmp_path, caplog):
    os.mkfifo(tmp_path / "f.plehot")
    _ignored(caplog, tmp_path / "f.plehot", sidecar[0], "not a regular file")


def test_a_symlink_loop_at_the_path(sidecar, tmp_path, caplog):
    os.symlink(tmp_path / "loop.plehot", tmp_path / "loop.plehot")
    _ignored(caplog, tmp_path / "loop.plehot", sidecar[0], "unreadable")


def test_unreadable_permissions(written, caplog, monkeypatch):
    path, manifest, _ = written
    os.chmod(path, 0)
    if os.geteuid() == 0:  # root reads a mode-000 file: make the open fail as it would for anyone else
        real = os.open

        def refusing(p, *a, **k):
            if os.fspath(p) == os.fspath(path):
                raise PermissionError(13, "Permission denied", os.fspath(p))
            return real(p, *a, **k)
        monkeypatch.setattr(hf, "os", _Os(open=refusing))
    _ignored(caplog, path, manifest, "unreadable (Permission denied)")


def test_invalid_ids_behind_a_right_checksum(sidecar, tmp_path, caplog, monkeypatch):
    """A file whose checksums are right but whose ids are not (a writer bug, say): still refused."""
    manifest, tables = sidecar
    rows = _hot(tables, (10, 10))
    dup = rows[FP8][0].copy()
    dup[3] = dup[2]
    monkeypatch.setattr(hf, "_tables_for", lambda m, r, by: [(FP8, dup, rows[FP8][1])])  # skip the writer's checks
    path = tmp_path / "bad-ids.plehot"
    hf.write_hot_file(path, manifest, RANGE, rows)
    _ignored(caplog, path, manifest, "invalid ids in layer 2")


def test_never_raises_on_junk(sidecar, tmp_path, caplog):
    """Random files of many sizes, some with our magic and version in front."""
    manifest = sidecar[0]
    rng = np.random.default_rng(5)
    path = tmp_path / "junk.plehot"
    for i in range(60):
        raw = rng.integers(0, 256, int(rng.integers(0, 4000)), dtype=np.uint8).tobytes()
        if i % 2:
            raw = struct.pack("<8sIIQ", hf.MAGIC, hf.VERSION, int(rng.integers(0, 3000)), int(rng.integers(0, 9)))
            raw += rng.integers(0, 256, int(rng.integers(0, 4000)), dtype=np.uint8).tobytes()
        path.write_bytes(raw)
        _ignored(caplog, path, manifest, "")


# ----------------------------------------------------------------------------- writing


def test_a_failed_rename_leaves_the_old_file(written, caplog, monkeypatch):
    path, manifest, rows = written
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic_file, "os", _Os(replace=crash))  # the kit's one atomic writer
    with pytest.raises(OSError, match="No space"):
        hf.write_hot_file(path, manifest, RANGE, {FP8: rows[FP8]}, block_rows=BLOCK)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    got = hf.read_hot_file(path, manifest, RANGE, 1 << 30)
    assert set(got.layers) == {FP8, BF16}


def test_a_crash_mid_write_leaves_the_old_file(written, monkeypatch):
    path, manifest, rows = written
    before = path.read_bytes()
    real, calls = os.writev, []

    def dies_on_third(fd, bufs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(fd, bufs)
    monkeypatch.setattr(hf, "os", _Os(writev=dies_on_third))
    with pytest.raises(OSError, match="Input/output"):
        hf.write_hot_file(path, manifest, RANGE, rows, block_rows=BLOCK)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_write_replaces_and_is_synced(written, monkeypatch):
    path, manifest, rows = written
    synced = []
    real = os.fsync
    monkeypatch.setattr(atomic_file, "os", _Os(fsync=lambda fd: (synced.append(stat.S_ISREG(os.fstat(fd).st_mode)),
                                                                 real(fd))))
    hf.write_hot_file(path, manifest, RANGE, {BF16: rows[BF16]}, block_rows=BLOCK)
    assert synced == [True, False]  # the data before the rename, then the directory
    assert set(hf.read_hot_file(path, manifest, RANGE, 1 << 30).layers) == {BF16}


@pytest.mark.parametrize("bad,err", [
    ("layer", SidecarShapeMismatch), ("row_bytes", SidecarShapeMismatch), ("dtype", SidecarShapeMismatch),
    ("below", SidecarRowOutOfRange), ("above", SidecarRowOutOfRange), ("dup", SidecarRowOutOfRange),
])
def test_writer_refuses_bad_rows_before_writing(written, bad, err):
    path, manifest, rows = written
    before = path.read_bytes()
    ids, data = rows[FP8][0].copy(), rows[FP8][1]
    arg = {FP8: (ids, data)}
    if bad == "layer":
        arg = {9: (ids, data)}
    elif bad == "row_bytes":
        arg = {BF16: (ids, data)}
    elif bad == "dtype":
        arg = {FP8: (ids, data.view(np.int8))}
    elif bad == "below":
        ids[0] = -1
    elif bad == "above":
        ids[0] = 2000  # outside the writer's range (0, 1500)
    elif bad == "dup":
        ids[1] = ids[0]
    rng = (0, 1500) if bad == "above" else RANGE
    if bad == "above":
        ids[1:] = ids[1:] % 1500
    with pytest.raises(err):
        hf.write_hot_file(path, manifest, rng, arg)
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- one sequential pass


class _OsSpy:
    """The module's view of ``os``: records every call on the hot file (the one descriptor it opens itself; the
    tables' are opened by the reader module, and the sample of rows read back from them is positioned reads);
    reads go through the real position only."""

    def __init__(self):
        self.calls, self.reads, self.fd = [], [], None

    def __getattr__(self, name):
        real = getattr(os, name)
        if not callable(real):
            return real

        def call(*a, **k):
            if name == "open":
                self.fd = real(*a, **k)
                self.calls.append(name)
                return self.fd
            if a and a[0] == self.fd:
                self.calls.append(name)
            if name == "readv":
                fd, bufs = a
                pos = os.lseek(fd, 0, os.SEEK_CUR)  # the real os, not recorded: the module never seeks
                n = real(*a, **k)
                self.reads.append((pos, n, sum(memoryview(b).nbytes for b in bufs)))
                return n
            return real(*a, **k)
        return call


@pytest.mark.parametrize("budget", [1 << 30, 250 * (168 + 328)])
def test_one_sequential_pass(written, monkeypatch, budget):
    """Reads start at 0, each where the last ended (increasing offsets, no gap, no overlap), never a seek or a
    positioned read; after the header, each is a whole segment (ids and rows in one readv)."""
    path, manifest, _ = written
    spy = _OsSpy()
    monkeypatch.setattr(hf, "os", spy)
    got = hf.read_hot_file(path, manifest, RANGE, budget)
    assert got is not None
    assert not {"lseek", "pread", "preadv", "read"} & set(spy.calls), spy.calls
    pos = 0
    for start, n, asked in spy.reads:
        assert start == pos and n == asked > 0
        pos += n
    header_end, segs = _layout(path)
    assert spy.reads[0][0] == 0 and spy.reads[1][0] + spy.reads[1][1] == header_end  # the header: two reads
    body = spy.reads[2:]
    assert [s for s, _, _ in body] == [s for s, _, _ in segs[:len(body)]]
    assert all(n == i + r for (_, n, _), (_, i, r) in zip(body, segs, strict=False))
    if budget == 1 << 30:
        assert pos == path.stat().st_size and len(body) == len(segs)
    else:  # ranks 0..249: blocks 0..2 of both tables, and nothing after
        assert len(body) == 6 and pos < path.stat().st_size


# ----------------------------------------------------------------------------- names and helpers


def test_hot_file_path_is_per_process(sidecar, tmp_path, monkeypatch):
    manifest, tables = sidecar
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    write_sidecar(tmp_path / "other", {FP8: ("float8_e4m3fn", random_table(ROWS, 160, 7))})
    other = load_manifest(tmp_path / "other")
    names = {hf.hot_file_path(manifest, (0, 1500), "sglang-dp0"),
             hf.hot_file_path(manifest, (1500, ROWS), "sglang-dp0"),
             hf.hot_file_path(manifest, (0, 1500), "sglang-dp1"), hf.hot_file_path(other, (0, 1500), "sglang-dp0")}
    assert len(names) == 4
    for p in names:
        assert p.parent == tmp_path / "kit" / "hot" and p.suffix == ".plehot"
    assert hf.hot_file_path(manifest, (0, 1500), "vllm-rank0") == hf.hot_file_path(manifest, (0, 1500), "vllm-rank0")
    for role in ("", "../x", "a/b", ".hidden", "x" * 65, "tp 0", None):
        with pytest.raises(ValueError):
            hf.hot_file_path(manifest, (0, 1500), role)
    with pytest.raises(ValueError):
        hf.hot_file_path(manifest, (5, 5), "r")


def test_write_to_the_per_process_path(sidecar, tmp_path, monkeypatch):
    manifest, tables = sidecar
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    path = hf.hot_file_path(manifest, RANGE, "sglang-tp0")
    hf.write_hot_file(path, manifest, RANGE, _hot(tables), role="sglang-tp0")  # creates the directory
    assert hf.read_hot_file(path, manifest, RANGE, 1 << 30).rows == 750 + 433


def test_hottest():
    ids = np.array([10, 11, 12, 13, 14, 15], np.int64)
    counts = np.array([5, 9, 5, 1, 9, 5], np.uint32)
    np.testing.assert_array_equal(hf.hottest(ids, counts, 3), [11, 14, 10])
    np.testing.assert_array_equal(hf.hottest(ids, counts, 4), [11, 14, 10, 12])  # ties: the smaller id first
    np.testing.assert_array_equal(hf.hottest(ids, counts, 99), [11, 14, 10, 12, 15, 13])
    assert hf.hottest(ids, counts, 0).size == 0
    rng = np.random.default_rng(0)
    ids = rng.permutation(100_000).astype(np.int64)
    counts = rng.integers(0, 50, ids.size)
    want = ids[np.lexsort((ids, -counts))][:1000]
    np.testing.assert_array_equal(hf.hottest(ids, counts, 1000), want)
    with pytest.raises(ValueError):
        hf.hottest(ids, counts[:5], 3)


def test_each_table_binds_its_own_range(sidecar, tmp_path, caplog):
    """Tables of different sizes split differently over TP ranks: a range per table, each checked."""
    manifest, tables = sidecar
    ranges = {FP8: (0, 2000), BF16: (1000, ROWS)}
    rows = {FP8: (np.arange(10, dtype=np.int64), tables[FP8][:10]),
            BF16: (np.arange(2990, 3000, dtype=np.int64), tables[BF16][2990:3000])}
    path = tmp_path / "r.plehot"
    hf.write_hot_file(path, manifest, ranges, rows)
    got = hf.read_hot_file(path, manifest, ranges, 1 << 30)
    assert got.row_range == ranges and got.layers[BF16][0].tolist() == list(range(2990, 3000))
    _ignored(caplog, path, manifest, "another row range", row_range={FP8: (0, 2000), BF16: (0, ROWS)})
    with pytest.raises(SidecarRowOutOfRange):  # an id outside its own table's range
        hf.write_hot_file(path, manifest, {FP8: (0, 5), BF16: (1000, ROWS)}, rows)
    assert "-ranges" in hf.hot_file_path(manifest, ranges, "r").name
    assert "-rows0-3001-" in hf.hot_file_path(manifest, RANGE, "r").name


# ----------------------------------------------------------------------------- the rows are the table's (issue 38)


def _rewrite_in_place(file, data: bytes) -> None:
    """Write ``data`` over ``file`` (same inode, same size) and put its mtime back, as a careful editor would.
    The sleep: ctime is stamped from the kernel's coarse clock, so a rewrite within one tick of the file's own
    creation would keep it (the trust model's stated limit)."""
    st = os.stat(file)
    time.sleep(0.05)
    with open(file, "r+b") as f:
        f.write(data)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(file).st_ino, os.stat(file).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def test_an_unchanged_table_loads_as_before_even_when_its_artifact_moves(written, tmp_path):
    path, manifest, rows = written
    for _ in range(2):  # reading the tables (the sample, a server's reads) changes nothing
        got = hf.read_hot_file(path, manifest, RANGE, 1 << 30)
        assert got is not None and got.rows == 750 + 433
    os.rename(manifest.root, tmp_path / "moved")  # the directory moves; its table files' inodes are untouched
    got = hf.read_hot_file(path, load_manifest(tmp_path / "moved"), RANGE, 1 << 30)
    assert got is not None and got.layers[FP8][1].tobytes() == rows[FP8][1].tobytes()


def test_the_file_records_each_table_files_identity(written):
    path, manifest, _ = written
    raw = path.read_bytes()
    meta = json.loads(raw[24:24 + struct.unpack_from("<8sIIQ", raw)[2]])
    for t in meta["tables"]:
        st = os.stat(manifest.table(t["layer"]).file)
        assert t["file"] == {"device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
                             "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def test_a_table_rewritten_in_place_with_its_mtime_put_back_is_refused(written, caplog):
    """Even with the very same bytes: the file no longer proves which rows it was learned from."""
    path, manifest, _ = written
    table = manifest.table(BF16).file
    _rewrite_in_place(table, table.read_bytes())
    why = _ignored(caplog, path, manifest, f"layer {BF16}'s table {table} is not the file its rows were read from")
    assert "ctime_ns" in why and "mtime_ns" not in why and "inode" not in why


def test_a_table_replaced_by_a_rename_is_refused(written, caplog):
    path, manifest, _ = written
    table = manifest.table(FP8).file
    new = table.with_name("layer-new.bin")
    new.write_bytes(table.read_bytes())  # the same rows, as a restore from a backup brings them
    os.replace(new, table)
    assert "inode" in _ignored(caplog, path, manifest, f"layer {FP8}'s table {table} is not the file")


@pytest.mark.parametrize("forged", ["the hottest row", "every row", "the last row of a small file"])
def test_a_forged_file_with_right_checksums_is_refused(sidecar, tmp_path, caplog, forged):
    """Wrong rows written with the real writer: the identities and every checksum are right for the file, and
    only reading rows back from the table tells. A table of at most SPOT_HEAD + SPOT_SAMPLE rows in the file is
    checked whole."""
    manifest, tables = sidecar
    counts = (40, 30) if forged == "the last row of a small file" else (750, 433)
    rows = _hot(tables, counts)
    ids, data = rows[FP8][0], rows[FP8][1].copy()
    if forged == "every row":
        data = random_table(ids.size, 160, 99)
    else:
        data[0 if forged == "the hottest row" else -1, 7] ^= 0x40
    rows[FP8] = (ids, data)
    path = tmp_path / "forged.plehot"
    hf.write_hot_file(path, manifest, RANGE, rows, block_rows=BLOCK)
    _ignored(caplog, path, manifest, f"layer {FP8}'s row")
    assert "differs from its table" in caplog.records[-1].getMessage()
    assert max(counts) <= hf.SPOT_HEAD + hf.SPOT_SAMPLE or forged != "the last row of a small file"
