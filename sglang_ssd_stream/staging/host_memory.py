"""Page-aligned host memory registered with CUDA, and the accounting the startup log prints.

PyTorch's pinned allocator (``pin_memory=True``) is a caching allocator that rounds every block
up to a power of two, so a 47.7 GiB PLE shard can pin 64 GiB (vLLM says so itself in
``models/deepseek_v41/common/engram.py``). Here the table is an anonymous ``mmap`` of exactly the
bytes needed (rounded to a page) and ``cudaHostRegister`` pins it; registered memory is pinned
memory to CUDA, so vLLM's UVA view (``get_accelerator_view_from_cpu_tensor``) works unchanged.
This mirrors vLLM's own ``_allocate_huge_page_storage``, except that a failure is fatal instead
of falling back to the rounding allocator.

On an integrated GPU (Jetson Thor) host and device share one memory and vLLM sizes the KV cache
from ``psutil`` available memory, so every pinned byte is a byte of KV cache lost; the log says so.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import EnvironmentProblem
from . import LOGGER_NAME

if TYPE_CHECKING:
    import torch  # at run time only inside the functions that need it (the floor imports without torch)

log = logging.getLogger(LOGGER_NAME)


class HostMemoryError(EnvironmentProblem, RuntimeError):
    """Host memory for a PLE table or staging could not be allocated or registered with CUDA."""


PAGE_SIZE = mmap.PAGESIZE
GIB = 1 << 30


def page_round(nbytes: int) -> int:
    return -(-int(nbytes) // PAGE_SIZE) * PAGE_SIZE


def caching_allocator_bytes(nbytes: int) -> int:
    """What ``torch.empty(..., pin_memory=True)`` reserves for ``nbytes``: the next power of two."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class CudaHost:
    """The three CUDA calls this module needs; tests substitute a fake (no GPU on CI)."""

    def register(self, pointer: int, nbytes: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0).value)

    def unregister(self, pointer: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostUnregister(pointer).value)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())


def _unregister(cuda: CudaHost, mapping: mmap.mmap, pointer: int) -> None:
    # Runs when the last tensor view dies; the mapping must outlive the registration.
    code = cuda.unregister(pointer)
    if code:
        log.warning("cudaHostUnregister(%#x) failed with CUDA error %d", pointer, code)


def allocate_registered(nbytes: int, *, label: str, cuda: CudaHost | None = None) -> torch.Tensor:
    """A ``torch.uint8`` tensor of ``nbytes`` bytes in page-aligned, CUDA-registered host memory.

    Raises:
        HostMemoryError: the mapping or the registration failed (the message names the usual
            cause, a too-low ``memlock`` limit).
    """
    import numpy as np
    import torch

    cuda = cuda or CudaHost()
    nbytes = int(nbytes)
    mapped = max(page_round(nbytes), PAGE_SIZE)
    try:
        mapping = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise HostMemoryError(f"{label}: cannot map {fmt_bytes(mapped)} of host memory: {exc}") from None
    owner = np.frombuffer(mapping, dtype=np.uint8)
    tensor = torch.from_numpy(owner)  # keeps `owner` (and so the mapping) alive
    pointer = tensor.data_ptr()
    code = cuda.register(pointer, mapped)
    if code:
        del tensor, owner
        mapping.close()
        raise HostMemoryError(
            f"{label}: cudaHostRegister of {fmt_bytes(mapped)} failed with CUDA error {code}; the usual "
            f"cause is the locked-memory limit (`ulimit -l`; docker: --ulimit memlock=-1, compose: "
            f"ulimits: memlock: -1, systemd: LimitMEMLOCK=infinity) or too little free RAM")
    finalizer = weakref.finalize(owner, _unregister, cuda, mapping, pointer)
    finalizer.atexit = False  # at interpreter exit the driver releases everything anyway
    if not cuda.is_pinned(tensor):
        raise HostMemoryError(f"{label}: CUDA registered {fmt_bytes(mapped)} but does not report it as pinned; "
                              f"vLLM's UVA lookup would make a private pinned copy")
    return tensor[:nbytes]


def fmt_bytes(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


@dataclass
class HostAccount:
    """Host memory this process pinned for PLE, for the startup log."""

    tables: int = 0
    table_bytes: int = 0
    staging_bytes: int = 0
    rounding_would_add: int = 0  # what pin_memory=True would have added on top of table_bytes
    cache_bytes: int = 0  # PLE row caches: rows (registered) + their metadata and read buffers

    @property
    def total(self) -> int:
        return self.table_bytes + self.staging_bytes + self.cache_bytes


_account = HostAccount()
_account_lock = threading.Lock()


def account(*, table_bytes: int = 0, staging_bytes: int = 0, cache_bytes: int = 0) -> HostAccount:
    """Add an allocation to the process-wide account; returns a snapshot."""
    with _account_lock:
        if table_bytes:
            _account.tables += 1
            _account.table_bytes += table_bytes
            _account.rounding_would_add += caching_allocator_bytes(table_bytes) - table_bytes
        _account.staging_bytes += staging_bytes
        _account.cache_bytes += cache_bytes
        return HostAccount(**vars(_account))


def startup_line(label: str, nbytes: int, kind: str, snapshot: HostAccount, integrated: bool) -> str:
    """One log line per allocation: its size, the running total, and the KV cost on unified memory."""
    cache = f", row cache {fmt_bytes(snapshot.cache_bytes)}" if snapshot.cache_bytes else ""
    line = (f"PLE {label}: {fmt_bytes(nbytes)} of {kind}; this process now pins {fmt_bytes(snapshot.total)} "
            f"for PLE ({snapshot.tables} table(s) {fmt_bytes(snapshot.table_bytes)}, staging "
            f"{fmt_bytes(snapshot.staging_bytes)}{cache})")
    if snapshot.rounding_would_add:
        line += f"; PyTorch's pinned allocator would have added {fmt_bytes(snapshot.rounding_would_add)} of rounding"
    if integrated:
        line += (f". Integrated GPU (unified memory): vLLM sizes the KV cache from available host memory, so this "
                 f"costs {fmt_bytes(snapshot.total)} of KV-cache budget")
    return line
