"""A bounded cache of PLE rows in front of a sidecar reader: rows, not 4 KiB pages, held in memory.

Why: a 160 B row lives in a 4 KiB page and the hash scatters hot n-grams uniformly, so a page cache
keeps ~one useful row per page (the held-out trace in ``benchmarks/row_cache/`` touches 13.3M
distinct rows on 8.0M distinct pages: 2.0 GiB of rows, 30 GiB of pages). :class:`RowCache` keeps
rows in a buffer the caller hands in (pinned or CUDA-registered host memory, so a kernel can read
it), with a hard byte budget for rows + metadata + read buffers, and reads misses with ``O_DIRECT``
so the page cache holds nothing of the table.

``RowCache.read_rows(ids, out)`` has the readers' contract (:class:`~.reader.SidecarReader`,
:class:`~.mapped.MappedReader`): any order, duplicates, other ranks' rows zero, ids outside the
table refused before anything is written, fail-closed after an I/O error, ``working_set_bytes``,
``close``. ``prefetch(ids)`` brings rows in without copying them out (prompt-ahead prefetch calls it
from background threads; concurrent calls never read one row twice: a lookup waits for a row
another call is filling). Lookups, the policy and the reads are C (``row_cache.c``, built once per
machine): no per-row Python, no GIL held while reading, and callable from a CUDA host node
(:meth:`RowCache.host_read`).

Policy: S3-FIFO by default (``benchmarks/row_cache/README.md`` has the measurements against CLOCK,
LRU and Belady's optimum on the trace); ``policy=`` selects another for measurement.

Imports only the standard library and numpy (no engine, no torch).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import (
    SidecarChanged,
    SidecarIOError,
    SidecarReaderUnusable,
    SidecarRowOutOfRange,
    SidecarShapeMismatch,
    SidecarTruncated,
)
from .native import NativeBuildError, build_library
from .reader import PLAN_BYTES_PER_ROW, TableFiles, check_bounds, check_ids, check_out, file_sizes, refuse_in_place

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_cache.c")
LIB_NAME = "libssd_row_cache.so"
ABI = 3  # RC_ABI in row_cache.c
EXIT_CODE = 70  # RC_EXIT_CODE in row_cache.c
POLICIES = {"lru": 0, "clock": 1, "s3fifo": 2}
DEFAULT_POLICY = "s3fifo"
S3_SMALL_FRACTION = 0.10  # the small FIFO's share of the slots (S3-FIFO's 10 %)
S3_THRESHOLD = 1  # lookups while in the small FIFO that promote a row to the main one
S3_KEEP_FREQ = 0  # a promoted row's count restarts at zero in the main FIFO
S3_GHOST_FRACTION = 0.9  # each ghost generation: as many keys as the main queue holds (S3-FIFO: |G| = |M|)
DEFAULT_WAVE_PAGES = 1024  # bounce buffer per concurrent miss read: 4 MiB
MAX_READ_PAGES = 64  # coalesced run cap (256 KiB), as SidecarReader's
DEFAULT_WORKERS = 16
CONCURRENT_CALLS = 2  # the working set counts a demand lookup and one prefetch at a time
PAGE = 4096
COPY_BATCH = 16384  # rows copied per moment under the lock by RowCache.hottest (~2.6 MiB of fp8 rows)

# rc_read's flags and return codes
_F_PREFETCH, _F_NODATA = 1, 2
_FATAL, _OUT_OF_RANGE, _REFUSED = -1, -2, -3
STAT_NAMES = ("calls", "lookups", "hits", "waits", "miss_lookups", "rows_read", "pages_read", "reads", "bytes_read",
              "inserts", "evictions", "bypass", "out_of_rank", "prefetch_calls", "prefetch_rows", "prefetch_hits",
              "prefetch_evicted_unused", "ghost_hits", "parallel_passes")

# The budget (MiB for all PLE layers of a process together: rows + metadata + read buffers; 0: off) is each
# engine's knob, declared in sglang_ssd_stream/knobs.py; this floor is handed bytes.


# ----------------------------------------------------------------------------- the library


class _HostRead(ctypes.Structure):
    """``rc_host_t`` of row_cache.c (``rc_host_layout`` checks the layout)."""

    _fields_ = [("cache", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("calls", ctypes.c_int64), ("closed", ctypes.c_int32), ("what", ctypes.c_char * 128)]


class _Config(ctypes.Structure):
    """``rc_config_t`` of row_cache.c (``rc_config_layout`` checks the layout): what ``rc_create`` is told."""

    _fields_ = [*((n, ctypes.c_int64) for n in ("capacity", "row_bytes", "vocab_start", "vocab_end", "total_rows",
                                                "wave_pages", "max_read_pages")),
                ("seed", ctypes.c_uint64), ("s3_small_fraction", ctypes.c_double),
                ("s3_ghost_fraction", ctypes.c_double),
                *((n, ctypes.c_void_p) for n in ("region_row_start", "region_offset", "region_file", "file_fd",
                                                 "file_bytes")),
                *((n, ctypes.c_int32) for n in ("nregions", "nfiles", "policy", "direct", "workers", "debug_hash",
                                                "s3_threshold", "s3_keep_freq", "debug_delay_us"))]


def _regions(table, files) -> tuple[dict, list]:
    """The table's regions and files as ``rc_config_t`` fields, and the arrays that must live until ``rc_create``
    has copied them: each region's first row (and the table's end), byte, file, and each file's descriptor and
    size, as the manifest gives them."""
    sizes = file_sizes(table)
    arrays = [np.array([r.row_start for r in table.regions] + [table.row_end], np.int64),
              np.array([r.offset for r in table.regions], np.int64), np.array(files.file_of, np.int32),
              np.array(files.fds, np.int32), np.array([sizes[p] for p in files.paths], np.int64)]
    names = ("region_row_start", "region_offset", "region_file", "file_fd", "file_bytes")
    return ({**{n: a.ctypes.data for n, a in zip(names, arrays, strict=True)}, "nregions": len(table.regions),
             "nfiles": len(files.fds)}, arrays)


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32


def load() -> ctypes.CDLL:
    """The compiled ``row_cache.c`` (built on first use); refuses a library of another ABI or layout."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = build_library(SOURCE, LIB_NAME, hint="\nInstall a C compiler (Triton needs one too) or set CC; or set "
                                                      "the row cache budget to 0 to serve without it.")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise NativeBuildError(f"cannot load the row cache library {path}: {exc}") from exc
        lib.rc_abi.restype = ctypes.c_int
        lib.rc_host_layout.argtypes = [_P, ctypes.c_int]
        lib.rc_host_layout.restype = ctypes.c_int
        ours = [ctypes.sizeof(_HostRead)] + [getattr(_HostRead, n).offset for n, _ in _HostRead._fields_]
        buf = (ctypes.c_size_t * 16)()
        theirs = list(buf[:min(16, lib.rc_host_layout(buf, 16))])
        lib.rc_config_layout.argtypes = [_P, ctypes.c_int]
        lib.rc_config_layout.restype = ctypes.c_int
        ours_cfg = [ctypes.sizeof(_Config)] + [getattr(_Config, n).offset for n, _ in _Config._fields_]
        cbuf = (ctypes.c_size_t * 32)()
        theirs_cfg = list(cbuf[:min(32, lib.rc_config_layout(cbuf, 32))]) if lib.rc_abi() == ABI else []
        if lib.rc_abi() != ABI or theirs != ours or theirs_cfg != ours_cfg:
            raise NativeBuildError(f"{path}: ABI {lib.rc_abi()}, host struct {theirs}, config {theirs_cfg}; expected "
                                   f"ABI {ABI}, {ours}, {ours_cfg}; delete it to rebuild")
        lib.rc_create.argtypes = [_P, ctypes.POINTER(_Config), ctypes.c_char_p, _I64]
        lib.rc_create.restype = _P
        lib.rc_read.argtypes = [_P, _P, _I64, _P, _I32, ctypes.c_char_p, _I64]
        lib.rc_read.restype = ctypes.c_int
        lib.rc_metadata_bytes.argtypes = [_I64, _I32, ctypes.c_double]
        lib.rc_metadata_bytes.restype = _I64
        lib.rc_bounce_bytes.argtypes = [_I64]
        lib.rc_bounce_bytes.restype = _I64
        for name in ("rc_close", "rc_free"):
            getattr(lib, name).argtypes = [_P]
            getattr(lib, name).restype = None
        lib.rc_nstats.restype = ctypes.c_int
        lib.rc_stats.argtypes = [_P, _P]
        lib.rc_stats.restype = None
        lib.rc_occupancy.argtypes = [_P, ctypes.POINTER(_I64), ctypes.POINTER(_I64)]
        lib.rc_occupancy.restype = None
        lib.rc_contains.argtypes = [_P, _P, _I64, _P]
        lib.rc_contains.restype = None
        lib.rc_snapshot.argtypes = [_P, _P, _P, _P]
        lib.rc_snapshot.restype = None
        lib.rc_copy_slots.argtypes = [_P, _P, _P, _I64, _P, _P]
        lib.rc_copy_slots.restype = _I64
        lib.rc_rank.argtypes = [_P, _P, _P, _I64, _I64, _P]
        lib.rc_rank.restype = _I64
        lib.rc_age.argtypes = [_P]
        lib.rc_age.restype = None
        lib.rc_admit.argtypes = [_P, _P, _P, _P, _I64]
        lib.rc_admit.restype = _I64
        lib.rc_host_read.argtypes = [_P]
        lib.rc_host_read.restype = None
        lib.rc_test_start.argtypes = [_P, _P]
        lib.rc_test_start.restype = _P
        lib.rc_test_join.argtypes = [_P]
        lib.rc_test_join.restype = ctypes.c_int
        if lib.rc_nstats() != len(STAT_NAMES):
            raise NativeBuildError(f"{path}: {lib.rc_nstats()} statistics, expected {len(STAT_NAMES)}")
        _lib = lib
        return lib


