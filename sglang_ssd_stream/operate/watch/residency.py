"""Bytes held in memory that ``/proc`` does not show: a file's pages in the page cache (``mincore``; the PLE
sidecar) and the device memory of given processes (NVML, on discrete GPUs; Jetson has none)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

_libc = None


def resident_bytes(path: str | Path) -> int | None:
    """Bytes of ``path`` in the page cache (``mincore`` over a read-only mapping; nothing is read)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                return None
            resident = sum(1 for b in vec.raw if b & 1)
            return min(resident * mmap.PAGESIZE, size)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


class Nvml:
    """Device memory used by given processes, where NVML answers (discrete GPUs; Jetson has no NVML)."""

    def __init__(self):
        self.error = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
        except Exception as exc:  # noqa: BLE001 - no driver, no library, Jetson: all mean "not available"
            self._nv, self.error = None, f"NVML unavailable ({type(exc).__name__})"

    def used_bytes(self, pids: list[int]) -> int | None:
        if self._nv is None:
            return None
        total, found = 0, False
        try:
            for i in range(self._nv.nvmlDeviceGetCount()):
                handle = self._nv.nvmlDeviceGetHandleByIndex(i)
                for p in self._nv.nvmlDeviceGetComputeRunningProcesses(handle):
                    if p.pid in pids and p.usedGpuMemory:
                        total += p.usedGpuMemory
                        found = True
        except Exception as exc:  # noqa: BLE001
            self.error = f"NVML query failed ({type(exc).__name__})"
            return None
        return total if found else None
