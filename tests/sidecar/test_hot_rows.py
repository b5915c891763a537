"""A process's hot rows across a restart (issue 27 item 1): real row caches over a real sidecar write their
hottest rows to the hot file and a new set of caches (the next start) gets them back without reading the disk."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sglang_ssd_stream.sidecar import SidecarReader, load_manifest
from sglang_ssd_stream.sidecar.hot_rows import HotRows
from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig
from tests.vllm.synthetic import random_table, write_sidecar

ROWS = 4000
LAYERS = (2, 5)


@pytest.fixture
def sidecar(tmp_path):
    tables = {n: random_table(ROWS, 160, n) for n in LAYERS}
    write_sidecar(tmp_path / "art", {n: ("float8_e4m3fn", t) for n, t in tables.items()})
    return load_manifest(tmp_path / "art"), tables


def _caches(manifest, capacity=1000, lo=0, hi=ROWS):
    return {n: RowCache(SidecarReader(manifest.table(n), vocab_start=lo, vocab_end=hi, max_rows=4096),
                        np.zeros((capacity, 160), np.uint8), RowCacheConfig(workers=2))
            for n in LAYERS}


def _look(caches, ids):
    for c in caches.values():
        c.read_rows(np.asarray(ids, np.int64), np.empty((len(ids), 160), np.uint8))


def test_a_restart_starts_with_the_hot_rows_and_reads_nothing_for_them(sidecar, tmp_path):
    manifest, tables = sidecar
    path = tmp_path / "hot" / "p.plehot"
    first = _caches(manifest)
    hot_ids = np.arange(100, 400, dtype=np.int64)
    for _ in range(3):
        _look(first, hot_ids)
    _look(first, np.arange(2000, 2600))  # looked up once: colder than the hot ones
    hot = HotRows(manifest, first, share=0.25, interval_s=0, role="t", path=path)  # 250 rows a layer
    assert hot.write() == 2 * 250
    for c in first.values():
        c.close()

    second = _caches(manifest)  # the next start
    again = HotRows(manifest, second, share=0.25, interval_s=0, role="t", path=path)
    assert again.load() == 2 * 250
    for n, c in second.items():
        assert c.contains(hot_ids[:250]).all() and not c.contains(np.arange(2000, 2600)).any()
        out = np.empty((250, 160), np.uint8)
        c.read_rows(hot_ids[:250], out)
        np.testing.assert_array_equal(out, tables[n][hot_ids[:250]])  # the right bytes, from no disk read
        assert c.stats["rows_read"] == 0 and c.stats["hits"] == 250
        c.close()


def test_a_file_that_would_barely_change_is_kept_and_rewritten_once_the_hot_set_moves(sidecar, tmp_path, caplog):
    """Writes are the hot file's cost (the whole cache per interval): a write whose rows would change by under
    REWRITE_MIN_CHANGED leaves the file as it is; more change, a missing file, or a restart that served nothing
    new each do the right thing."""
    from sglang_ssd_stream.sidecar.hot_rows import REWRITE_MIN_CHANGED

    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    caches = _caches(manifest)
    hot_ids = np.arange(1000, 1200, dtype=np.int64)
    for _ in range(3):
        _look(caches, hot_ids)
    hot = HotRows(manifest, caches, share=0.2, interval_s=0, role="t", path=path)  # 200 rows a layer
    assert hot.write() == 2 * 200
    first = path.stat()
    _look(caches, hot_ids)
    caplog.set_level(logging.INFO)
    assert hot.write() == 0  # the same rows: not rewritten
    assert hot.skipped == 1 and "kept: 400 rows, 0.0 % of them changed" in caplog.records[-1].getMessage()
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    few = int(200 * REWRITE_MIN_CHANGED) - 1  # just under the limit of one layer's rows
    for _ in range(8):  # hotter than the old set (each write halves the counts; a row at 0 drops out)
        _look(caches, np.arange(3000, 3000 + few))
    _look(caches, hot_ids)
    assert hot.write() == 0 and path.stat().st_ino == first.st_ino
    for _ in range(8):
        _look(caches, np.arange(3000, 3000 + few + 2))  # now over it: the file follows the traffic
    _look(caches, hot_ids)
    assert hot.write() == 2 * 200 and path.stat().st_ino != first.st_ino
    assert "written" in caplog.records[-1].getMessage()
    _look(caches, hot_ids)
    path.unlink()  # removed meanwhile (an operator's reset): written again, changed or not
    assert hot.write() == 2 * 200 and path.is_file()
    written = path.stat()
    for c in caches.values():
        c.close()

    restart = _caches(manifest)
    again = HotRows(manifest, restart, share=0.2, interval_s=0, role="t", path=path)
    assert again.load() == 2 * 200
    _look(restart, hot_ids[:50])  # a little traffic on the rows it loaded: nothing new to save at its stop
    again.close()
    assert again.skipped == 1 and path.stat().st_ino == written.st_ino
    for c in restart.values():
        c.close()


def test_a_kept_file_is_only_ever_the_one_this_process_read_or_wrote_whole(sidecar, tmp_path):
    """Keeping a file is safe only when it is the very file, whole: one the share cut at load, one damaged or
    replaced by another writer while serving, is written again though the hot set did not move."""
    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    hot_ids = np.arange(1000, 1900, dtype=np.int64)
    first = _caches(manifest)
    for _ in range(2):
        _look(first, hot_ids)
    assert HotRows(manifest, first, share=1.0, interval_s=0, role="t", path=path).write() == 2 * 900
    big = path.stat().st_size
    for c in first.values():
        c.close()

    cut = _caches(manifest)  # a smaller share at the next start: the file holds rows it leaves out
    hot = HotRows(manifest, cut, share=0.2, interval_s=0, role="t", path=path)
    assert hot.load() == 2 * 200
    placed = hot_ids[:200]  # the file's first 200 (equal counts: the lower id first)
    assert all(c.contains(placed).all() for c in cut.values())
    _look(cut, placed)  # the same rows again: only the cut makes this write
    assert hot.write() == 2 * 200 and hot.skipped == 0 and path.stat().st_size < big / 3

    _look(cut, placed)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])  # cut by something else while serving
    assert hot.write() == 2 * 200 and path.stat().st_size == len(raw)

    other = _caches(manifest)  # another writer of the same name (say `sidecar profile`) replaces it
    _look(other, np.arange(3000, 3200))
    assert HotRows(manifest, other, share=0.2, interval_s=0, role="t", path=path).write() == 2 * 200
    _look(cut, placed)
    assert hot.write() == 2 * 200 and hot.skipped == 0
    fresh = _caches(manifest)
    assert HotRows(manifest, fresh, share=0.2, interval_s=0, role="t", path=path).load() == 2 * 200
    for c in fresh.values():
        assert c.contains(placed).all() and not c.contains(np.arange(3000, 3200)).any()
    for c in (*cut.values(), *other.values(), *fresh.values()):
        c.close()


def test_a_file_of_another_rank_or_a_damaged_one_is_ignored_with_one_warning(sidecar, tmp_path, caplog):
    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    caches = _caches(manifest)
    _look(caches, np.arange(50))
    HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path=path).write()
    other = _caches(manifest, lo=0, hi=2000)  # another TP range
    with caplog.at_level(logging.WARNING):
        assert HotRows(manifest, other, share=0.5, interval_s=0, role="t", path=path).load() == 0
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "range" in caplog.records[0].getMessage()
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 1  # a row byte
    path.write_bytes(bytes(raw))
    caplog.clear()
    fresh = _caches(manifest)
    with caplog.at_level(logging.WARNING):
        assert HotRows(manifest, fresh, share=0.5, interval_s=0, role="t", path=path).load() == 0
    assert len(caplog.records) == 1 and all(c.contains(np.arange(50)).sum() == 0 for c in fresh.values())


def test_a_failed_write_is_one_warning_and_the_server_goes_on(sidecar, tmp_path, caplog):
    manifest, _ = sidecar
    caches = _caches(manifest)
    _look(caches, np.arange(10))
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    hot = HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path=blocked / "p.plehot")
    with caplog.at_level(logging.WARNING):
        assert hot.write() is None
    assert len(caplog.records) == 1 and "not written" in caplog.records[0].getMessage()
    for c in caches.values():
        c.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        hot.close()  # at exit, the caches may be closed already: one warning, no exception
    assert len(caplog.records) == 1


def test_the_periodic_writer_writes_and_close_writes_once_more(sidecar, tmp_path):
    manifest, _ = sidecar
    caches = _caches(manifest)
    _look(caches, np.arange(20))
    path = tmp_path / "p.plehot"
    hot = HotRows(manifest, caches, share=0.5, interval_s=0.05, role="t", path=path)
    hot.start()
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists()
    hot.close()
    assert hot._thread is not None and not hot._thread.is_alive()
    hot.close()  # idempotent


def test_a_sigterm_writes_the_file_then_ends_the_process_as_sigterm_does(sidecar, tmp_path):
    """A stop is a SIGTERM to every process of the server (systemd, docker stop, a kill of the process group),
    which skips ``atexit``: the handler HotRows sets writes the file first, and the process still ends by
    SIGTERM. Run in a child process, as a model worker is; close() gives SIGTERM its default back."""
    art = tmp_path / "art"
    assert art.is_dir()
    path = tmp_path / "p.plehot"
    child = textwrap.dedent(f"""
        import signal, sys, time
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.sidecar.test_hot_rows import _caches, _look
        from sglang_ssd_stream.sidecar import load_manifest
        from sglang_ssd_stream.sidecar.hot_rows import HotRows
        manifest = load_manifest({str(art)!r})
        caches = _caches(manifest)
        _look(caches, np.arange(30))
        hot = HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path={str(path)!r})
        hot.start()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        if sys.argv[1] == "close":
            hot.close()
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        print("ready", flush=True)
        time.sleep(60)
    """)
    for mode, written in (("serve", 2 * 30), ("close", 2 * 30)):
        path.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", child, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        if mode == "close":
            path.unlink()  # close() wrote it; a SIGTERM now must not write again
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM, proc.stderr.read()
        if mode == "serve":
            again = _caches(manifest := load_manifest(art))
            assert HotRows(manifest, again, share=0.5, interval_s=0, role="t", path=path).load() == written
        else:
            assert not path.exists()


def _worker_writes_at_exit(art: str, path: str, how: str) -> None:
    """A model worker's life in a multiprocessing child: serve, start the hot file, end (``os._exit`` follows)."""
    manifest = load_manifest(art)
    caches = _caches(manifest)
    _look(caches, np.arange(40))
    HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path=path).start()
    if how == "exit":
        raise SystemExit(0)  # as vLLM's worker SIGTERM handler ends it


