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

``MmapRows`` is the Thor write-up's gather, the engine-neutral
:class:`~sglang_ssd_stream.sidecar.mapped.MappedReader`: the table file mapped read-only and rows
copied by a pool of ``workers`` threads (shared by all layers) in tasks of ``rows_per_task`` rows
(``numpy.take`` releases the GIL, so page faults overlap). Pages stay in the page cache, which the
kernel may reclaim; nothing is pinned. Imports numpy and the sidecar package only.
"""

from __future__ import annotations

import numpy as np

from sglang_ssd_stream.sidecar.errors import SidecarShapeMismatch
from sglang_ssd_stream.sidecar.format import SidecarTable
from sglang_ssd_stream.sidecar.mapped import MappedReader
from sglang_ssd_stream.sidecar.reader import SidecarReader


class SidecarRows:
    kind = "pread"

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


class MmapRows:
    kind = "mmap"

    def __init__(self, table: SidecarTable, *, vocab_start: int, vocab_end: int, total_rows: int,
                 workers: int, rows_per_task: int):
        self.table, self.vocab_start, self.vocab_end, self.total_rows = table, vocab_start, vocab_end, total_rows
        self.reader = MappedReader(table, vocab_start=vocab_start, vocab_end=vocab_end, total_rows=total_rows,
                                   max_rows=workers * rows_per_task, workers=workers, rows_per_task=rows_per_task)

    @property
    def working_set_bytes(self) -> int:
        return self.reader.working_set_bytes

    def read(self, ids: np.ndarray, out: np.ndarray) -> None:
        local = np.asarray(ids, dtype=np.int64)
        if local.size and (local[0] < self.vocab_start or local[-1] >= self.vocab_end):
            raise SidecarShapeMismatch(f"row ids must lie in [{self.vocab_start}, {self.vocab_end}) and be sorted",
                                       actual=(int(local[0]), int(local[-1])), expected=(self.vocab_start, self.vocab_end))
        self.reader.read_rows(local, out)

    def close(self) -> None:
        self.reader.close()


SOURCES = {"pread": SidecarRows, "mmap": MmapRows}
