"""Host prerequisites both engines share: the CPU budget (affinity and cgroup quota) that sizes reader
threads, the Jetson L4T release, free disk. Facts are read from injectable roots (tests use fake
``/proc``, ``/sys/fs/cgroup`` and ``/etc`` trees); judgements are :class:`~sglang_ssd_stream.findings.Finding`.

Public for the adapters' doctors (``sglang/doctor.py`` calls these; vLLM's doctor can call the same):

- :func:`cpu_budget` → :class:`CpuBudget`; :func:`thread_cap`; :func:`size_threads` (the launch sizes the
  thread knobs it is handed); :func:`thread_findings` (the doctor's verdict on knobs already set);
- :func:`tegra_release` → :class:`TegraRelease`; :func:`tegra_finding`;
- :func:`disk_finding` (free space for what will be written where).

Why the CPU quota: write-up 004 lost 2,242 s to CFS throttling with a 76-thread pool (one per core of the
machine) under a 16-CPU cgroup quota; 12 threads brought throttling to zero. Quota, not affinity, is
what throttles; the PLE readers mostly wait on page faults and reads, and write-up 003 measured 24
fetch threads on Thor's 14 cores as its best, so without a quota threads are capped at twice the CPUs.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..findings import ERROR, OK, WARNING, Finding

GIB = 1 << 30
THREADS_PER_CPU_WITHOUT_QUOTA = 2  # 003: 24 fetch threads on 14 cores was the measured optimum
QUOTA_RESERVE_FRACTION = 4  # keep a quarter of the quota for the engine's own threads: 004's 16 -> 12


# ----------------------------------------------------------------------------- CPU budget


@dataclass(frozen=True)
class CpuBudget:
    affinity: int  # CPUs this process may run on (os.sched_getaffinity)
    quota_cpus: float | None  # the cgroup's CPU quota in CPUs (cpu.max / cfs_quota_us), None: unlimited
    source: str  # where the quota came from, for messages

    @property
    def cpus(self) -> float:
        """CPUs of work per second this process can get."""
        return min(float(self.affinity), self.quota_cpus) if self.quota_cpus else float(self.affinity)

    def describe(self) -> str:
        q = f", cgroup quota {self.quota_cpus:g} CPUs ({self.source})" if self.quota_cpus else ", no cgroup CPU quota"
        return f"{self.affinity} CPUs in affinity{q}"


def meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``kB`` lines scaled); {} when it cannot be read."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_paths(proc_self: Path) -> dict[str, str]:
    """controller -> path from /proc/<pid>/cgroup ("" is the unified v2 hierarchy)."""
    out = {}
    for line in (_read(proc_self / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _ancestors(root: Path, rel: str) -> list[Path]:
    """The cgroup directory and its parents up to ``root``; a cgroup namespace shows "/" while the
    container's own cgroup is mounted at ``root``, so ``root`` itself always counts."""
    parts = [p for p in rel.split("/") if p]
    dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)]
    return [d for d in dirs if d.is_dir()] + [root]


def cgroup_quota(*, proc_self: str | Path = "/proc/self", cgroup_root: str | Path = "/sys/fs/cgroup"
                 ) -> tuple[float | None, str]:
    """The tightest CPU quota over the cgroup and its ancestors (v2 ``cpu.max``, v1 ``cpu.cfs_*``)."""
    proc_self, root = Path(proc_self), Path(cgroup_root)
    paths = _cgroup_paths(proc_self)
    best: tuple[float | None, str] = (None, "")
    candidates: list[tuple[Path, str]] = []
    if (root / "cgroup.controllers").exists():  # the unified (v2) hierarchy is mounted here
        candidates += [(d, "v2") for d in _ancestors(root, paths.get("", "/"))]
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / name).is_dir():
            candidates += [(d, "v1") for d in _ancestors(root / name, paths.get("cpu", "/"))]
            break
    for d, kind in candidates:
        quota = None
        if kind == "v2":
            text = (_read(d / "cpu.max") or "").split()
            if len(text) == 2 and text[0] != "max":
                quota = int(text[0]) / int(text[1])
        else:
            q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            if q and p and int(q) > 0:
                quota = int(q) / int(p)
        if quota is not None and (best[0] is None or quota < best[0]):
            best = (quota, str(d / ("cpu.max" if kind == "v2" else "cpu.cfs_quota_us")))
    return best


def cpu_budget(*, proc_self: str | Path = "/proc/self", cgroup_root: str | Path = "/sys/fs/cgroup",
               affinity: int | None = None) -> CpuBudget:
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota, source = cgroup_quota(proc_self=proc_self, cgroup_root=cgroup_root)
    return CpuBudget(affinity=affinity, quota_cpus=quota, source=source)


