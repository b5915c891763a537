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
- Sidecar: a manifest that does not load, or a table of the wrong size, is a refusal (a finding,
  like every other, so the doctor's exit code stays the kit's rule). The tables' SHA-256 is checked
  once per process by the plugin before the embedding is built (:func:`verify_sidecar_once`, the
  shared verifier and its verified cache, which the plugin records), and by ``doctor``, which reads that
  cache and writes nothing; ``VLLM_PLE_NO_VERIFY=1`` skips it and is reported as a warning.
- Fetch round: ``VLLM_PLE_FETCH_WORKERS x VLLM_PLE_ROWS_PER_TASK x`` row bytes sizes the ``pread``
  buffer of every table; above :data:`~.env.MAX_FETCH_ROUND_BYTES` it is refused naming the knob.
- Row cache (streamed backends, ``VLLM_PLE_ROW_CACHE_MB``, per worker process): on CUDA its rows
  are registered host memory, so the budget is checked against ``ulimit -l`` like a pinned table;
  and the budget of every worker process on the host (TP x PP x local DP ranks, from the serve
  flags when given) against ``MemAvailable``: refused at or above it, a warning above half of it
  (on a Jetson, host memory is also the KV cache's).
- Graph mode (``serve`` and ``doctor -- <vllm flags>``): streamed backends outside
  :data:`~.env.FULL_GRAPH_BACKENDS` (``pread``) refuse FULL CUDA graphs (:func:`full_graph_refusal`,
  the rule the embedding applies at model build); the mode is read from the launch flags with vLLM's
  own parser.
- Host (shared with SGLang, ``checks/host.py``): the streamed backends' fetch pool against the CPU
  affinity and cgroup quota (write-up 004 lost 2,242 s to throttling with 76 threads under a 16-CPU
  quota), and on a Jetson the L4T release against the one write-up 003 ran.
- ``VLLM_PLUGINS``: an allowlist that leaves out ``ple_offload`` while ``VLLM_PLE_*`` is set means
  vLLM never runs the plugin, which then cannot refuse anything itself: refused here.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sglang_ssd_stream.checks.host import cpu_budget, tegra_finding, tegra_release, thread_findings
from sglang_ssd_stream.checks.memory import CAP_IPC_LOCK, LockedMemory, check_row_cache_memory
from sglang_ssd_stream.checks.memory import check_memlock as _check_memlock
from sglang_ssd_stream.checks.memory import has_cap as _has_cap
from sglang_ssd_stream.checks.memory import status_fields as _status_fields
from sglang_ssd_stream.errors import EnvironmentProblem, KitError
from sglang_ssd_stream.findings import ERROR, OK, WARNING, Finding

from . import env
from .errors import PleSettingsError
from .runtime_checks import (  # noqa: F401 - the doctor's API too
    FULL_GRAPH_MESSAGE,
    full_graph_refusal,
    load_sidecar,
    raise_on_errors,
    require_memlock,
    require_verified_sidecar,
    verify_sidecar_once,
)

CAP_SYS_PTRACE = 19
L4T_VERIFIED = {(39, 2): "write-up 003 (vLLM, JetPack 7.2)"}  # the Jetson releases a write-up ran vLLM on
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads both
INSTALL_FIX = "./install.sh --engine vllm"  # the vLLM runtime (side.install_hint)
SETTINGS_FIX = f"fix the {env.PREFIX}* variables (docs/configuration.md#vllm-side-vllm_ple_offload)"
SIDECAR_FIX = (f"point {env.SIDECAR} at the ssd-stream.json that `sglang-ssd-stream sidecar build` wrote, with "
               f"every table beside it at its full size (`sglang-ssd-stream sidecar verify DIR` checks it)")


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
    row_bytes: dict = field(default_factory=dict)  # sidecar layer -> bytes per row
    sidecar_error: str | None = None  # the sidecar's manifest or a table did not load
    sidecar_disk_use: str | None = None  # what its kind costs on disk (checks/sidecar.py disk_use)
    cpu: object = None  # checks.host.CpuBudget: affinity and cgroup quota (sizes the fetch pool)
    tegra: object = None  # checks.host.TegraRelease on a Jetson, else None
    mem_available_bytes: int | None = None  # /proc/meminfo MemAvailable; None: unknown
    worker_processes: int = 1  # vLLM worker processes on this host (TP x PP x local DP of the serve flags)

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


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def sidecar_disks(settings: env.PleSettings, manifest=None) -> tuple[DiskFacts, ...]:
    """Load the sidecar manifest (refusing a bad one) and classify the disks of its tables."""
    from sglang_ssd_stream.sidecar.storage import classify_disk

    manifest = manifest or load_sidecar(settings.sidecar, settings.trusted_roots)
    disks = [classify_disk(f) for f in dict.fromkeys(f for table in manifest.tables for f in table.files)]
    return tuple(DiskFacts(d.path, d.fstype, d.kind) for d in disks)


def _sidecar_facts(settings: env.PleSettings | None) -> dict:
    if settings is None or not settings.streaming:
        return {}
    try:
        manifest = load_sidecar(settings.sidecar, settings.trusted_roots)  # sizes checked: a truncated table refused
        from sglang_ssd_stream.checks.sidecar import disk_use

        return {"disks": sidecar_disks(settings, manifest),
                "row_bytes": {t.layer: t.row_bytes for t in manifest.tables}, "sidecar_disk_use": disk_use(manifest)}
    except KitError as exc:
        return {"sidecar_error": exc.message}


def _mem_available(path: str = "/proc/meminfo") -> int | None:
    from sglang_ssd_stream.checks.host import meminfo

    return meminfo(path).get("MemAvailable")


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
        cpu=cpu_budget(),
        tegra=tegra_release(),
        mem_available_bytes=_mem_available(),
        **_sidecar_facts(settings),
    )