S3_DEFAULTS = (S3_SMALL_FRACTION, S3_THRESHOLD, S3_KEEP_FREQ, S3_GHOST_FRACTION)


@dataclass(frozen=True)
class RowCacheConfig:
    """How a :class:`RowCache` behaves (the geometry comes from its reader and storage)."""

    policy: str = DEFAULT_POLICY
    direct: bool = True  # O_DIRECT misses (buffered, pages dropped, where the filesystem refuses it)
    workers: int | None = None  # concurrent miss reads; None: the reader's
    wave_pages: int = DEFAULT_WAVE_PAGES
    max_read_pages: int = MAX_READ_PAGES
    s3: tuple = S3_DEFAULTS  # (small fraction, threshold, keep freq, ghost fraction)
    seed: int | None = None  # the index hash's seed; None: random per cache
    debug_hash: int = 0  # tests: a degenerate hash
    debug_delay_us: int = 0  # tests: a slow read

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"row cache policy {self.policy!r}: expected one of {', '.join(POLICIES)}")

    def c_struct(self, **geometry) -> _Config:
        small, threshold, keep, ghost = self.s3
        return _Config(wave_pages=int(self.wave_pages), max_read_pages=int(self.max_read_pages),
                       seed=secrets.randbits(64) if self.seed is None else int(self.seed),
                       s3_small_fraction=float(small), s3_ghost_fraction=float(ghost), policy=POLICIES[self.policy],
                       debug_hash=int(self.debug_hash), s3_threshold=int(threshold), s3_keep_freq=int(keep),
                       debug_delay_us=int(self.debug_delay_us), **{k: int(v) for k, v in geometry.items()})