@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_forked_worker_writes_at_its_exit(sidecar, tmp_path, how):
    """vLLM's workers are multiprocessing children (fork by default), which end with os._exit: atexit never runs
    there, multiprocessing's finalizers do."""
    import multiprocessing

    manifest, _ = sidecar
    path = tmp_path / "w.plehot"
    proc = multiprocessing.get_context("fork").Process(target=_worker_writes_at_exit,
                                                       args=(str(tmp_path / "art"), str(path), how))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and path.exists()
    assert HotRows(manifest, _caches(manifest), share=0.5, interval_s=0, role="t", path=path).load() == 2 * 40


def test_a_write_cut_short_leaves_a_temporary_that_the_next_start_removes(sidecar, tmp_path):
    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    stale = tmp_path / ".p.plehot.abc123.tmp"  # atomic_file's temporary of a write a SIGKILL cut short
    stale.write_bytes(b"x" * 4096)
    other = tmp_path / ".q.plehot.abc123.tmp"  # another process's: not ours to remove
    other.write_bytes(b"y")
    assert HotRows(manifest, _caches(manifest), share=0.5, interval_s=0, role="t", path=path).load() == 0
    assert not stale.exists() and other.exists()


def test_bad_arguments_are_refused(sidecar):
    manifest, _ = sidecar
    with pytest.raises(ValueError, match="no row cache"):
        HotRows(manifest, {}, share=0.5, interval_s=0, role="t")
    with pytest.raises(ValueError, match="share"):
        HotRows(manifest, _caches(manifest), share=0, interval_s=0, role="t")