# ----------------------------------------------------------------------------- checks


def check_memlock(facts: Facts, need_bytes: int | None, what: str) -> Finding:
    return _check_memlock(LockedMemory(facts.memlock_bytes, facts.cap_ipc_lock), need_bytes, what)


def check_sidecar(settings: env.PleSettings, facts: Facts) -> list[Finding]:
    """The sidecar loads with full-size tables; the SHA-256 opt-out is said out loud."""
    if not settings.streaming:
        return []
    from sglang_ssd_stream.checks.sidecar import load_finding

    if facts is None:  # not gathered: the floor loads it (sizes checked), as SGLang's doctor does
        from sglang_ssd_stream.sidecar.view import extra_trusted_roots

        loaded, _ = load_finding(settings.sidecar, extra_roots=extra_trusted_roots(settings.trusted_roots))
    elif facts.sidecar_error:
        loaded = Finding(ERROR, "sidecar", facts.sidecar_error)
    else:
        loaded = Finding(OK, "sidecar", f"{settings.sidecar}: {len(facts.row_bytes)} table(s), sizes as the manifest "
                         f"says" + (f"; {facts.sidecar_disk_use}" if facts.sidecar_disk_use else ""))  # the floor's
        # words (checks/sidecar.py load_finding)
    if loaded.level == ERROR:
        return [replace(loaded, fix=SIDECAR_FIX)]
    out = [loaded]
    if settings.no_verify:
        out.append(verify_sidecar_once(settings))  # the warning, without hashing
    return out


def check_fetch_round(settings: env.PleSettings, facts: Facts) -> Finding | None:
    """One fetch round (workers x rows per task x row bytes) must fit :data:`~.env.MAX_FETCH_ROUND_BYTES`."""
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    if not settings.streaming or not facts.row_bytes:
        return None
    row = max(facts.row_bytes.values())
    need, limit = env.fetch_round_bytes(settings, row), env.MAX_FETCH_ROUND_BYTES
    what = (f"{env.FETCH_WORKERS} x {env.ROWS_PER_TASK} x row bytes = {settings.fetch_workers} x "
            f"{settings.rows_per_task:,} x {row} B = {fmt_bytes(need)}")
    if need <= limit:
        return Finding(OK, "fetch_round", f"{what} per table (limit {fmt_bytes(limit)})")
    # Name the knob raised furthest above its default, with the most that fits beside the other.
    rows_fit = limit // (settings.fetch_workers * row)
    workers_fit = limit // (settings.rows_per_task * row)
    rows_first = (settings.rows_per_task / env.DEFAULT_ROWS_PER_TASK
                  >= settings.fetch_workers / env.DEFAULT_FETCH_WORKERS)
    if (rows_first or workers_fit < 1) and rows_fit >= 1:
        fix = f"lower {env.ROWS_PER_TASK} to at most {rows_fit:,}"
    elif workers_fit >= 1:
        fix = f"lower {env.FETCH_WORKERS} to at most {workers_fit:,}"
    else:
        fix = f"set {env.FETCH_WORKERS}=1 and {env.ROWS_PER_TASK} to at most {max(limit // row, 1):,}"
    return Finding(ERROR, "fetch_round", f"{what} per table and process: the {env.PREAD} backend's read buffer "
                   f"holds a whole round (the {env.MMAP} backend's index arrays grow with it); the limit is "
                   f"{fmt_bytes(limit)}",
                   fix + f" (defaults {env.DEFAULT_FETCH_WORKERS} x {env.DEFAULT_ROWS_PER_TASK:,})")


