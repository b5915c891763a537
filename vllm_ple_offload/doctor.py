"""``vllm-ple-offload doctor``: the checks of the PLE backends; each finding names its fix. Facts are injectable.

Run by the doctor command and by the plugin in every vLLM process it activates in (the same
checks, so the doctor checks what the plugin will run). Findings and the exit-code rule are the
kit's (:mod:`sglang_ssd_stream.findings`).

- UVA: the ``pinned`` backend reads host memory from GPU kernels, so it needs vLLM's CUDA
  platform with pinned memory (WSL and CPU platforms have none).
- ``ulimit -l``: the deployment write-up ran its 51 GiB pinned table with memlock unlimited; a
  finite limit below the bytes to pin is refused unless the process has CAP_IPC_LOCK.
- ptrace: with ``expandable_segments:True`` PyTorch shares CUDA memory between processes by
  importing a file descriptor from the sibling (``pidfd_getfd``), which needs ptrace permission:
  the write-up's ``pidfd_getfd: Operation not permitted``. The fix is one capability,
  ``--cap-add SYS_PTRACE``, never ``--privileged``.
- expandable segments: vLLM 0.33's PLE offload needs no CUDA IPC, so the setting only adds that
  fd import; the write-up removed it.
- Sidecar disk: rows are random 4 KiB reads; network filesystems and spinning disks are
  warned about (the sidecar module refuses nothing for speed alone).
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from sglang_ssd_stream.findings import ERROR, OK, WARNING, Finding, errors_of, refusal_text

from . import env
from .errors import PreflightFailed

CAP_IPC_LOCK, CAP_SYS_PTRACE = 14, 19
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads both
MEMLOCK_FIX = ("raise the locked-memory limit: docker run --ulimit memlock=-1, compose `ulimits: memlock: -1`, "
               "systemd LimitMEMLOCK=infinity, or `ulimit -l unlimited` in the launching shell")


@dataclass(frozen=True)
class DiskFacts:
    path: str
    fstype: str | None
    kind: str  # "nvme" | "ssd" | "hdd" | "network" | "memory" | "unknown"


@dataclass(frozen=True)
class Facts:
    uva: bool  # vLLM's platform is CUDA-alike with pinned memory
    platform: str
    memlock_bytes: int | None  # soft RLIMIT_MEMLOCK; None = unlimited
    cap_ipc_lock: bool
    cap_sys_ptrace: bool
    yama_ptrace_scope: int | None  # None: no Yama LSM
    seccomp_filter: bool  # a seccomp filter is active (docker's default profile blocks pidfd_getfd)
    alloc_conf: dict = field(default_factory=dict)  # variable -> value, for those set
    disks: tuple[DiskFacts, ...] = ()

    @property
    def expandable_segments(self) -> bool:
        for value in self.alloc_conf.values():
            for item in value.split(","):
                key, _, val = item.partition(":")
                if key.strip() == "expandable_segments" and val.strip().lower() == "true":
                    return True
        return False

    @property
    def ptrace_permitted(self) -> bool:
        return self.cap_sys_ptrace or (self.yama_ptrace_scope in (None, 0) and not self.seccomp_filter)


# ----------------------------------------------------------------------------- facts


def _status_fields(path: str = "/proc/self/status") -> dict[str, str]:
    try:
        with open(path) as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _has_cap(status: Mapping[str, str], bit: int) -> bool:
    try:
        return bool(int(status.get("CapEff", "0"), 16) >> bit & 1)
    except ValueError:
        return False


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def sidecar_disks(settings: env.PleSettings) -> tuple[DiskFacts, ...]:
    """Load the sidecar manifest (refusing a bad one) and classify the disks of its tables."""
    from sglang_ssd_stream.sidecar.format import load_manifest
    from sglang_ssd_stream.sidecar.storage import classify_disk

    manifest = load_manifest(settings.sidecar)
    disks = [classify_disk(table.file) for table in manifest.tables]
    return tuple(DiskFacts(d.path, d.fstype, d.kind) for d in disks)


def _platform() -> tuple[bool, str]:
    from vllm.platforms import current_platform

    uva = current_platform.is_cuda_alike() and current_platform.is_pin_memory_available()
    return uva, type(current_platform).__name__


def gather_facts(settings: env.PleSettings | None, environ: Mapping[str, str] | None = None) -> Facts:
    """The facts of this process and machine (imports ``vllm.platforms``)."""
    environ = os.environ if environ is None else environ
    status = _status_fields()
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    uva, platform = _platform()
    return Facts(
        uva=uva,
        platform=platform,
        memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
        cap_ipc_lock=_has_cap(status, CAP_IPC_LOCK),
        cap_sys_ptrace=_has_cap(status, CAP_SYS_PTRACE),
        yama_ptrace_scope=_read_int("/proc/sys/kernel/yama/ptrace_scope"),
        seccomp_filter=status.get("Seccomp", "0").strip() == "2",
        alloc_conf={k: environ[k] for k in ALLOC_CONF_VARS if k in environ},
        disks=sidecar_disks(settings) if settings is not None and settings.streaming else (),
    )


# ----------------------------------------------------------------------------- checks


def check_memlock(facts: Facts, need_bytes: int | None, what: str) -> Finding:
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    if facts.memlock_bytes is None:
        return Finding(OK, "memlock", "locked-memory limit is unlimited")
    if facts.cap_ipc_lock:
        return Finding(OK, "memlock", f"limit {fmt_bytes(facts.memlock_bytes)}, but CAP_IPC_LOCK lifts it")
    if need_bytes is None:
        return Finding(WARNING, "memlock", f"locked-memory limit is {fmt_bytes(facts.memlock_bytes)}; the table size "
                       f"is only known when the model loads, and is checked then", MEMLOCK_FIX)
    if facts.memlock_bytes < need_bytes:
        return Finding(ERROR, "memlock", f"locked-memory limit is {fmt_bytes(facts.memlock_bytes)}, but {what} needs "
                       f"{fmt_bytes(need_bytes)} pinned", MEMLOCK_FIX)
    return Finding(OK, "memlock", f"limit {fmt_bytes(facts.memlock_bytes)} covers {fmt_bytes(need_bytes)}")


def run_checks(settings: env.PleSettings, facts: Facts, *, need_bytes: int | None = None) -> list[Finding]:
    findings: list[Finding] = []
    if facts.uva:
        findings.append(Finding(OK, "uva", f"{facts.platform}: pinned host memory and UVA available"))
    elif settings.streaming:
        findings.append(Finding(WARNING, "uva", f"{facts.platform} has no CUDA pinned memory: staging is ordinary "
                                f"memory and H2D is a host copy (a test mode, not a way to serve)",
                                "run on a CUDA GPU"))
    else:
        findings.append(Finding(ERROR, "uva", f"{env.BACKEND}=pinned reads the table from GPU kernels through UVA, "
                                f"but vLLM's platform is {facts.platform} without CUDA pinned memory",
                                f"run on a CUDA GPU (not WSL1, not a CPU platform), or use {env.BACKEND}=pread"))
    if settings.backend == env.PINNED:
        findings.append(check_memlock(facts, need_bytes, "the PLE table"))
    if facts.expandable_segments:
        conf = ", ".join(f"{k}={v}" for k, v in facts.alloc_conf.items())
        if facts.ptrace_permitted:
            findings.append(Finding(WARNING, "expandable_segments", f"{conf}: CUDA memory shared between processes "
                                    f"is then imported with pidfd_getfd; ptrace is permitted here, so it works, but "
                                    f"vLLM's PLE offload needs no such sharing", "remove expandable_segments:True"))
        else:
            why = ("CAP_SYS_PTRACE is missing and " + ("a seccomp filter is active" if facts.seccomp_filter else
                   f"Yama ptrace_scope is {facts.yama_ptrace_scope}"))
            findings.append(Finding(ERROR, "ptrace", f"{conf} makes PyTorch import CUDA memory from sibling processes "
                                    f"with pidfd_getfd, which needs ptrace permission ({why}): workers fail with "
                                    f"'pidfd_getfd: Operation not permitted'",
                                    "remove expandable_segments:True from the allocator config, or grant only "
                                    "--cap-add SYS_PTRACE (compose `cap_add: [SYS_PTRACE]`); never --privileged"))
    else:
        findings.append(Finding(OK, "expandable_segments", "not set: no cross-process fd import, ptrace not needed"))
    for disk in facts.disks:
        if disk.kind == "network":
            findings.append(Finding(WARNING, "sidecar_disk", f"{disk.path} is on a network filesystem ({disk.fstype}); "
                                    f"random 4 KiB row reads will be slow", "copy the artifact to a local NVMe disk"))
        elif disk.kind == "hdd":
            findings.append(Finding(WARNING, "sidecar_disk", f"{disk.path} is on a rotational disk",
                                    "copy the artifact to a local NVMe disk"))
        else:
            findings.append(Finding(OK, "sidecar_disk", f"{disk.path}: {disk.kind} ({disk.fstype})"))
    return findings


def raise_on_errors(findings: list[Finding]) -> None:
    refusal = refusal_text(findings, "PLE preflight failed:")
    if refusal:
        raise PreflightFailed(refusal)


def require_memlock(need_bytes: int, *, what: str, facts: Facts | None = None) -> None:
    """At allocation time, when the bytes are known: refuse a too-low memlock limit."""
    if facts is None:
        status = _status_fields()
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        facts = Facts(uva=True, platform="", memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
                      cap_ipc_lock=_has_cap(status, CAP_IPC_LOCK), cap_sys_ptrace=False, yama_ptrace_scope=None,
                      seccomp_filter=False)
    raise_on_errors([check_memlock(facts, need_bytes, what)])


def facts_json(facts: Facts) -> dict:
    return {**asdict(facts), "expandable_segments": facts.expandable_segments, "ptrace_permitted": facts.ptrace_permitted}


def preflight(*, profile: str, model: str, draft: str | None, env: Mapping[str, str],
              argv=()) -> list[Finding]:
    """``serve``'s seam (``side.preflight``): the vLLM source verdict and, when the launch environment
    turns the plugin on, the same checks the plugin runs at start-up."""
    from sglang_ssd_stream.patching.guard import verdict

    from . import env as ple_env
    from .errors import PleSettingsError

    try:
        settings = ple_env.read_settings(env)
    except PleSettingsError as exc:
        return [Finding(ERROR, "settings", exc.message, "fix the VLLM_PLE_* variables (README: vLLM)")]
    source = verdict("vllm")
    findings = source.findings(allow_unpatched=bool(settings and settings.allow_unpatched))
    if source.state == "error":
        return findings  # no vLLM to check against in this runtime
    if settings is None:
        return findings + [Finding(OK, "ple_offload", f"{ple_env.CPU_OFFLOAD} is off: vLLM keeps its own PLE path")]
    return findings + run_checks(settings, gather_facts(settings, env))

