"""The captured sidecar read as a native host function (``native_read.c``): no GIL at replay.

:class:`NativeRead` holds one captured lookup's parameters (this rank's mapping of the table from
a :class:`~sglang_ssd_stream.sidecar.mapped.MappedReader`, the pinned ids and row slot, the row
count) in a C struct; the graph's host node is ``ssd_read_rows(&struct)``, which reads them at
every replay. The library is compiled once per machine with the system C compiler (``$CC``, else
Python's, else ``cc``; Triton compiles its launchers the same way) into
``$SGLANG_SSD_STREAM_HOME/native/<key>/``, keyed by the source, the compiler and the machine;
compiled under a file lock into a temporary name and renamed, so concurrent workers and a crash
leave either no library or a whole one.

Imports neither torch nor an engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..errors import EnvironmentProblem
from ..paths import data_dir
from ..sidecar.mapped import SLOW_ROW_S, MappedReader

SOURCE = Path(__file__).with_name("native_read.c")
LIB_NAME = "libssd_native_read.so"
ABI = 1  # SSD_ABI in native_read.c
EXIT_CODE = 70  # SSD_EXIT_CODE in native_read.c; the same as hostfunc.EXIT_CODE
CFLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-pthread")


class NativeBuildError(EnvironmentProblem):
    """The native host-node library cannot be compiled or loaded on this machine."""


class _Read(ctypes.Structure):
    """``ssd_read_t`` of native_read.c, field by field (``ssd_read_sizeof`` checks the layout)."""

    _fields_ = [
        ("rows", ctypes.c_void_p), ("local_rows", ctypes.c_int64), ("vocab_start", ctypes.c_int64),
        ("total_rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64), ("table_bytes", ctypes.c_int64),
        ("ids", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int64),
        ("inline_rows", ctypes.c_int64), ("slow_row_s", ctypes.c_double), ("fd", ctypes.c_int32),
        ("workers", ctypes.c_int32), ("closed", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("calls", ctypes.c_int64), ("threaded_rows", ctypes.c_int64), ("what", ctypes.c_char * 128),
    ]


def compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([*compiler(), *CFLAGS, platform.machine()]).encode())
    return data_dir() / "native" / key.hexdigest()[:16] / LIB_NAME


def build() -> Path:
    """Compile the library unless this machine has it already; returns its path."""
    from filelock import FileLock

    path = library_path()
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(f"cannot create {path.parent} for the native host-node library: {exc.strerror or exc} "
                               f"(set SGLANG_SSD_STREAM_HOME to a writable directory)") from exc
    with FileLock(str(path.parent / ".lock")):
        if path.is_file():
            return path  # another worker built it while we waited
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = [*compiler(), *CFLAGS, "-o", tmp, str(SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            os.unlink(tmp)
            raise NativeBuildError(_hint(f"cannot run the C compiler ({shlex.join(cmd)}): {exc}")) from exc
        if proc.returncode != 0:
            os.unlink(tmp)
            raise NativeBuildError(_hint(f"compiling the native host-node library failed ({shlex.join(cmd)}):\n"
                                         f"{proc.stderr.strip()}"))
        os.replace(tmp, path)
    return path


def _hint(msg: str) -> str:
    return (f"{msg}\nInstall a C compiler (Triton needs one too) or set CC; or run the captured reads in Python "
            f"with SGLANG_SSD_STREAM_HOST_NODE=python (they then wait for the GIL at every replay).")


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
        lib.ssd_read_sizeof.restype = ctypes.c_size_t
        if lib.ssd_abi() != ABI or lib.ssd_read_sizeof() != ctypes.sizeof(_Read):
            raise NativeBuildError(f"{path}: ABI {lib.ssd_abi()} / struct size {lib.ssd_read_sizeof()}, expected "
                                   f"{ABI} / {ctypes.sizeof(_Read)}; delete it to rebuild")
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

    def __init__(self, reader: MappedReader, ids: np.ndarray, out: np.ndarray, *, what: str,
                 slow_row_s: float = SLOW_ROW_S):
        if not isinstance(reader, MappedReader):
            raise TypeError(f"the native host node reads through a mapping (io=mmap), not {type(reader).__name__}")
        n = ids.shape[0]
        if ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous:
            raise ValueError("ids must be a contiguous 1-D int64 array")
        if out.dtype != np.uint8 or out.shape != (n, reader.row_bytes) or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous uint8 [{n}, {reader.row_bytes}], got {out.dtype} {out.shape}")
        self.lib = load()
        rows = reader.mapped_rows
        self._keep = (reader, ids, out, rows)
        self.reader = reader
        self._struct = _Read(
            rows=rows.ctypes.data, local_rows=rows.shape[0], vocab_start=reader.vocab_start,
            total_rows=reader.total_rows, row_bytes=reader.row_bytes, table_bytes=reader.table.bytes,
            ids=ids.ctypes.data, out=out.ctypes.data, n=n, inline_rows=reader.inline_rows, slow_row_s=slow_row_s,
            fd=reader.fileno(), workers=reader.workers, closed=0, what=what.encode()[:127])

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
        """Later calls end the process with a message instead of reading an unmapped table."""
        self._struct.closed = 1