def check_row_cache(settings: env.PleSettings, facts: Facts) -> list[Finding]:
    """The row cache budget (per worker process) against memlock (its rows are registered on CUDA) and
    against MemAvailable for every worker process on the host."""
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    if not settings.streaming:
        return []
    budget = settings.row_cache_bytes
    if not budget:
        return [Finding(OK, "row_cache", f"{env.ROW_CACHE_MB}=0: no row cache and no prompt-ahead prefetch; rows come "
                        f"from the {settings.backend} reader")]
    what = f"{env.ROW_CACHE_MB}={settings.row_cache_mb} per worker process"
    out = [Finding(OK, "row_cache", f"{what} ({fmt_bytes(budget)}, split over the PLE layers; rows, metadata and "
                   f"read buffers), prompt-ahead prefetch {settings.prefetch_chunks} chunk(s) ahead")]
    if facts.uva:  # registered host memory (plus the staging, known when the model loads)
        out.append(check_memlock(facts, budget, f"the PLE row cache ({what})"))
    out.append(check_row_cache_memory(budget, facts.worker_processes, facts.mem_available_bytes,
                                      knob=env.ROW_CACHE_MB, process_kind="worker process"))
    return out


def run_checks(settings: env.PleSettings, facts: Facts, *, need_bytes: int | None = None) -> list[Finding]:
    findings: list[Finding] = check_sidecar(settings, facts)
    findings += check_row_cache(settings, facts)
    fetch = check_fetch_round(settings, facts)
    if fetch is not None:
        findings.append(fetch)
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
    if settings.streaming and facts.cpu is not None:  # the fetch pool against the CPU quota (write-up 004)
        findings += thread_findings({env.FETCH_WORKERS: settings.fetch_workers}, facts.cpu)
    tegra = tegra_finding(facts.tegra, L4T_VERIFIED, expected=False)
    if tegra is not None:
        findings.append(tegra)
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


def facts_json(facts: Facts) -> dict:
    return {**asdict(facts), "expandable_segments": facts.expandable_segments,
            "ptrace_permitted": facts.ptrace_permitted}


# ----------------------------------------------------------------------------- graph mode


def _serve_flags(argv: Sequence[str]) -> list[str]:
    """The flags of a ``vllm serve`` line (after ``serve``; all of ``argv`` when it has no ``serve``)."""
    argv = [str(a) for a in argv]
    return argv[argv.index("serve") + 1:] if "serve" in argv else argv


@contextmanager
def _ple_env_hidden():
    """vLLM's parser runs the general plugins in this process (``load_general_plugins``); ours would
    judge this process's environment, not the one under check: it sees no ``VLLM_PLE_*`` meanwhile."""
    hidden = {k: os.environ.pop(k) for k in env.present(os.environ)}
    try:
        yield
    finally:
        os.environ.update(hidden)