def test_tables_of_different_sizes_each_keep_their_range(tmp_path):
    """The real model's PLE tables differ in size (each layer's heads are other primes), so a TP rank serves
    another range of each: the file binds each table's range, and a restart gets every table's rows back."""
    sizes = {2: 4000, 5: 4224}
    tables = {n: random_table(rows, 160, n) for n, rows in sizes.items()}
    write_sidecar(tmp_path / "art", {n: ("float8_e4m3fn", t) for n, t in tables.items()})
    manifest = load_manifest(tmp_path / "art")

    def caches():
        return {n: RowCache(SidecarReader(manifest.table(n), vocab_start=0, vocab_end=rows, max_rows=4096),
                            np.zeros((500, 160), np.uint8), RowCacheConfig(workers=2)) for n, rows in sizes.items()}
    first = caches()
    _look(first, np.arange(3990, 4000))
    first[5].read_rows(np.arange(4100, 4200, dtype=np.int64), np.empty((100, 160), np.uint8))  # past table 2's end
    path = tmp_path / "p.plehot"
    assert HotRows(manifest, first, share=1.0, interval_s=0, role="t", path=path).write() == 10 + 110
    second = caches()
    assert HotRows(manifest, second, share=1.0, interval_s=0, role="t", path=path).load() == 120
    assert second[5].contains(np.arange(4100, 4200, dtype=np.int64)).all()
    out = np.empty((100, 160), np.uint8)
    second[5].read_rows(np.arange(4100, 4200, dtype=np.int64), out)
    np.testing.assert_array_equal(out, tables[5][4100:4200])
    assert second[5].stats["rows_read"] == 0