def thread_cap(budget: CpuBudget) -> tuple[int, str]:
    """(most threads a reader pool should have, why)."""
    cap = THREADS_PER_CPU_WITHOUT_QUOTA * budget.affinity
    why = (f"{budget.affinity} CPUs in affinity x {THREADS_PER_CPU_WITHOUT_QUOTA} (readers mostly wait on I/O; "
           f"write-up 003 ran 24 on 14 cores)")
    if budget.quota_cpus:
        whole = max(1, math.floor(budget.quota_cpus))
        quota_cap = whole - max(1, whole // QUOTA_RESERVE_FRACTION) if whole > 1 else 1
        if quota_cap < cap:
            cap, why = quota_cap, (f"the cgroup quota allows {budget.quota_cpus:g} CPUs; a quarter stays with the "
                                   f"engine (write-up 004: 76 threads under a 16-CPU quota were throttled for "
                                   f"2,242 s, 12 were not)")
    return cap, why


def size_threads(env: Mapping[str, str], knobs: Mapping[str, int | None], budget: CpuBudget,
                 explicit: Iterable[str] = ()) -> tuple[dict[str, str], list[str]]:
    """Thread-count variables to lower for this budget: ``({var: value}, [notes])``.

    ``knobs`` maps each thread-count variable to the engine's default when unset (None: the knob only
    applies when set). Values the operator set (``explicit``) are left alone; the doctor warns on them."""
    cap, why = thread_cap(budget)
    changes, notes = {}, []
    explicit = set(explicit)
    for var, default in knobs.items():
        raw = env.get(var)
        if var in explicit:
            continue
        try:
            current = int(raw) if raw is not None else default
        except ValueError:
            continue  # the engine refuses a malformed value with its own message
        if current is not None and current > cap:
            changes[var] = str(cap)
            notes.append(f"{var}={cap} (was {current}): {why}")
    return changes, notes


def thread_findings(values: Mapping[str, int], budget: CpuBudget) -> list[Finding]:
    """The doctor's verdict on thread counts in effect (``{variable: threads}``)."""
    cap, why = thread_cap(budget)
    out = []
    for var, n in values.items():
        if n > cap:
            out.append(Finding(WARNING, "cpu_quota", f"{var}={n} reader threads, above the {cap} that "
                               f"{budget.describe()} carries: {why}",
                               f"export {var}={cap} (serve sizes it when you leave it unset)"))
        else:
            out.append(Finding(OK, "cpu_quota", f"{var}={n} within {cap} ({budget.describe()})"))
    return out


# ----------------------------------------------------------------------------- Jetson L4T


TEGRA_RELEASE = "/etc/nv_tegra_release"
FIRST_THOR_MAJOR = 38  # JetPack 7.0 (L4T R38.2) is the first release with Thor (SM110) and CUDA 13
_TEGRA = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class TegraRelease:
    major: int
    minor: int
    patch: int | None
    line: str

    def name(self) -> str:
        return f"R{self.major}.{self.minor}" + (f".{self.patch}" if self.patch is not None else "")


def tegra_release(path: str | Path = TEGRA_RELEASE) -> TegraRelease | None:
    """The L4T release of a Jetson (None: not a Jetson, or the file is unreadable)."""
    text = _read(Path(path))
    if text is None:
        return None
    first = text.splitlines()[0] if text.strip() else ""
    m = _TEGRA.search(first)
    if not m:
        return TegraRelease(0, 0, None, first)
    return TegraRelease(int(m.group(1)), int(m.group(2)), int(m.group(3)) if m.group(3) else None, first)


def tegra_finding(release: TegraRelease | None, verified: Mapping[tuple[int, int], str], *,
                  expected: bool) -> Finding | None:
    """``verified`` maps (major, minor) to the write-up that ran it; ``expected``: the device is a Jetson."""
    if release is None:
        if not expected:
            return None
        return Finding(WARNING, "l4t", f"{TEGRA_RELEASE} is missing or unreadable, so the JetPack release is unknown",
                       "check with: cat /etc/nv_tegra_release (JetPack 7, L4T R38 or later, supports Thor)")
    ran = ", ".join(f"R{a}.{b} ({w})" for (a, b), w in sorted(verified.items()))
    if release.major == 0:
        return Finding(WARNING, "l4t", f"cannot parse {TEGRA_RELEASE}: {release.line!r}", None)
    if release.major < FIRST_THOR_MAJOR:
        return Finding(ERROR, "l4t", f"L4T {release.name()} predates JetPack 7 (R{FIRST_THOR_MAJOR}), the first "
                       f"release with Thor (SM110) and CUDA 13, which the pinned engines' torch needs",
                       f"flash JetPack 7 (the write-ups ran {ran})")
    if (release.major, release.minor) in verified:
        return Finding(OK, "l4t", f"L4T {release.name()}, as {verified[(release.major, release.minor)]}")
    return Finding(WARNING, "l4t", f"L4T {release.name()} is not a release the write-ups ran ({ran}); kernels and "
                   f"the unified-memory behaviour were measured there",
                   f"re-measure here (sglang-ssd-stream validate), or flash a release the write-ups ran: {ran}")


# ----------------------------------------------------------------------------- disk


def free_bytes(path: str | Path) -> tuple[int, str]:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing ancestor)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    return shutil.disk_usage(p).free, str(p)


def disk_finding(check: str, path: str | Path, need_bytes: int, what: str, *, refuse: bool = False) -> Finding:
    free, at = free_bytes(path)
    if free < need_bytes:
        return Finding(ERROR if refuse else WARNING, check,
                       f"{free / GIB:.1f} GiB free at {at}, {what} needs {need_bytes / GIB:.1f} GiB",
                       "free space there or choose another local NVMe directory")
    return Finding(OK, check, f"{free / GIB:.1f} GiB free at {at} ({what}: {need_bytes / GIB:.1f} GiB)")
