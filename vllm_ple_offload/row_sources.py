"""Where streamed PLE rows come from: the shared sidecar reader, or the sidecar file mapped.

Both read the same artifact (``ssd-stream.json`` + ``ple/layer-{L}.bin``, validated by
``sglang_ssd_stream.sidecar.format``) and share one contract: ``read(ids, out)`` fills
``out[i]`` with the bytes of global row ``ids[i]``, where ``ids`` are sorted, unique, and all
inside this rank's ``[vocab_start, vocab_end)`` (the caller zeroes the other ranks' rows and
refuses ids outside ``[0, total_rows)``).

``SidecarRows`` is the engine-neutral :class:`~sglang_ssd_stream.sidecar.reader.SidecarReader`
(``preadv`` into a fixed buffer, reads split over ``workers`` threads, fail-closed). A fetch
round covers ``workers x rows_per_task`` rows, so each worker gets about ``rows_per_task`` rows
of every round; the reader's buffer is sized for one round.

``MmapRows`` is the Thor write-up's gather: the table file mapped read-only and rows copied by a
pool of ``workers`` threads (shared by all layers) in tasks of ``rows_per_task`` rows (``numpy.take`` releases the GIL,
so page faults overlap). Pages stay in the page cache, which the kernel may reclaim; nothing is
pinned. Imports numpy and the sidecar package only.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import threading

import numpy as np

from sglang_ssd_stream.sidecar.errors import SidecarIOError, SidecarShapeMismatch
from sglang_ssd_stream.sidecar.format import SidecarTable
from sglang_ssd_stream.sidecar.reader import SidecarReader


class SidecarRows:
    kind = "sidecar"

    def __init__(self, table: SidecarTable, *, vocab_start: int, vocab_end: int, total_rows: int,
                 workers: int, rows_per_task: int):
        self.table, self.vocab_start, self.vocab_end, self.total_rows = table, vocab_start, vocab_end, total_rows
        self.reader = SidecarReader(table, vocab_start=vocab_start, vocab_end=vocab_end, total_rows=total_rows,
                                    max_rows=workers * rows_per_task, workers=workers)

    @property
    def working_set_bytes(self) -> int:
        return self.reader.working_set_bytes

    def read(self, ids: np.ndarray, out: np.ndarray) -> None:
        self.reader.read_rows(ids, out)

    def close(self) -> None:
        self.reader.close()


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per size for all mapped tables: layers gather one after another, so a pool per
    layer would only multiply idle threads."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ple-mmap")
        return pool


class MmapRows:
    kind = "mmap"

    def __init__(self, table: SidecarTable, *, vocab_start: int, vocab_end: int, total_rows: int,
                 workers: int, rows_per_task: int):
        if not (table.row_start <= vocab_start < vocab_end <= table.row_end) or total_rows < table.row_end:
            raise SidecarShapeMismatch(
                f"PLE table {table.file} covers rows [{table.row_start}, {table.row_end}), not this rank's rows "
                f"[{vocab_start}, {vocab_end})", path=str(table.file),
                actual=(table.row_start, table.row_end), expected=(vocab_start, vocab_end))
        self.table, self.vocab_start, self.vocab_end, self.total_rows = table, vocab_start, vocab_end, total_rows
        self.rows_per_task = rows_per_task
        rb = table.row_bytes
        # Map only this rank's rows (offset rounded down to a page, as mmap requires).
        first = (vocab_start - table.row_start) * rb
        self._skew = first % mmap.ALLOCATIONGRANULARITY
        length = (vocab_end - vocab_start) * rb + self._skew
        try:
            with open(table.file, "rb") as f:
                self._map = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=first - self._skew)
        except (OSError, ValueError) as exc:
            raise SidecarIOError(f"cannot map PLE table {table.file}: {exc}", path=str(table.file)) from exc
        try:
            self._map.madvise(mmap.MADV_RANDOM)  # a row is 160 B: read-ahead would only evict useful pages
        except (AttributeError, OSError):
            pass
        flat = np.frombuffer(self._map, dtype=np.uint8)
        self._rows = flat[self._skew:].reshape(vocab_end - vocab_start, rb)
        self._pool = shared_pool(workers)

    @property
    def working_set_bytes(self) -> int:
        return 0  # only page cache, which the kernel reclaims

    def _take(self, local: np.ndarray, out: np.ndarray) -> None:
        np.take(self._rows, local, axis=0, out=out, mode="clip")  # bounds checked in read(); "raise" would buffer

    def read(self, ids: np.ndarray, out: np.ndarray) -> None:
        local = np.asarray(ids, dtype=np.int64) - self.vocab_start
        n = local.shape[0]
        if n and (local[0] < 0 or local[-1] >= self._rows.shape[0]):
            raise SidecarShapeMismatch(f"row ids must lie in [{self.vocab_start}, {self.vocab_end}) and be sorted",
                                       actual=(int(ids[0]), int(ids[-1])), expected=(self.vocab_start, self.vocab_end))
        step = self.rows_per_task
        futures = [self._pool.submit(self._take, local[a:a + step], out[a:a + step]) for a in range(0, n, step)]
        concurrent.futures.wait(futures)  # never return while a task still writes into `out`
        for f in futures:
            f.result()

    def close(self) -> None:
        self._rows = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass


SOURCES = {"sidecar": SidecarRows, "mmap": MmapRows}
