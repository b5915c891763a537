"""Host memory a PLE row cache takes: the locked-memory limit (its rows are registered with CUDA) and
MemAvailable for every engine process on the host that holds one."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from ..findings import ERROR, OK, WARNING, Finding
from ..staging.host_memory import fmt_bytes

CAP_IPC_LOCK = 14
MEMLOCK_FIX = ("raise the locked-memory limit: docker run --ulimit memlock=-1, compose `ulimits: memlock: -1`, "
               "systemd LimitMEMLOCK=infinity, or `ulimit -l unlimited` in the launching shell")


@dataclass(frozen=True)
class LockedMemory:
    limit_bytes: int | None  # soft RLIMIT_MEMLOCK; None = unlimited
    cap_ipc_lock: bool  # CAP_IPC_LOCK lifts the limit


def status_fields(path: str = "/proc/self/status") -> dict[str, str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


def has_cap(status: dict[str, str], bit: int) -> bool:
    try:
        return bool(int(status.get("CapEff", "0"), 16) >> bit & 1)
    except ValueError:
        return False


def locked_memory(status: dict[str, str] | None = None) -> LockedMemory:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return LockedMemory(None if soft == resource.RLIM_INFINITY else soft,
                        has_cap(status_fields() if status is None else status, CAP_IPC_LOCK))


def check_memlock(locked: LockedMemory, need_bytes: int | None, what: str) -> Finding:
    """``need_bytes`` of ``what`` pinned against the locked-memory limit (None: not known yet)."""
    if locked.limit_bytes is None:
        return Finding(OK, "memlock", "locked-memory limit is unlimited")
    if locked.cap_ipc_lock:
        return Finding(OK, "memlock", f"limit {fmt_bytes(locked.limit_bytes)}, but CAP_IPC_LOCK lifts it")
    if need_bytes is None:
        return Finding(WARNING, "memlock", f"locked-memory limit is {fmt_bytes(locked.limit_bytes)}; the table size "
                       f"is only known when the model loads, and is checked then", MEMLOCK_FIX)
    if locked.limit_bytes < need_bytes:
        return Finding(ERROR, "memlock", f"locked-memory limit is {fmt_bytes(locked.limit_bytes)}, but {what} needs "
                       f"{fmt_bytes(need_bytes)} pinned", MEMLOCK_FIX)
    return Finding(OK, "memlock", f"limit {fmt_bytes(locked.limit_bytes)} covers {fmt_bytes(need_bytes)}")


def check_row_cache_memory(budget_bytes: int, processes: int, mem_available: int | None, *, knob: str,
                           process_kind: str) -> Finding:
    """Every ``process_kind`` on the host holds its own row cache of ``budget_bytes``."""
    procs = max(1, int(processes))
    total = budget_bytes * procs
    spread = f"{fmt_bytes(total)} for {procs} {process_kind}(es)" if procs > 1 else fmt_bytes(total)
    fix = f"lower {knob} (0 turns the cache off), or free host memory"
    if mem_available is None:
        return Finding(WARNING, "row_cache_memory", f"MemAvailable is unknown here; the row caches take {spread}",
                       fix)
    if total >= mem_available:
        return Finding(ERROR, "row_cache_memory", f"the row caches take {spread}, but MemAvailable is only "
                       f"{fmt_bytes(mem_available)}: the host would reclaim or kill processes (on a Jetson, host "
                       f"memory is also the KV cache's)", fix)
    if total * 2 > mem_available:
        return Finding(WARNING, "row_cache_memory", f"the row caches take {spread}, more than half of "
                       f"MemAvailable {fmt_bytes(mem_available)}", fix)
    return Finding(OK, "row_cache_memory", f"the row caches take {spread} of MemAvailable {fmt_bytes(mem_available)}")