def test_process_roles_name_the_engine_device_and_ranks():
    from sglang_ssd_stream.sidecar.hot_rows import process_role

    assert process_role("sglang", gpu=1, tp=1, pp=0) == "sglang-gpu1-tp1-pp0"
    assert process_role("vllm", gpu=None, tp=None, pp=None) == "vllm-cpu"  # no CUDA, no distributed groups


# ----------------------------------------------------------------------------- a hot file never carries a wrong row


def _rewrite_rows_in_place(file, ids, rows) -> None:
    """Write ``rows`` over rows ``ids`` of a table file in place and put its mtime back (inode and size kept)."""
    st = os.stat(file)
    time.sleep(0.05)  # ctime is stamped from the kernel's coarse clock: a tick away from the file's creation
    with open(file, "r+b") as f:
        for i, row in zip(ids.tolist(), rows, strict=True):
            f.seek(i * 160)
            f.write(row.tobytes())
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def _restore_by_rename(file, table) -> None:
    new = file.with_name(file.name + ".new")
    new.write_bytes(table.tobytes())
    os.replace(new, file)


def test_a_forged_hot_file_places_no_row(sidecar, tmp_path, caplog):
    """A file of wrong rows with every identity and checksum right (written by the real writer): refused, one
    warning, not one row in the caches; the rows then come from the table."""
    from sglang_ssd_stream.sidecar.hot_file import write_hot_file

    manifest, tables = sidecar
    path = tmp_path / "p.plehot"
    hot_ids = np.arange(100, 300, dtype=np.int64)
    wrong = {n: (hot_ids, random_table(hot_ids.size, 160, 50 + n)) for n in LAYERS}
    write_hot_file(path, manifest, {n: (0, ROWS) for n in LAYERS}, wrong)
    caches = _caches(manifest)
    with caplog.at_level(logging.WARNING):
        assert HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path=path).load() == 0
    assert len(caplog.records) == 1 and "differs from its table" in caplog.records[0].getMessage()
    for n, c in caches.items():
        assert c.occupancy() == (0, 0)
        out = np.empty((hot_ids.size, 160), np.uint8)
        c.read_rows(hot_ids, out)
        np.testing.assert_array_equal(out, tables[n][hot_ids])
        c.close()


def test_wrong_rows_served_from_a_table_rewritten_in_place_do_not_outlive_its_restore(sidecar, tmp_path, caplog):
    """Issue 38 (b): a table rewritten in place with its mtime put back is served wrong and its rows are saved;
    the operator restores the right table by a rename; the restart (whose re-hash of the tables passes) refuses
    the hot file, serves the right rows from the table and writes them; the start after that loads them."""
    manifest, tables = sidecar
    path = tmp_path / "p.plehot"
    hot_ids = np.arange(100, 300, dtype=np.int64)
    layer = LAYERS[0]
    file = manifest.table(layer).file
    _rewrite_rows_in_place(file, hot_ids, random_table(hot_ids.size, 160, 77))
    wrong = _caches(manifest)  # a start after the rewrite (a start that did not re-hash): it serves wrong rows
    for _ in range(3):
        _look(wrong, hot_ids)
    assert HotRows(manifest, wrong, share=0.2, interval_s=0, role="t", path=path).write() == 2 * 200
    for c in wrong.values():
        c.close()

    _restore_by_rename(file, tables[layer])
    restart = _caches(manifest)
    with caplog.at_level(logging.WARNING):
        hot = HotRows(manifest, restart, share=0.2, interval_s=0, role="t", path=path)
        assert hot.load() == 0
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert f"layer {layer}'s table {file} is not the file its rows were read from (inode" in caplog.text
    assert all(c.occupancy() == (0, 0) for c in restart.values())
    for n, c in restart.items():
        out = np.empty((hot_ids.size, 160), np.uint8)
        for _ in range(3):
            c.read_rows(hot_ids, out)
        np.testing.assert_array_equal(out, tables[n][hot_ids])
    assert hot.write() == 2 * 200
    for c in restart.values():
        c.close()

    again = _caches(manifest)  # an unchanged table: the file loads as before
    assert HotRows(manifest, again, share=0.2, interval_s=0, role="t", path=path).load() == 2 * 200
    for n, c in again.items():
        out = np.empty((hot_ids.size, 160), np.uint8)
        c.read_rows(hot_ids, out)
        np.testing.assert_array_equal(out, tables[n][hot_ids])
        assert c.stats["rows_read"] == 0
        c.close()


