"""The captured sidecar read as a native host function (``native_read.c``): no Python at replay.

A host node must not call CUDA, and Python code cannot promise that (a garbage collection inside
it may free a CUDA tensor); it would also wait for the GIL. :class:`NativeRead` holds one captured
lookup's parameters (the reader's table: this rank's mapping from a
:class:`~sglang_ssd_stream.sidecar.mapped.MappedReader`, or the descriptor of a
:class:`~sglang_ssd_stream.sidecar.reader.SidecarReader` for ``pread``; the pinned ids and row
slot; the row count) in a C struct; the graph's host node is ``ssd_read_rows(&struct)``, which
reads them at every replay.

Lifetime: sglang's graph runner owns the graphs, not us, so a captured node is kept for the life
of the process (:func:`keep_for_graphs`): the struct, the arrays and the mapping it points to, and
its own duplicate of the table's descriptor stay valid however the reader or the gather is closed
or dropped. Closing only sets a flag, and a replay after that ends the process with a message.

Build: once per machine by the kit's one build rule (:func:`..sidecar.native.build_library`: the system C
compiler, as Triton compiles its launchers; a cache key of source, compiler, flags, machine and C
library; a file lock and an atomic rename). Loading refuses a library whose struct layout differs
from ours.

Imports neither torch nor an engine.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from ..sidecar import native
from ..sidecar.mapped import DEFAULT_INLINE_ROWS, SLOW_ROW_S, MappedReader
from ..sidecar.native import C_COMPILERS, CFLAGS, NativeBuildError, compiler  # noqa: F401 - this module's API
from ..sidecar.reader import SidecarReader, file_sizes, rank_segments

SOURCE = Path(__file__).with_name("native_read.c")
LIB_NAME = "libssd_native_read.so"
ABI = 3  # SSD_ABI in native_read.c
EXIT_CODE = 70  # SSD_EXIT_CODE in native_read.c (EX_SOFTWARE)
IO_CODES = {"mmap": 0, "pread": 1}  # SSD_IO_* in native_read.c
# A page-cache pread costs ~1 us of syscall per row, a disk read tens of us: slower than this per row
# is the disk (the mapped reader's memcpy uses SLOW_ROW_S).
SLOW_PREAD_ROW_S = 10e-6


class _Read(ctypes.Structure):
    """``ssd_read_t`` of native_read.c, field by field (``ssd_read_layout`` checks the layout)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("seg_start", "seg_rows", "seg_offset", "seg_file", "file_fd",
                                               "file_path", "file_bytes", "base_ino", "base_size", "base_mtime_ns")),
        ("nsegs", ctypes.c_int32), ("nfiles", ctypes.c_int32),
        *((name, ctypes.c_int64) for name in ("vocab_start", "vocab_end", "total_rows", "row_bytes")),
        ("ids", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int64),
        ("inline_rows", ctypes.c_int64), ("slow_row_s", ctypes.c_double),
        ("workers", ctypes.c_int32), ("closed", ctypes.c_int32), ("io", ctypes.c_int32),
        ("calls", ctypes.c_int64), ("threaded_rows", ctypes.c_int64), ("what", ctypes.c_char * 128),
    ]


HINT = ("\nInstall a C compiler (Triton needs one too) or set CC; or serve without CUDA graphs "
        "(--disable-cuda-graph): only reads captured into a graph need this library.")


def library_path() -> Path:
    """Where this machine's build lives (:func:`..sidecar.native.library_path`: keyed by the source, the
    compiler and its version, the flags, the machine and its C library)."""
    return native.library_path(SOURCE, LIB_NAME)


