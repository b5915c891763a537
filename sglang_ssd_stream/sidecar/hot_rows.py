"""A process's hot rows across restarts (issue 27): the row caches' most-looked-up rows go to the hot file
(:mod:`.hot_file`) periodically and at a clean shutdown, and come back into the caches, in one sequential read,
before the first request of the next start.

Both engines use it the same way: build one :class:`HotRows` over the process's row caches (one per PLE layer,
all of one row range), :meth:`~HotRows.load` it once, :meth:`~HotRows.start` the periodic writer. A hot file that
is missing or fails any check is ignored with one warning line (the reader's); a write that fails (disk full,
read-only data directory) is one warning line and the server goes on. Loaded rows are placed with a lookup count
of 1: they stay hot while the traffic uses them, and age out of the next files when it does not.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from ..atomic_file import remove_stale_temporaries
from ..errors import KitError
from .hot_file import changed_fields, hot_file_path, read_hot_file, write_hot_file

log = logging.getLogger(__name__)

ADMIT_BLOCK = 65536  # rows placed per admit call at load
LOCK_WAIT_S = 30.0  # a write waits this long for another one (the periodic writer) before it gives up
# A file whose rows would change by less than this part is left as it is: the next start then places at most this
# part of rows the traffic has left, and a server whose hot set holds still writes its file once, not every interval
# (a whole 1 GiB cache every 10 minutes is 144 GiB of writes a day).
REWRITE_MIN_CHANGED = 0.05


def process_role(engine: str, *, gpu: int | None, tp: int | None, pp: int | None) -> str:
    """A serving process's name among those that share its row ranges (the hot file's ``role``): the engine, its
    device (DP replicas on one host use different GPUs; None: the CPU) and its TP and PP ranks (None: unknown, as
    in a process without distributed groups). ``sidecar profile`` names the file for a process the same way."""
    parts = [engine, "cpu" if gpu is None else f"gpu{gpu}"]
    parts += [f"{name}{rank}" for name, rank in (("tp", tp), ("pp", pp)) if rank is not None]
    return "-".join(parts)


class TableChanged(Exception):
    """A table file changed under the serving process: the hot file is not written."""


class HotRows:
    """``caches``: ``{layer: RowCache}`` of one process (each over its table's rows of this rank); ``share``: the
    part of each cache the hot file may fill at start and hold (0 < share <= 1); ``interval_s``: seconds between
    writes (0: only at a clean shutdown); ``role``: this process's name among those sharing the ranges (DP
    replicas)."""

    def __init__(self, manifest, caches: dict, *, share: float, interval_s: float, role: str,
                 path: str | Path | None = None):
        if not caches:
            raise ValueError("no row cache to keep hot")
        if not 0 < share <= 1:
            raise ValueError(f"hot share {share}: expected 0 < share <= 1")
        self.manifest, self.caches, self.share = manifest, dict(caches), float(share)
        # each table's rows this process serves: tables of different sizes split differently over TP ranks
        self.row_range = {layer: (c.vocab_start, c.vocab_end) for layer, c in caches.items()}
        self.interval_s = float(interval_s)
        self.path = Path(path) if path is not None else hot_file_path(manifest, self.row_range, role)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one write at a time (the periodic one and the shutdown one)
        self._thread: threading.Thread | None = None
        self._on_sigterm = None  # our SIGTERM handler while it is set
        self._pid = os.getpid()  # a forked child must not write this process's file from its copied caches
        self.loaded_rows = 0
        self.written: int | None = None  # rows in the last file written
        self.skipped = 0  # writes left out: the file already held (nearly) those rows
        self.on_write = None  # on_write(rows, seconds) after each file written (the kit's metrics)
        # what the file holds, when known: each layer's ids (sorted), and the file itself (dev, inode, size, mtime)
        self._in_file: dict[int, np.ndarray] | None = None
        self._file_id: tuple[int, int, int, int] | None = None
        # each table file as this process's caches read it: a write records it (the next start refuses the file
        # when its table is another), and a table written while served is never written into the file
        self._tables = {layer: c.file_stats() for layer, c in caches.items()}  # every file of each table

    def _rows_per_layer(self, cache) -> int:
        return int(cache.capacity * self.share)

    def load(self) -> int:
        """Read the hot file (one sequential pass, at most the share of every cache) into the caches; returns
        the rows placed (0 when the file is missing or refused: one warning line says why)."""
        budget = sum(self._rows_per_layer(c) * (c.row_bytes + 8) for c in self.caches.values())
        self._remove_stale_temporaries()
        t0 = time.monotonic()
        file_id = self._stat()  # before the read: a file replaced meanwhile then differs from it, and is rewritten
        got = read_hot_file(self.path, self.manifest, self.row_range, budget)
        if got is None:
            return 0
        placed = 0
        in_file: dict[int, np.ndarray] | None = {} if not got.cut else None
        for layer, (ids, rows) in got.layers.items():
            cache = self.caches.get(layer)
            n = 0 if cache is None else min(ids.size, self._rows_per_layer(cache))
            if n < ids.size:
                in_file = None  # the file holds rows this process left out: the next write replaces it
            elif in_file is not None:
                in_file[layer] = np.sort(ids)
            if cache is None:
                continue  # a layer this process does not cache (it has fewer PLE layers bound)
            # coldest first: the cache's FIFO evicts the rows placed first, so the hottest go in last (measured:
            # the first request then reads what Belady's optimum from the same rows reads; docs/hot-file-measured.md);
            # in blocks, so a large share is never copied whole
            for b in range(n, 0, -ADMIT_BLOCK):
                a = max(0, b - ADMIT_BLOCK)
                placed += cache.admit(ids[a:b][::-1], rows[a:b][::-1], np.ones(b - a, np.uint16))
        seconds = time.monotonic() - t0
        self.loaded_rows = placed
        self._in_file, self._file_id = in_file, file_id
        log.info("PLE hot file %s: %d rows into %d layer(s) in %.2f s (%.0f MiB/s)%s", self.path, placed,
                 len(got.layers), seconds, got.nbytes / max(seconds, 1e-9) / 2**20,
                 "; the share left rows of it out" if got.cut else "")
        return placed

    def _remove_stale_temporaries(self) -> None:
        """A write cut short by a SIGKILL leaves its temporary file, as large as the share; the next start removes
        those whose writer is gone (a live writer's, another process given the same role, is left: its lock)."""
        removed = remove_stale_temporaries(self.path)
        if removed:
            log.info("PLE hot file %s: %d temporary file(s) of writes cut short removed", self.path, removed)

    def write(self) -> int | None:
        """The caches' hottest rows (each layer's share) to the hot file, atomically; their counts are halved,
        so the next file ranks recent lookups first. The file is left as it is when under
        :data:`REWRITE_MIN_CHANGED` of its rows would change. Returns the rows written (0: none, or the file kept),
        None when the write failed (one warning line; the old file stays)."""
        if os.getpid() != self._pid:
            return None
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            log.warning("PLE hot file %s not written: another write of it did not finish in %.0f s", self.path,
                        LOCK_WAIT_S)
            return None
        t0 = time.monotonic()
        try:
            try:
                layers = {}
                for layer, cache in self.caches.items():
                    ids, rows, _ = cache.hottest(self._rows_per_layer(cache), age=True)
                    if ids.size:
                        layers[layer] = (ids, rows)
                if not layers:
                    return 0
                self._check_tables(layers)
                kept = self._unchanged(layers)
                if kept is None:
                    self._in_file = self._file_id = None  # unknown until this write is through
                    write_hot_file(self.path, self.manifest, self.row_range, layers,
                                   table_stats={layer: self._tables[layer] for layer in layers})
                    self._in_file = {layer: np.sort(ids) for layer, (ids, _) in layers.items()}
                    self._file_id = self._stat()
            except (OSError, MemoryError, KitError, TableChanged) as exc:  # disk full, read-only, a cache closed
                failed = exc
            else:
                failed = None
                if kept is None:
                    self.written = sum(ids.size for ids, _ in layers.values())
                else:
                    self.skipped += 1
        finally:
            self._lock.release()
        # logged outside the lock: a SIGTERM write must never wait on a logging lock while holding ours
        if failed is not None:
            log.warning("PLE hot file %s not written (%s: %s); the server goes on, the next start is colder",
                        self.path, type(failed).__name__, failed)
            return None
        if kept is not None:
            log.info("PLE hot file %s kept: %d rows, %.1f %% of them changed since it was written (rewritten from "
                     "%.0f %%)", self.path, sum(ids.size for ids, _ in layers.values()), 100 * kept,
                     100 * REWRITE_MIN_CHANGED)
            return 0
        log.info("PLE hot file %s: %d rows written", self.path, self.written)
        if self.on_write is not None:
            self.on_write(self.written, time.monotonic() - t0)
        return self.written

    def _check_tables(self, layers: dict) -> None:
        """:class:`TableChanged` when a table file changed since this process opened it (its inode's size, mtime or
        ctime moved): written in place, the cache may hold rows of either content, and none may outlive this
        process; renamed over (only its ctime moves, its rows stay right), the next start refuses the file anyway."""
        for layer in layers:
            why = "; ".join(w for w in map(changed_fields, self._tables[layer], self.caches[layer].file_stats()) if w)
            if why:
                raise TableChanged(f"PLE table {self.manifest.table(layer).file} (layer {layer}) changed while it is "
                                   f"served ({why}: written in place, or replaced); its rows are not saved")

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _unchanged(self, layers: dict) -> float | None:
        """The part of rows that changed against the file (the most of any layer) when every layer's is under
        :data:`REWRITE_MIN_CHANGED` and the file is the very one this process read or wrote (not removed, replaced
        or cut meanwhile); None when the file is to be written. The set is compared, not its order: a kept file
        keeps its ranking (the next start's placement order, and what a smaller share takes first)."""
        if self._in_file is None or set(layers) != set(self._in_file):
            return None
        if self._file_id is None or self._stat() != self._file_id:
            return None
        worst = 0.0
        for layer, (ids, _) in layers.items():
            old = self._in_file[layer]
            size = max(ids.size, old.size)
            changed = size - int(np.isin(ids, old, assume_unique=True).sum())
            worst = max(worst, changed / size if size else 0.0)
            if worst >= REWRITE_MIN_CHANGED:
                return None
        return worst

    def start(self) -> None:
        """Write every ``interval_s`` (when > 0) on a daemon thread, and once more at a clean exit: ``atexit``,
        and a SIGTERM (see :meth:`_write_on_sigterm`)."""
        atexit.register(self.close)
        # a multiprocessing child (a model worker) ends with os._exit, which skips atexit; its exit runs these
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)
        self._write_on_sigterm()
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ple-hot-file", daemon=True)
            self._thread.start()

    def _write_on_sigterm(self) -> bool:
        """A process ended by SIGTERM skips ``atexit``, and a stop usually is one: systemd, ``docker stop`` and a
        ``kill`` of the server's process group each send it to every process, the engine's model workers
        included. Where SIGTERM still has its default action, a handler writes the file, then ends the process as
        the default would (killed by SIGTERM). An engine handler that is already there is kept (its shutdown
        exits through ``atexit``); only the main thread may set one. Returns whether it was set."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False

        def on_sigterm(signum, frame):
            signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends it at once
            try:
                if os.getpid() == self._pid:  # not in a child forked after start(): its caches are copies
                    self.close()
            finally:
                os.kill(os.getpid(), signum)

        self._on_sigterm = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def close(self) -> None:
        """Stop the periodic writer and write once more (a clean shutdown); idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if (self._on_sigterm is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is self._on_sigterm):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # closed: a later SIGTERM has nothing to write
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.write()
        atexit.unregister(self.close)