def test_a_table_rewritten_while_served_is_not_saved(sidecar, tmp_path, caplog):
    """The cache may hold rows of either content: the writer refuses, one warning, and leaves the file as it was."""
    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    caches = _caches(manifest)
    _look(caches, np.arange(50))
    hot = HotRows(manifest, caches, share=0.5, interval_s=0, role="t", path=path)
    assert hot.write() == 2 * 50
    before = path.read_bytes()
    file = manifest.table(LAYERS[1]).file
    _rewrite_rows_in_place(file, np.arange(50), random_table(50, 160, 78))
    _look(caches, np.arange(50, 200))
    with caplog.at_level(logging.WARNING):
        assert hot.write() is None
    assert len(caplog.records) == 1 and f"PLE table {file} (layer {LAYERS[1]}) changed while it is served" \
        in caplog.records[0].getMessage()
    assert path.read_bytes() == before
    for c in caches.values():
        c.close()


def test_two_writers_of_one_file_lose_no_write(sidecar, tmp_path):
    """Two processes given one role each remove stale temporaries at their start and write the file: neither
    removes the other's temporary mid-write (it is locked), so every write lands."""
    from sglang_ssd_stream.sidecar.hot_file import write_hot_file

    manifest, tables = sidecar
    path = tmp_path / "p.plehot"
    ranges = {n: (0, ROWS) for n in LAYERS}
    rows = {n: (np.arange(2000, dtype=np.int64), tables[n][:2000]) for n in LAYERS}
    errors = []

    def writer():
        hot = HotRows(manifest, _caches(manifest, capacity=10), share=1.0, interval_s=0, role="t", path=path)
        for _ in range(40):
            hot.load()  # a start: its stale temporaries removed, the file read
            try:
                write_hot_file(path, manifest, ranges, rows)
            except OSError as exc:
                errors.append(exc)
        for c in hot.caches.values():
            c.close()

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [], f"{len(errors)} of 80 writes lost: {errors[0]!r}"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".p.plehot")) == []


def test_a_start_leaves_a_live_writers_temporary_and_its_write_lands(sidecar, tmp_path):
    """The deterministic case of the race above: a start's cleanup runs while another writer is mid-write."""
    from sglang_ssd_stream.atomic_file import replacing

    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    with replacing(path) as f:
        f.write(b"half a file")
        (live,) = tmp_path.glob(".p.plehot.*.tmp")
        assert HotRows(manifest, _caches(manifest), share=0.5, interval_s=0, role="t", path=path).load() == 0
        assert live.exists()
        f.write(b", then the rest")
    assert path.read_bytes() == b"half a file, then the rest" and not live.exists()


def test_the_start_skips_a_directory_named_like_a_temporary_and_removes_the_stale_ones(sidecar, tmp_path):
    manifest, _ = sidecar
    path = tmp_path / "p.plehot"
    odd = tmp_path / ".p.plehot.0000dir.tmp"
    odd.mkdir()
    (odd / "inside").write_bytes(b"kept")
    stale = [tmp_path / f".p.plehot.{i:02d}stale.tmp" for i in range(20)]  # some before the directory, some after
    for p in stale:
        p.write_bytes(b"x" * 4096)
    os.symlink(stale[0], tmp_path / ".p.plehot.link.tmp")  # a link is not a writer's file either
    assert HotRows(manifest, _caches(manifest), share=0.5, interval_s=0, role="t", path=path).load() == 0
    assert not any(p.exists() for p in stale)
    assert (odd / "inside").read_bytes() == b"kept" and (tmp_path / ".p.plehot.link.tmp").is_symlink()