def build() -> Path:
    """Compile the library unless this machine has it already; returns its path."""
    return native.build_library(SOURCE, LIB_NAME, hint=HINT, what="the native host-node library")


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def load() -> ctypes.CDLL:
    """The library, built if needed; refuses one whose ABI or struct layout differs from ours."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = build()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise NativeBuildError(f"cannot load the native host-node library {path}: {exc}") from exc
        lib.ssd_abi.restype = ctypes.c_int
        lib.ssd_read_layout.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ssd_read_layout.restype = ctypes.c_int
        ours = [ctypes.sizeof(_Read)] + [getattr(_Read, name).offset for name, _ in _Read._fields_]
        buf = (ctypes.c_size_t * 64)()
        theirs = list(buf[:min(64, lib.ssd_read_layout(buf, 64))])
        if lib.ssd_abi() != ABI or theirs != ours:
            raise NativeBuildError(f"{path}: ABI {lib.ssd_abi()}, struct size and field offsets {theirs}; expected "
                                   f"ABI {ABI}, {ours}; delete it to rebuild")
        lib.ssd_read_rows.argtypes = [ctypes.c_void_p]
        lib.ssd_read_rows.restype = None
        lib.ssd_test_start.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.ssd_test_start.restype = ctypes.c_void_p
        lib.ssd_test_join.argtypes = [ctypes.c_void_p]
        lib.ssd_test_join.restype = ctypes.c_int
        _lib = lib
        return lib


class NativeRead:
    """One captured lookup: ``n`` rows of ``reader``'s table, ids from ``ids`` (int64), rows into
    ``out`` (uint8 ``[n, row_bytes]``). Both arrays must stay at their addresses (pinned staging)
    for as long as a graph may replay; this object keeps them and the reader referenced.

    ``function`` and ``argument`` are what ``cuLaunchHostFunc`` takes; :meth:`run` calls the
    function directly (without the GIL, as ctypes does)."""

    def __init__(self, reader: MappedReader | SidecarReader, ids: np.ndarray, out: np.ndarray, *, what: str,
                 slow_row_s: float | None = None, inline_rows: int | None = None):
        if isinstance(reader, MappedReader):
            io, views = "mmap", reader.mapped_views
        elif isinstance(reader, SidecarReader):
            if reader.direct:
                raise ValueError("the native host node reads single rows with pread, which O_DIRECT refuses; "
                                 "open the reader without direct")
            io, views = "pread", None
        else:
            raise TypeError(f"the native host node reads a MappedReader or a SidecarReader, "
                            f"not {type(reader).__name__}")
        n = ids.shape[0]
        if ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous:
            raise ValueError("ids must be a contiguous 1-D int64 array")
        if out.dtype != np.uint8 or out.shape != (n, reader.row_bytes) or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous uint8 [{n}, {reader.row_bytes}], got {out.dtype} {out.shape}")
        self.lib = load()
        files = reader.table_files
        # ours: closing the reader must not hand the C code a reused number
        fds = np.array([os.dup(fd) for fd in files.fds], np.int32)
        weakref.finalize(self, _close_all, fds.tolist())
        # this rank's rows segment by segment (one per region of the table), as the reader mapped or reads them
        segs = rank_segments(reader.table, reader.vocab_start, reader.vocab_end)
        sizes = file_sizes(reader.table)
        arrays = {
            "seg_start": np.array([lo for lo, _, _, _ in segs] + [segs[-1][1]], np.int64),
            "seg_rows": np.array([0 if views is None else v.ctypes.data for v in (views or [None] * len(segs))],
                                 np.uintp),
            "seg_offset": np.array([first for _, _, _, first in segs], np.int64),
            "seg_file": np.array([files.file_of[region] for _, _, region, _ in segs], np.int32),
            "file_fd": fds,
            "file_path": (ctypes.c_char_p * len(files.paths))(*(os.fsencode(p) for p in files.paths)),
            "file_bytes": np.array([sizes[p] for p in files.paths], np.int64),
            **{name: np.array([ident[k] for ident in files.identities], np.int64)
               for k, name in ((1, "base_ino"), (2, "base_size"), (3, "base_mtime_ns"))},
        }
        self._arrays = arrays  # the struct points into these
        self._keep = (ids, out, views)  # ... and these; a mapping lives as long as its views do
        self.reader, self.io = reader, io
        if slow_row_s is None:
            slow_row_s = SLOW_ROW_S if io == "mmap" else SLOW_PREAD_ROW_S
        self._struct = _Read(
            **{name: ctypes.addressof(a) if isinstance(a, ctypes.Array) else a.ctypes.data
               for name, a in arrays.items()}, nsegs=len(segs), nfiles=len(files.fds),
            vocab_start=reader.vocab_start, vocab_end=reader.vocab_end, total_rows=reader.total_rows,
            row_bytes=reader.row_bytes, ids=ids.ctypes.data, out=out.ctypes.data, n=n,
            inline_rows=inline_rows if inline_rows is not None else getattr(reader, "inline_rows", DEFAULT_INLINE_ROWS),
            slow_row_s=slow_row_s, workers=reader.workers, closed=0, io=IO_CODES[io],
            what=what.encode()[:127].decode(errors="ignore").encode())

    @property
    def function(self) -> int:
        return ctypes.cast(self.lib.ssd_read_rows, ctypes.c_void_p).value

    @property
    def argument(self) -> int:
        return ctypes.addressof(self._struct)

    @property
    def stats(self) -> dict:
        return {"calls": self._struct.calls, "threaded_rows": self._struct.threaded_rows}

    def run(self) -> None:
        self.lib.ssd_read_rows(self.argument)

    def close(self) -> None:
        """Later calls end the process with a message. Memory and descriptor stay valid (a replay
        may be running): they go when this object does, which for a captured node is never."""
        self._struct.closed = 1


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


_kept: list[NativeRead] = []
_kept_lock = threading.Lock()


def keep_for_graphs(node: NativeRead) -> NativeRead:
    """Keep ``node`` for the rest of the process: a graph that captured it may replay at any time,
    and its owner (sglang's graph runner) does not tell us when it is gone."""
    with _kept_lock:
        _kept.append(node)
    return node


def captured_read(reader: MappedReader | SidecarReader, ids: np.ndarray, out: np.ndarray, *, what: str) -> NativeRead:
    """The host node :class:`~.gather.SidecarGather` captures for the two sidecar readers: a
    :class:`NativeRead`, kept for the rest of the process (:func:`keep_for_graphs`)."""
    return keep_for_graphs(NativeRead(reader, ids, out, what=what))
