"""PLE sidecar rows through a read-only memory map, copied by a thread pool.

``MappedReader.read_rows(ids, out)`` has the contract of
:class:`~sglang_ssd_stream.sidecar.reader.SidecarReader` (any order, duplicates, rows of other
tensor-parallel ranks zero, ids outside the table refused before anything is written) but
reads through a mapping of this rank's rows instead of ``preadv`` into a page buffer:

- *Warm* rows (in the page cache) cost a memory copy: ``numpy.take`` of 32,768 rows takes
  well under a millisecond, where one ``preadv`` per row costs microseconds of Python and,
  with many threads, GIL hand-offs.
- *Cold* rows fault in one 4 KiB page each (``MADV_RANDOM``: no read-ahead); ``numpy.take``
  releases the GIL, so ``workers`` threads keep ``workers`` page faults in flight, the same
  queue depth as the ``preadv`` reader.
- Rows are copied on the calling thread, in chunks (``PROBE_ROWS`` first, then ``inline_rows``),
  for as long as the chunks come from the page cache; the first chunk that is slow (page faults: more than
  ``SLOW_ROW_S`` per row) hands the rest to the pool. Measured on the H200 (a 2,048-token
  chunk behind a 1.9 ms layer, ``benchmarks/sidecar/ple_prefill_w*.json``): warm, one thread
  exposed 0.36 ms and 16 threads 1.8 ms (pool hand-offs fight the engine's thread for the
  GIL); cold, 16 threads took 430 ms and one thread 1,340 ms.

An in-place table (regions of several checkpoint shard files) is mapped side by side: one anonymous
reservation, each file's span mapped over its part of it (``MAP_FIXED``), so every row of the table has one
address and a lookup is one gather, as for a copied table's one file (a gather per file cost tens of µs
per lookup: a warm one-token lookup took 2-3× the copy's).

Memory: nothing is allocated per table; the mapped pages are page cache, which the kernel
reclaims. Per call a few index arrays of ``len(ids)`` entries.

Failure: the file's identity (inode, size, mtime) is checked before and after every copy, so a
table truncated (:class:`SidecarTruncated`) or rewritten in place (:class:`SidecarChanged`) while
mapped is refused and the reader stays closed for use. A *media* error while
copying cannot be turned into an exception: the kernel sends SIGBUS and the process dies
(``faulthandler`` prints where). Either way no zero row is ever returned for a row of this
rank. :class:`SidecarReader` (``io="pread"``) turns every I/O error into an exception instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import faulthandler
import math
import mmap
import os
import threading
import time
from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .errors import SidecarIOError, SidecarShapeMismatch, SidecarTruncated
from .format import SidecarTable
from .reader import (
    RegionIndex,
    TableFiles,
    check_bounds,
    check_ids,
    check_out,
    check_usable,
    rank_segments,
    refuse_in_place,
)

DEFAULT_WORKERS = 16
DEFAULT_INLINE_ROWS = 2048  # rows per inline chunk (a decode batch is one chunk)
# A page-cache row copies in ~30-60 ns, a page fault to disk takes ~20-100 us: a chunk slower than
# this per row is faulting, and the rest of the lookup goes to the pool.
SLOW_ROW_S = 1e-6
GATHER_CALL_S = 10e-6  # an in-place table's locating of each id's region, before its one gather (~5 us measured)
_MAP_FIXED = 0x10  # Linux's (x86_64 and arm64); the mmap module does not export it
PROBE_ROWS = 64  # the first inline chunk: a cold decode batch learns it is faulting after 64 rows, not all of them

_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per size for all mapped tables of a process: lookups of different layers run
    one after another, so a pool per table would only multiply idle threads."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ple-mmap")
        return pool


def drop_page_cache(path: str | os.PathLike, readers: Iterable[object] = ()) -> None:
    """Evict ``path`` from the page cache (benchmarks' cold runs): first the pages the mapped
    ``readers`` hold mapped (``MADV_DONTNEED``; fadvise cannot drop mapped pages), then the file's."""
    for r in readers:
        r = getattr(r, "reader", r)  # a wrapper holding a reader (vLLM's MmapRows, SidecarGather)
        if isinstance(r, MappedReader) and not r._closed:
            for m in r._maps:
                m.madvise(mmap.MADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    return fn


def map_side_by_side(fds: list[int], spans: dict[int, list[int]], *, row_bytes: int = 1,
                     anchors: dict[int, int] | None = None) -> tuple[mmap.mmap, np.ndarray, dict[int, int]]:
    """Map the byte spans ``{file: [start, end)}`` of ``fds`` read-only into one address range, each at a page
    boundary: ``(owner, bytes, shift)``, where byte ``b`` of file ``f`` is ``bytes[b + shift[f]]``. ``owner`` is an
    anonymous reservation (a Python mmap) with each span mapped over its part (``MAP_FIXED``): closing or freeing it
    unmaps them all, and a view of ``bytes`` keeps it alive as any mmap's view does.

    ``anchors``: a byte of each file (its first row) to place at a multiple of ``row_bytes`` where the page
    boundaries allow, skipping at most ``row_bytes / gcd(page, row_bytes)`` pages of address space (never memory):
    then the rows of every file are rows of one ``[n, row_bytes]`` array."""
    page = mmap.ALLOCATIONGRANULARITY
    layout, pos = {}, 0
    for f, (start, end) in spans.items():
        off = start - start % page
        if anchors is not None and row_bytes > 1:
            want = (off - anchors[f]) % row_bytes  # at ≡ want (mod row_bytes) puts the anchor on a row boundary
            for k in range(row_bytes // math.gcd(page, row_bytes)):
                if (pos + k * page) % row_bytes == want:
                    pos += k * page
                    break
        layout[f] = (pos, off, end - off)
        pos += -(-(end - off) // page) * page
    owner = mmap.mmap(-1, pos, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    data = np.frombuffer(owner, dtype=np.uint8)
    try:
        fn, addr = _libc_mmap(), data.ctypes.data
        for f, (at, off, length) in layout.items():
            if fn(addr + at, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fds[f], off) != addr + at:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
    except BaseException:
        del data
        owner.close()
        raise
    return owner, data, {f: at - off for f, (at, off, _) in layout.items()}


class MappedReader:
    """Reads rows of one PLE table through a read-only mapping of this rank's rows.

    Args:
        table: the table (from :func:`sglang_ssd_stream.sidecar.format.load_manifest`).
        vocab_start, vocab_end: this rank's global row range (default: the whole table).
        max_rows: the largest lookup planned at once (bounds the per-call index arrays).
        workers: copy threads = page faults in flight on a cold table.
        rows_per_task: rows one thread copies per task (default: the lookup split evenly
            over ``workers``).
        inline_rows: rows per chunk copied on the calling thread while chunks are warm (0: always
            use the pool).
        total_rows: ids must lie in ``[0, total_rows)``; default ``table.row_end``.
    """

    io = "mmap"

    def __init__(self, table: SidecarTable, *, vocab_start: int | None = None, vocab_end: int | None = None,
                 max_rows: int, workers: int = DEFAULT_WORKERS, rows_per_task: int | None = None,
                 inline_rows: int = DEFAULT_INLINE_ROWS, total_rows: int | None = None):
        self.table = table
        self.row_bytes = rb = table.row_bytes
        self.vocab_start = table.row_start if vocab_start is None else int(vocab_start)
        self.vocab_end = table.row_end if vocab_end is None else int(vocab_end)
        self.total_rows = table.row_end if total_rows is None else int(total_rows)
        self.max_rows, self.workers, self.inline_rows = int(max_rows), int(workers), int(inline_rows)
        self.rows_per_task = None if rows_per_task is None else int(rows_per_task)
        if (not (table.row_start <= self.vocab_start < self.vocab_end <= table.row_end)
                or self.total_rows < table.row_end):
            raise SidecarShapeMismatch(
                f"PLE table {table.file} covers rows [{table.row_start}, {table.row_end}), not this rank's rows "
                f"[{self.vocab_start}, {self.vocab_end}) of {self.total_rows}", path=str(table.file),
                actual=(table.row_start, table.row_end), expected=(self.vocab_start, self.vocab_end))
        if self.max_rows < 1 or self.workers < 1 or self.inline_rows < 0 or (self.rows_per_task or 1) < 1:
            raise SidecarShapeMismatch(
                f"max_rows ({self.max_rows}), workers ({self.workers}) and rows_per_task ({self.rows_per_task}) "
                f"must be at least 1", path=str(table.file), actual=(self.max_rows, self.workers), expected=">= 1")
        try:
            self._files = files = TableFiles(table)
        except OSError as exc:
            raise SidecarIOError(f"cannot open PLE table {table.file}: {exc.strerror or exc}",
                                 path=str(table.file)) from exc
        self._fd = files.fds[0]
        self._maps: list[mmap.mmap] = []
        try:
            self._identity = files.identities[0]
            # One mapping per file, over the bytes of this rank's rows there (a copied table: this rank's rows);
            # each segment of rank_segments a [rows, row_bytes] view into it
            segs = rank_segments(table, self.vocab_start, self.vocab_end)
            spans: dict[int, list[int]] = {}
            for lo, hi, region, first in segs:
                span = spans.setdefault(files.file_of[region], [first, first])
                span[0], span[1] = min(span[0], first), max(span[1], first + (hi - lo) * rb)
            try:
                if len(spans) == 1:  # a copied table, or an in-place one in one shard file
                    ((f, (start, end)),) = spans.items()
                    off = start - start % mmap.ALLOCATIONGRANULARITY
                    m = mmap.mmap(files.fds[f], end - off, access=mmap.ACCESS_READ, offset=off)
                    data, shift = np.frombuffer(m, dtype=np.uint8), {f: -off}
                else:  # an in-place table over several shard files: one address range, one gather
                    anchors = {}
                    for _lo, _hi, region, first in segs:
                        anchors.setdefault(files.file_of[region], first)
                    m, data, shift = map_side_by_side(files.fds, spans, row_bytes=rb, anchors=anchors)
            except (OSError, ValueError) as exc:
                raise SidecarIOError(f"cannot map PLE table {table.file} ({len(spans)} file(s)): {exc}",
                                     path=str(table.file)) from exc
            self._maps.append(m)
            try:
                m.madvise(mmap.MADV_RANDOM)  # a row is 160 B: read-ahead would only evict useful pages
            except (AttributeError, OSError):
                pass
            self._views = [data[first + shift[files.file_of[region]]:][:(hi - lo) * rb].reshape(hi - lo, rb)
                           for lo, hi, region, first in segs]
            self._rows = self._views[0] if len(self._views) == 1 else None
            if self._rows is None:  # an in-place table: each row gathered at its byte in the one mapping
                self._regions = RegionIndex(table)
                self._region_shift = np.array([shift.get(f, 0) for f in files.file_of], np.int64)
                # Where every row of this rank lies at one residue modulo row_bytes (map_side_by_side places each
                # file so where the page boundaries allow: a byte's residue modulo the page's gcd with row_bytes is
                # its own), the rows are one [n, row_bytes] array and numpy.take gathers them, the copied table's own
                # gather. Else one gather from a window at any byte ([bytes - row_bytes + 1, row_bytes], strides
                # (1, 1), nothing copied; 2.7x numpy.take's time for 1K rows, still one call for all files),
                # gathered as uint8 bytes: numpy releases the GIL only past 500 elements, so a pool task's few rows
                # gathered as 160-B items would hold it through their page faults (serialized: 12x slower cold)
                residues = np.unique((np.array([r.offset for r in table.regions], np.int64)
                                      + self._region_shift)[[seg[2] for seg in segs]] % rb)
                if residues.size == 1:
                    c = int(residues[0])
                    self._rows_at = (c, data[c:c + (data.size - c) // rb * rb].reshape(-1, rb))
                else:
                    self._rows_at = None
                    self._window = as_strided(data, shape=(data.size - rb + 1, rb), strides=(1, 1),
                                              writeable=False)
        except BaseException:
            self._views = self._rows = None
            for m in self._maps:
                m.close()
            files.close()
            raise
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)  # a media error under the mapping is a SIGBUS: say where
        # an in-place table locates each id's region first: fixed numpy calls a warm probe must not take for page
        # faults (per-file calls once sent warm 1,024-row lookups to the pool, 9x slower than the copy's)
        self._gather_s = 0.0 if self._rows is not None else GATHER_CALL_S
        self._pool = shared_pool(self.workers) if self.workers > 1 else None
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = False
        self._stats = {"calls": 0, "rows": 0, "rows_in_range": 0, "inline_rows": 0, "tasks": 0}

    # ------------------------------------------------------------------ public

    @property
    def working_set_bytes(self) -> int:
        """Per-call index arrays of a ``max_rows`` lookup; the mapped pages are reclaimable page cache."""
        return self.max_rows * 17

    @property
    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def usable(self) -> bool:
        return not self._closed and self._failure is None

    @property
    def mapped_views(self) -> list[np.ndarray]:
        """This rank's rows, one read-only ``[rows, row_bytes]`` view per segment of
        :func:`~.reader.rank_segments` (the native host node copies from them; holding one keeps its mapping)."""
        self._check_usable()
        return list(self._views)

    @property
    def table_files(self) -> TableFiles:
        """The table's files as this reader opened them (descriptors, identities; the native read copies them)."""
        self._check_usable()
        return self._files

    @property
    def identity(self) -> tuple[int, ...]:
        """(st_dev, st_ino, st_size, st_mtime_ns) of the table when it was opened (:func:`~.reader.file_identity`)."""
        return self._identity

    def fileno(self) -> int:
        self._check_usable()
        refuse_in_place(self.table, "a reader's single descriptor (the native read, `sidecar profile`)")
        return self._fd

    def read_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out[i]`` with the bytes of global row ``ids[i]`` (zero for other ranks' rows).

        Raises like :meth:`SidecarReader.read_rows`; a table that shrank or was written since it was
        opened raises :class:`SidecarTruncated` / :class:`SidecarChanged` and makes the reader unusable.
        """
        ids = check_ids(ids, self.table, self.total_rows)
        n = ids.shape[0]
        check_out(out, n, self.row_bytes)
        with self._lock:
            self._check_usable()
            check_bounds(ids, self.table, self.total_rows)
            try:
                self._files.check_unchanged()
            except (SidecarIOError, SidecarTruncated) as exc:
                self._failure = exc.message
                raise
            self._stats["calls"] += 1
            self._stats["rows"] += n
            if n == 0:
                return
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            any_outside = bool(outside.any())
            if any_outside:  # copied from a row of this rank, then zeroed below
                ids = np.clip(ids, self.vocab_start, self.vocab_end - 1)
            self._stats["rows_in_range"] += n - int(outside.sum()) if any_outside else n
            self._copy(ids, out)
            try:
                self._files.check_unchanged()  # a write during the copy: not served
            except (SidecarIOError, SidecarTruncated) as exc:
                self._failure = exc.message
                raise
            if any_outside:
                out[outside] = 0

    def close(self) -> None:
        """Release the mapping and the file; later reads raise :class:`SidecarReaderUnusable`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._rows = self._views = None
            for m in self._maps:
                try:
                    m.close()
                except BufferError:  # a caller still holds a view of the mapping; it goes with that view
                    pass
            self._files.close()

    def __enter__(self) -> MappedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"MappedReader({self.table.file}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"row_bytes={self.row_bytes}, workers={self.workers})")

    # ------------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        check_usable(self.table, self._closed, self._failure)

    def _take(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` (global, of this rank) into ``out``, view by view; bounds already checked ("raise" would
        buffer)."""
        if self._rows is not None:
            np.take(self._rows, ids - self.vocab_start, axis=0, out=out, mode="clip")
            return
        region, offsets = self._regions.locate(ids)
        offsets += self._region_shift[region]
        if self._rows_at is not None:
            c, rows = self._rows_at
            np.take(rows, (offsets - c) // self.row_bytes, axis=0, out=out, mode="clip")
        else:
            out[...] = self._window[offsets]  # never np.take: it copies a strided window whole first

    def _copy(self, local: np.ndarray, out: np.ndarray) -> None:
        n, a = local.shape[0], 0
        if self._pool is None:
            self._stats["inline_rows"] += n
            self._take(local, out)
            return
        while a < n and self.inline_rows:
            b = min(n, a + (min(self.inline_rows, PROBE_ROWS) if a == 0 else self.inline_rows))
            t = time.perf_counter()
            self._take(local[a:b], out[a:b])
            slow = time.perf_counter() - t > (b - a) * SLOW_ROW_S + self._gather_s
            self._stats["inline_rows"] += b - a
            a = b
            if slow:
                break  # faulting: the rest goes to the pool, so faults overlap
        if a == n:
            return
        rest = n - a
        step = self.rows_per_task or -(-rest // self.workers)
        futures = [self._pool.submit(self._take, local[i:i + step], out[i:i + step]) for i in range(a, n, step)]
        self._stats["tasks"] += len(futures)
        concurrent.futures.wait(futures)  # never return while a task still writes into `out`
        for f in futures:
            f.result()