def metadata_bytes(capacity: int, policy: str = DEFAULT_POLICY, s3: tuple = S3_DEFAULTS) -> int:
    """Bytes of metadata the cache allocates for ``capacity`` rows (index, keys, policy state)."""
    return int(load().rc_metadata_bytes(int(capacity), POLICIES[policy], float(s3[3])))


def fixed_bytes(wave_pages: int = DEFAULT_WAVE_PAGES, max_rows: int = 0) -> int:
    """Per-call buffers the budget reserves: ``CONCURRENT_CALLS`` bounce buffers and lookup plans."""
    return CONCURRENT_CALLS * (wave_pages * PAGE + max_rows * PLAN_BYTES_PER_ROW)


def capacity_for_budget(budget_bytes: int, row_bytes: int, *, policy: str = DEFAULT_POLICY,
                        wave_pages: int = DEFAULT_WAVE_PAGES, max_rows: int = 0, s3: tuple = S3_DEFAULTS) -> int:
    """The most rows whose storage + metadata + per-call buffers fit ``budget_bytes`` (0 if none)."""
    room = int(budget_bytes) - fixed_bytes(wave_pages, max_rows)
    lo, hi = 0, max(0, room // int(row_bytes))
    while lo < hi:  # metadata grows with capacity: the largest capacity that still fits
        mid = (lo + hi + 1) // 2
        if mid * row_bytes + metadata_bytes(mid, policy, s3) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _err(buf) -> str:
    return buf.value.decode(errors="replace")


def _raise_fatal(msg: str, path: str) -> None:
    if msg.startswith("SidecarTruncated"):
        raise SidecarTruncated(msg, path=path)
    if msg.startswith("SidecarChanged"):
        raise SidecarChanged(f"PLE table {path}: {msg}. Restart the server; replace a sidecar by writing a new file "
                             f"and renaming it over the old one, never in place", path=path)
    raise SidecarIOError(msg, path=path)


# ----------------------------------------------------------------------------- the cache


class RowCache:
    """A bounded row cache over ``reader``'s table and rank range, rows stored in ``rows``.

    Args:
        reader: the sidecar reader of this rank (``SidecarReader`` or ``MappedReader``): the table,
            ``vocab_start``/``vocab_end``/``total_rows`` come from it and :meth:`close` closes it. The
            cache reads misses itself, natively, on its own descriptor of the table.
        rows: the row storage, ``uint8 [capacity, row_bytes]``, C-contiguous and writable; e.g. a
            view of CUDA-registered memory (``staging.host_memory.allocate_registered``). Size it
            with :func:`capacity_for_budget`. It must outlive the cache.
        policy: ``"s3fifo"`` (default), ``"clock"`` or ``"lru"``.
        direct: read misses with ``O_DIRECT``; where the filesystem refuses it, buffered reads whose
            pages are dropped (``POSIX_FADV_DONTNEED``) after copying, and ``self.direct`` is False.
        workers: reader threads per miss wave (the disk's queue depth).
    """

    io = "cache"

    def __init__(self, reader, rows: np.ndarray, config: RowCacheConfig | None = None):
        config = RowCacheConfig() if config is None else config
        self.config = config
        self.reader = reader
        self.table = reader.table
        self.row_bytes = rb = reader.row_bytes
        self.vocab_start, self.vocab_end, self.total_rows = reader.vocab_start, reader.vocab_end, reader.total_rows
        self.max_rows = int(getattr(reader, "max_rows", 0))
        self.workers = int(config.workers if config.workers is not None else getattr(reader, "workers",
                                                                                     DEFAULT_WORKERS))
        policy = config.policy  # checked by RowCacheConfig
        if (not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != rb
                or rows.shape[0] < 1 or not rows.flags.c_contiguous or not rows.flags.writeable):
            desc = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
            raise SidecarShapeMismatch(f"row cache storage must be a writable C-contiguous uint8 array of shape "
                                       f"(capacity >= 1, {rb}), got {desc}", actual=desc, expected=("uint8", rb))
        self.rows, self.policy, self.capacity, self._s3 = rows, policy, rows.shape[0], tuple(config.s3)
        self.wave_pages = int(config.wave_pages)
        self._lib = lib = load()
        path = str(self.table.file)
        self.direct = bool(config.direct)
        try:  # its own descriptors of every file of the table, with their sizes checked (TableFiles)
            files = TableFiles(self.table, os.O_DIRECT if self.direct else 0)
        except OSError as exc:
            if not (self.direct and exc.errno == errno.EINVAL):
                raise SidecarIOError(f"cannot open PLE table {path}: {exc.strerror or exc}", path=path) from exc
            log.warning("PLE row cache: %s refuses O_DIRECT; misses are read buffered and their pages dropped", path)
            self.direct = False
            try:
                files = TableFiles(self.table)
            except OSError as exc2:
                raise SidecarIOError(f"cannot open PLE table {path}: {exc2.strerror or exc2}", path=path) from exc2
        try:
            if not self.direct:  # buffered: no read-ahead, whose pages the drop after each read would miss
                for fd in files.fds:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            err = ctypes.create_string_buffer(512)
            regions, keep = _regions(self.table, files)
            cfg = config.c_struct(
                capacity=self.capacity, row_bytes=rb, vocab_start=self.vocab_start, vocab_end=self.vocab_end,
                total_rows=self.total_rows, direct=self.direct, workers=self.workers, **regions)
            handle = lib.rc_create(rows.ctypes.data, ctypes.byref(cfg), err, len(err))
            del keep  # copied by rc_create
            if not handle:
                raise SidecarShapeMismatch(f"PLE row cache for {path}: {_err(err)}", path=path)
        except BaseException:
            files.close()
            raise
        self._files, self._c = files, handle
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._failure: str | None = None
        self._host_nodes: list = []
        self._finalizer = weakref.finalize(self, _release, lib, handle, files, self._host_nodes)

    @classmethod
    def for_budget(cls, reader: object, budget_bytes: int, *, allocate: Callable[[int], object] | None = None,
                   config: RowCacheConfig | None = None) -> RowCache | None:
        """A cache over ``reader`` whose rows + metadata + buffers fit ``budget_bytes``, its storage from
        ``allocate(nbytes)`` (a uint8 array or tensor: e.g. ``staging.host_memory.allocate_registered``;
        default plain memory), or None when the budget holds no row (0: the cache is off)."""
        config = RowCacheConfig() if config is None else config
        cap = capacity_for_budget(budget_bytes, reader.row_bytes, policy=config.policy, wave_pages=config.wave_pages,
                                  max_rows=int(getattr(reader, "max_rows", 0)), s3=config.s3)
        if cap < 1:
            return None
        nbytes = cap * reader.row_bytes
        owner = np.zeros(nbytes, np.uint8) if allocate is None else allocate(nbytes)
        storage = (owner if isinstance(owner, np.ndarray) else owner.numpy()).reshape(cap, reader.row_bytes)
        cache = cls(reader, storage, config)
        cache._storage_owner = owner  # e.g. the registered tensor: its registration lives as long as the cache
        return cache

    # ------------------------------------------------------------------ accounting

    @property
    def metadata_bytes(self) -> int:
        return int(self._lib.rc_metadata_bytes(self.capacity, POLICIES[self.policy], float(self._s3[3])))

    @property
    def working_set_bytes(self) -> int:
        """Host memory the cache holds: row storage + metadata + per-call read buffers and plans
        (``CONCURRENT_CALLS`` at a time). The reader's own working set is not included."""
        return self.rows.nbytes + self.metadata_bytes + fixed_bytes(self.wave_pages, self.max_rows)

    @property
    def stats(self) -> dict:
        """Counters since creation (see ``STAT_NAMES``); ``hits / lookups`` is the hit rate."""
        self._enter(failed_ok=True)  # counters stay readable after a failure (they say what happened)
        try:
            buf = np.zeros(len(STAT_NAMES), np.int64)
            self._lib.rc_stats(self._c, buf.ctypes.data)
        finally:
            self._exit()
        return dict(zip(STAT_NAMES, buf.tolist(), strict=False))

    def occupancy(self) -> tuple[int, int]:
        """(rows cached and valid, rows being filled)."""
        self._enter(failed_ok=True)
        try:
            v, f = _I64(), _I64()
            self._lib.rc_occupancy(self._c, ctypes.byref(v), ctypes.byref(f))
            return v.value, f.value
        finally:
            self._exit()

    @property
    def usable(self) -> bool:
        return not self._closed and self._failure is None

    def fileno(self) -> int:
        """A copied table's descriptor (an in-place table has several: :meth:`file_stats`)."""
        self._check_usable()
        refuse_in_place(self.table, "a row cache's single descriptor")
        return self._files.fds[0]

    def file_stats(self) -> tuple[os.stat_result, ...]:
        """``fstat`` of each file of the table, as this cache reads it (the hot file's change check)."""
        self._check_usable()
        return tuple(os.fstat(fd) for fd in self._files.fds)

    # ------------------------------------------------------------------ lookups

    def _check_usable(self) -> None:
        if self._closed:
            raise SidecarReaderUnusable(f"PLE row cache for {self.table.file} is closed", path=str(self.table.file))
        if self._failure is not None:
            raise SidecarReaderUnusable(f"PLE row cache for {self.table.file} is unusable after an earlier I/O "
                                        f"failure: {self._failure}", path=str(self.table.file), cause=self._failure)

    def _enter(self, *, failed_ok: bool = False) -> None:
        with self._cond:
            if not (failed_ok and not self._closed):
                self._check_usable()
            self._inflight += 1

    def _exit(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _call(self, ids: np.ndarray, out: np.ndarray | None, flags: int) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        err = ctypes.create_string_buffer(512)
        self._enter()
        try:
            check_bounds(ids, self.table, self.total_rows)
            rc = self._lib.rc_read(self._c, ids.ctypes.data, ids.size, 0 if out is None else out.ctypes.data, flags,
                                   err, len(err))
        finally:
            self._exit()
        if rc == 0:
            return
        msg = re.sub(r"\(file (\d+)\)", lambda m: str(self._files.paths[int(m.group(1))]), _err(err))  # named
        if rc == _OUT_OF_RANGE:
            raise SidecarRowOutOfRange(msg, path=str(self.table.file))
        if rc == _FATAL:
            with self._cond:
                self._failure = self._failure or msg
            _raise_fatal(msg, str(self.table.file))
        raise SidecarReaderUnusable(f"PLE row cache for {self.table.file}: {msg}", path=str(self.table.file))

    def read_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out[i]`` with the bytes of global row ``ids[i]`` (zero for other ranks' rows).

        Raises like :meth:`SidecarReader.read_rows`: :class:`SidecarRowOutOfRange` (nothing written,
        still usable), :class:`SidecarShapeMismatch`, :class:`SidecarIOError`/:class:`SidecarTruncated`
        (then unusable), :class:`SidecarReaderUnusable`.
        """
        ids = check_ids(ids, self.table, self.total_rows)
        check_out(out, ids.shape[0], self.row_bytes)
        self._call(ids, out, 0)

    def prefetch(self, ids: np.ndarray) -> None:
        """Bring rows ``ids`` into the cache (this rank's; others are ignored); rows present or being
        filled are left alone. Blocks until they are read: run it on a background thread."""
        ids = check_ids(ids, self.table, self.total_rows)
        self._call(ids, None, _F_PREFETCH)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are cached now (no policy update)."""
        ids = np.ascontiguousarray(check_ids(ids, self.table, self.total_rows))
        res = np.zeros(ids.size, np.uint8)
        self._enter()
        try:
            self._lib.rc_contains(self._c, ids.ctypes.data, ids.size, res.ctypes.data)
        finally:
            self._exit()
        return res.astype(bool)

    # ------------------------------------------------------------------ the hot set

    def hottest(self, k: int, *, age: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (at most) ``k`` cached rows looked up most often, most first (ties: the lower id): global ids
        (int64), their bytes (uint8 ``[n, row_bytes]``) and lookup counts (uint16, saturating). Rows only
        prefetched and never looked up are not among them. ``age`` halves every count afterwards, so the next
        call ranks recent lookups first. Ranked off the cache's lock (a snapshot of keys and counts); the rows are
        copied in batches, each a moment under the lock, and a row evicted meanwhile is left out."""
        self._enter()
        try:
            # ctypes lets go of the GIL in each call: the snapshot holds the cache's lock a moment, the ranking
            # neither the lock nor the GIL, the copies the lock a moment per batch
            keys, hits, slots = _rank(self._lib, self._c, self.capacity, k, f"PLE row cache for {self.table.file}")
            want = np.ascontiguousarray(keys[slots])
            rows, ok = np.empty((slots.size, self.row_bytes), np.uint8), np.zeros(slots.size, np.uint8)
            for a in range(0, slots.size, COPY_BATCH):
                b = min(a + COPY_BATCH, slots.size)
                self._lib.rc_copy_slots(self._c, slots[a:].ctypes.data, want[a:].ctypes.data, b - a,
                                        rows[a:].ctypes.data, ok[a:].ctypes.data)
            if age:
                self._lib.rc_age(self._c)
        finally:
            self._exit()
        kept = ok.astype(bool)
        return (want[kept].astype(np.int64) + self.vocab_start, rows[kept], hits[slots][kept])

    def admit(self, ids: np.ndarray, rows: np.ndarray, counts: np.ndarray | None = None) -> int:
        """Place rows the caller has verified (a hot file checked against the sidecar) into the cache without
        reading the disk, in order, as a prefetch would place them (same policy; rows already cached and other
        ranks' rows are skipped); stops when no slot is free. Returns how many were placed."""
        ids = np.ascontiguousarray(check_ids(ids, self.table, self.total_rows))
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        check_out(rows, ids.shape[0], self.row_bytes)
        if counts is not None:
            counts = np.ascontiguousarray(counts, dtype=np.uint16)
            if counts.shape != ids.shape:
                raise ValueError(f"counts must be uint16 [{ids.shape[0]}], got {counts.shape}")
        self._enter()
        try:
            n = self._lib.rc_admit(self._c, ids.ctypes.data, rows.ctypes.data,
                                   None if counts is None else counts.ctypes.data, ids.size)
        finally:
            self._exit()
        if n < 0:
            self._check_usable()
            raise SidecarReaderUnusable(f"PLE row cache for {self.table.file} refused the rows",
                                        path=str(self.table.file))
        return int(n)

    # ------------------------------------------------------------------ CUDA host node

    def host_read(self, ids: np.ndarray, out: np.ndarray, *, what: str) -> HostRead:
        """A lookup of ``ids`` (int64, fixed address) into ``out`` (uint8 ``[n, row_bytes]``, fixed
        address) as a CUDA host function: ``cuLaunchHostFunc(stream, node.function, node.argument)``.
        No Python, no GIL at replay; a failure prints and ends the process (exit 70). The cache's
        metadata then stays allocated for the life of the process (a graph may replay any time)."""
        self._check_usable()
        node = HostRead(self, ids, out, what=what)
        self._host_nodes.append(node)
        return node

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Refuse new calls, wait for those in flight, release memory (kept when a host node
        exists) and close the reader."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                self._cond.wait()
        self._finalizer()
        self.reader.close()

    def __enter__(self) -> RowCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RowCache({self.table.file}, rows=[{self.vocab_start}, {self.vocab_end}), {self.policy}, "
                f"capacity={self.capacity} rows, direct={self.direct}, working_set={self.working_set_bytes} B)")


def _release(lib, handle, files, host_nodes) -> None:
    lib.rc_close(handle)  # waits for calls in flight (host nodes included)
    if host_nodes:
        return  # a captured graph may still replay: its node finds the cache closed and says so
    lib.rc_free(handle)
    files.close()


class HostRead:
    """One captured lookup (see :meth:`RowCache.host_read`); :meth:`run` calls it directly."""

    def __init__(self, cache: RowCache, ids: np.ndarray, out: np.ndarray, *, what: str):
        if ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous:
            raise ValueError("ids must be a contiguous 1-D int64 array")
        if out.dtype != np.uint8 or out.shape != (ids.shape[0], cache.row_bytes) or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous uint8 [{ids.shape[0]}, {cache.row_bytes}], "
                             f"got {out.dtype} {out.shape}")
        self.cache, self._keep = cache, (ids, out, cache.rows)
        self._struct = _HostRead(cache=cache._c, ids=ids.ctypes.data, out=out.ctypes.data, n=ids.shape[0], calls=0,
                                 closed=0, what=what.encode()[:127])

    @property
    def function(self) -> int:
        return ctypes.cast(self.cache._lib.rc_host_read, ctypes.c_void_p).value

    @property
    def argument(self) -> int:
        return ctypes.addressof(self._struct)

    @property
    def calls(self) -> int:
        return self._struct.calls

    def run(self) -> None:
        self.cache._lib.rc_host_read(self.argument)

    def close(self) -> None:
        """Later replays end the process with a message; memory stays (a replay may be running)."""
        self._struct.closed = 1


def captured_read(cache: RowCache, ids: np.ndarray, out: np.ndarray, *, what: str) -> HostRead:
    """``SidecarGather``'s ``host_read`` seam for a row cache: the captured read of ``ids`` into
    ``out`` as the cache's native host function (``SidecarGather(cache, ..., host_read=captured_read)``)."""
    return cache.host_read(ids, out, what=what)


def _rank(lib, handle, capacity: int, k: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A snapshot of a cache's keys and lookup counts, and the slots of its (at most) ``k`` most-looked-up rows,
    most first (ties: the lower id); rows never looked up are not among them."""
    k = max(0, int(k))
    keys, hits, valid = np.empty(capacity, np.uint32), np.empty(capacity, np.uint16), np.empty(capacity, np.uint8)
    lib.rc_snapshot(handle, keys.ctypes.data, hits.ctypes.data, valid.ctypes.data)
    slots = np.empty(k, np.int64)
    n = lib.rc_rank(keys.ctypes.data, hits.ctypes.data, valid.ctypes.data, capacity, k, slots.ctypes.data)
    if n < 0:
        raise MemoryError(f"{what}: no memory to rank its rows")
    return keys, hits, slots[:n]


# ----------------------------------------------------------------------------- simulation


class CacheSimulator:
    """The same C cache with no storage and no file: every decision and counter of a real cache of
    ``capacity`` rows, without reading or copying (benchmarks replay million-lookup traces with it;
    ``tests/sidecar/test_row_cache.py`` proves its counters equal a real cache's on the same calls)."""

    def __init__(self, capacity: int, *, total_rows: int, row_bytes: int, policy: str = DEFAULT_POLICY,
                 _s3=S3_DEFAULTS, seed: int = 0, vocab_start: int = 0, vocab_end: int | None = None,
                 _debug_hash: int = 0):
        self._lib = lib = load()
        self.capacity, self.policy, self.row_bytes = int(capacity), policy, int(row_bytes)
        err = ctypes.create_string_buffer(512)
        end = int(total_rows) if vocab_end is None else int(vocab_end)
        cfg = RowCacheConfig(policy=policy, direct=False, workers=1, s3=tuple(_s3), seed=int(seed),
                             debug_hash=int(_debug_hash)).c_struct(
            capacity=self.capacity, row_bytes=self.row_bytes, vocab_start=int(vocab_start), vocab_end=end,
            total_rows=int(total_rows), nregions=0, nfiles=0, direct=0, workers=1)
        self._c = lib.rc_create(None, ctypes.byref(cfg), err, len(err))
        if not self._c:
            raise ValueError(_err(err))
        self._vocab_start = int(vocab_start)
        self._finalizer = weakref.finalize(self, _release_sim, lib, self._c)

    def _call(self, ids, flags: int) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        err = ctypes.create_string_buffer(512)
        if self._lib.rc_read(self._c, ids.ctypes.data, ids.size, None, _F_NODATA | flags, err, len(err)) != 0:
            raise ValueError(_err(err))

    def access(self, ids: np.ndarray) -> None:
        """A demand lookup of ``ids`` (one batch, e.g. a prefill chunk's rows)."""
        self._call(ids, 0)

    def prefetch(self, ids: np.ndarray) -> None:
        self._call(ids, _F_PREFETCH)

    def hottest(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`RowCache.hottest`'s ranking (no bytes: there are none): global ids (int64) and counts."""
        keys, hits, slots = _rank(self._lib, self._c, self.capacity, k, "simulated PLE row cache")
        return keys[slots].astype(np.int64) + self._vocab_start, hits[slots]

    def admit(self, ids: np.ndarray, counts: np.ndarray | None = None) -> int:
        """:meth:`RowCache.admit` without rows (the simulator stores none): placed in order, as a prefetch would
        place them, each with ``counts`` (default 1, as ``HotRows.load`` gives). Returns how many were placed."""
        ids = np.ascontiguousarray(ids, np.int64)
        counts = np.ones(ids.size, np.uint16) if counts is None else np.ascontiguousarray(counts, np.uint16)
        if counts.shape != ids.shape:
            raise ValueError(f"counts must be uint16 [{ids.shape[0]}], got {counts.shape}")
        n = self._lib.rc_admit(self._c, ids.ctypes.data, None, counts.ctypes.data, ids.size)
        if n < 0:
            raise ValueError("simulated PLE row cache: closed")
        return int(n)

    @property
    def stats(self) -> dict:
        buf = np.zeros(len(STAT_NAMES), np.int64)
        self._lib.rc_stats(self._c, buf.ctypes.data)
        return dict(zip(STAT_NAMES, buf.tolist(), strict=False))

    def close(self) -> None:
        self._finalizer()


def _release_sim(lib, handle) -> None:
    lib.rc_close(handle)
    lib.rc_free(handle)


__all__ = ["RowCache", "RowCacheConfig", "HostRead", "captured_read", "CacheSimulator", "capacity_for_budget",
           "metadata_bytes", "fixed_bytes", "load", "POLICIES", "DEFAULT_POLICY", "STAT_NAMES"]