@functools.lru_cache(maxsize=4)
def _engine_args(flags: tuple[str, ...]):
    """vLLM's ``EngineArgs`` for the flags of a ``vllm serve`` line, parsed by vLLM's own parser (once per line).

    Raises:
        PleSettingsError: vLLM's parser refuses the flags.
        EnvironmentProblem: vLLM cannot build its parser on this host.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Parser(FlexibleArgumentParser):
        def error(self, message):
            raise PleSettingsError(f"vLLM's parser refuses the serve flags: {message}")

    try:
        with _ple_env_hidden():
            args = make_arg_parser(_Parser(prog="vllm serve")).parse_args(list(flags))
            return EngineArgs.from_cli_args(args)
    except PleSettingsError:
        raise
    except SystemExit as exc:  # --help, --version and the like
        raise PleSettingsError(f"vLLM's parser exited on the serve flags {list(flags)} (code {exc.code})") from None
    except (TypeError, ValueError) as exc:
        raise PleSettingsError(f"vLLM's parser refuses the serve flags: {exc}") from None
    except RuntimeError as exc:  # e.g. no device platform on this host: vLLM cannot build its parser here
        raise EnvironmentProblem(f"vLLM cannot read the serve flags on this host ({exc})") from None


def worker_processes(argv: Sequence[str]) -> int:
    """vLLM worker processes this ``vllm serve`` line starts on this host: TP x PP x local DP ranks
    (each builds its own PLE row caches). 1 when the flags cannot be read here (the graph-mode check
    reports that)."""
    try:
        engine = _engine_args(tuple(_serve_flags(argv)))
    except KitError:
        return 1
    local_dp = engine.data_parallel_size_local or engine.data_parallel_size or 1
    return max(1, int(engine.tensor_parallel_size or 1) * int(engine.pipeline_parallel_size or 1) * int(local_dp))


def requested_cudagraph_mode(argv: Sequence[str]):
    """(``CUDAGraphMode``, where it comes from) for a ``vllm serve`` line, read with vLLM's own parser.

    ``--enforce-eager`` means NONE; else ``cudagraph_mode`` from ``--compilation-config``/``-cc``;
    else vLLM's default for the optimization level (``-O``, default O2: FULL_AND_PIECEWISE). vLLM
    may still lower the mode later for reasons of its own (platform, pooling models, dynamic
    speculative decoding); the preflight judges what the line asks for.

    Raises:
        PleSettingsError: vLLM's parser refuses the flags.
    """
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel

    engine = _engine_args(tuple(_serve_flags(argv)))
    if engine.enforce_eager:
        from vllm.config.compilation import CUDAGraphMode

        return CUDAGraphMode.NONE, "--enforce-eager"
    if engine.compilation_config.cudagraph_mode is not None:
        return engine.compilation_config.cudagraph_mode, "--compilation-config"
    level = OptimizationLevel(int(engine.optimization_level))
    return OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]["cudagraph_mode"], \
        f"vLLM's default at -O{int(level)}"


def check_cudagraph_mode(settings: env.PleSettings, argv: Sequence[str]) -> Finding | None:
    if not settings.streaming:
        return None
    try:
        mode, source = requested_cudagraph_mode(argv)
    except PleSettingsError as exc:
        return Finding(ERROR, "cudagraph_mode", exc.message, "fix the vllm serve flags")
    except EnvironmentProblem as exc:  # the plugin still applies the rule when the model is built
        return Finding(WARNING, "cudagraph_mode", f"not checked: {exc.message}; the plugin applies the same graph "
                       f"rule when vLLM builds the model", "run the check on the GPU host")
    refusal = full_graph_refusal(settings, mode)
    if refusal:
        return Finding(ERROR, "cudagraph_mode", f"{refusal} (the mode comes from {source})",
                       "add --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager to the "
                       "vllm serve flags")
    return Finding(OK, "cudagraph_mode", f"{mode.name} (from {source})")


# ----------------------------------------------------------------------------- the launch environment


def require_vllm() -> None:
    """Refuse (exit 4) in a runtime without vLLM: e.g. the kit installed in the SGLang runtime."""
    import importlib.util

    from sglang_ssd_stream.patching.engines import ENGINES

    if importlib.util.find_spec("vllm") is None:
        raise EnvironmentProblem(
            f"vLLM is not installed in this runtime ({sys.executable}); vllm-ple-offload checks and serves "
            f"vllm {ENGINES['vllm'].pinned}: install its runtime with {INSTALL_FIX} and use the vllm-ple-offload "
            f"there")


def check_plugin_allowed(environ: Mapping[str, str]) -> Finding | None:
    """``VLLM_PLE_*`` set but ``VLLM_PLUGINS`` leaving us out: vLLM would silently run its own PLE path."""
    names = env.present(environ)
    if not names:
        return None
    if env.plugin_excluded(environ):
        return Finding(ERROR, "plugin_allowlist",
                       f"{env.PLUGINS_ENV}={environ[env.PLUGINS_ENV]!r} does not name {env.PLUGIN_NAME}, so vLLM never "
                       f"runs this plugin and ignores {', '.join(names)}: it would keep the whole PLE table per rank "
                       f"its own way while you believe the offload is on",
                       f"add {env.PLUGIN_NAME} to {env.PLUGINS_ENV} (comma-separated, no spaces), or unset "
                       f"{env.PLUGINS_ENV}")
    where = "unset" if env.PLUGINS_ENV not in environ else f"names {env.PLUGIN_NAME}"
    return Finding(OK, "plugin_allowlist", f"{env.PLUGINS_ENV} {where}: vLLM runs this plugin")


@dataclass(frozen=True)
class Diagnosis:
    settings: env.PleSettings | None  # None: the plugin is off, or the variables are refused
    settings_error: str | None
    facts: Facts | None
    findings: list


def diagnose(environ: Mapping[str, str], *, argv: Sequence[str] | None = None, need_bytes: int | None = None,
             verify_sha: bool = False) -> Diagnosis:
    """Every check for a launch environment (and its ``vllm serve`` flags, when given), parsed by the
    plugin's own parser: what the plugin would refuse, this refuses.

    ``argv=None`` skips the graph-mode check; ``verify_sha`` hashes the sidecar (the doctor does,
    ``serve``'s preflight leaves it to the plugin and its cache)."""
    from sglang_ssd_stream.patching.guard import verdict

    require_vllm()
    findings: list[Finding] = []
    settings = error = None
    try:
        settings = env.read_settings(environ)
    except PleSettingsError as exc:
        error = exc.message
        findings.append(Finding(ERROR, "settings", exc.message, SETTINGS_FIX))
    allowed = check_plugin_allowed(environ)
    if allowed is not None:
        findings.append(allowed)
    findings += verdict("vllm").findings(allow_unpatched=bool(settings and settings.allow_unpatched))
    if error is not None:
        return Diagnosis(None, error, None, findings)
    facts = gather_facts(settings, environ)
    if settings is not None and settings.row_cache_bytes and argv is not None:
        facts = replace(facts, worker_processes=worker_processes(argv))
    if settings is None:
        findings.append(Finding(OK, "ple_offload", f"no {env.PREFIX}* variable: the plugin is off and vLLM keeps "
                                f"its own PLE path (set {env.CPU_OFFLOAD}=1 to offload the table)"))
        return Diagnosis(None, None, facts, findings)
    findings.append(Finding(OK, "settings", settings.describe()))
    findings += run_checks(settings, facts, need_bytes=need_bytes)
    if argv is not None:
        graphs = check_cudagraph_mode(settings, argv)
        if graphs is not None:
            findings.append(graphs)
    if verify_sha and settings.streaming and not facts.sidecar_error and not settings.no_verify:
        findings.append(verify_sidecar_once(settings))
    return Diagnosis(settings, None, facts, findings)


def check_device() -> Finding:
    """``serve``'s device check, as the SGLang side's: the kit's vLLM profiles serve on CUDA GPUs, and on a host
    without one ``vllm serve`` stops after the preflight with "Failed to infer device type" (a CPU platform is
    what the kit's CPU tests run vLLM on, never a profile's launch). Not in :func:`diagnose`: the plugin's own
    start-up checks run on those CPU servers."""
    from vllm.platforms import current_platform

    name = type(current_platform).__name__
    if current_platform.is_cuda_alike():
        return Finding(OK, "device", f"{name}: a CUDA GPU")
    return Finding(ERROR, "device", f"vLLM finds no CUDA GPU here (its platform is {name}): the launch profiles "
                   f"serve on CUDA GPUs, and vllm serve would stop with \"Failed to infer device type\"",
                   "run on the GPU host; check the driver with nvidia-smi and that this venv's torch is a CUDA build")


def preflight(*, profile: str, model: str, draft: str | None, env: Mapping[str, str],
              argv=()) -> list[Finding]:
    """``serve``'s seam (``side.preflight``): the device, then :func:`diagnose` on the launch environment and
    line."""
    return [check_device(), *diagnose(env, argv=list(argv)).findings]
