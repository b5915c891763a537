"""``sglang-ssd-stream doctor``: refuse, before a 10-minute load, what cannot work; each finding names its fix.

Facts are gathered once (:func:`gather_facts`) and judged by :func:`run_checks`, so tests inject
them. Refusals (level ``error``, exit 2):

- the sglang source is not in the patched state (unknown, half-patched or missing files, or a
  release this kit has no manifest for); pristine is refused unless the plugin's own escape hatch
  ``SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1`` is set;
- no CUDA device;
- ``--qsa-indexer-dtype fp8_e4m3`` off SM90/SM100, which sglang 0.5.23 refuses at startup
  (``arg_groups/model_overrides/qwen4_exp.py``: TileLang fp8 scoring is validated only there);
- ``--ple-offload-backend file`` on a device whose pageable host memory is not read through the
  host page tables (sglang's ``check_file_backend_supported`` refuses it after the weights load);
- weights plus the requested KV/Mamba pool larger than the device memory sglang may use;
- no C or C++ compiler: the first start JIT-compiles kernels for the device (Triton launchers,
  sglang's tvm-ffi JIT, FlashInfer), which the Thor recipe gets from ``build-essential``.

Host prerequisites (``checks/host.py``, shared with vLLM): on a Jetson the L4T release (before JetPack 7,
R38, no Thor and no CUDA 13: refused; a release the write-ups did not run: warned); the PLE reader
threads against the CPU budget (affinity and the cgroup's ``cpu.max``: write-up 004's throttling);
free disk for the model and what the first start writes (write-up 000 asks for 180 GiB in all).

Warnings: the PLE sidecar not on a local NVMe disk (rows are random 4 KiB reads); on SM110 an
NVFP4 MoE left on ``--moe-runner-backend auto`` (patch 0004's header: sglang then picks
flashinfer_trtllm, unverified on sm_110; the Thor profile passes flashinfer_cutlass); and, on an
integrated (unified-memory) GPU such as Thor, the write-up's host advice: about 16 GB of swap with
``vm.swappiness=10`` as a buffer for transient pressure, and a persistent journal, without which
a watchdog reboot erases the last run's logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..checks.host import (
    TEGRA_RELEASE,
    CpuBudget,
    TegraRelease,
    cpu_budget,
    free_bytes,
    meminfo,
    tegra_finding,
    tegra_release,
    thread_findings,
)
from ..checks.memory import LockedMemory, check_memlock, check_row_cache_memory, locked_memory
from ..errors import KitError
from ..findings import ERROR, OK, WARNING, Finding, as_json, exit_code, print_report
from ..patching.guard import Verdict, verdict
from ..sidecar.storage import Disk, classify_disk  # noqa: F401 - classify_disk is part of the doctor's API
from ..staging.native_read import C_COMPILERS
from . import settings

GIB = 1 << 30

FP8_INDEXER_MAJORS = (9, 10)  # sglang 0.5.23: "--qsa-indexer-dtype fp8_e4m3 requires a CUDA SM90/SM100 GPU"
SM110_MAJOR = 11
THOR_SWAP_MIN_BYTES = 15 * GIB  # write-up 000: "about 16 GB total swap" (JetPack's ~2 GB + a 14 GiB file)
THOR_SWAPPINESS = 10
CXX_COMPILERS = ("c++", "g++", "clang++")
ALLOW_UNPATCHED_ENV = settings.ALLOW_UNPATCHED.name
PLE_SKIP_DEVICE_CHECK_ENV = "SGLANG_QWEN4_PLE_FILE_SKIP_DEVICE_CHECK"  # sglang's escape hatch

SWAP_FIX = ("add a 14 GiB swapfile (write-up 000): sudo fallocate -l 14G /swapfile.thor && sudo chmod 600 "
            "/swapfile.thor && sudo mkswap /swapfile.thor && sudo swapon /swapfile.thor; echo '/swapfile.thor none "
            "swap sw 0 0' | sudo tee -a /etc/fstab")
SWAPPINESS_FIX = "echo 'vm.swappiness=10' | sudo tee /etc/sysctl.d/90-thor-llm.conf && sudo sysctl --system"
JOURNALD_FIX = ("sudo install -d -m 2755 /var/log/journal; write /etc/systemd/journald.conf.d/90-thor-llm.conf with "
                "'[Journal]' 'Storage=persistent' 'SystemMaxUse=1G' 'SystemKeepFree=2G'; "
                "sudo systemctl restart systemd-journald")
NVME_FIX = "put the PLE sidecar on a local NVMe disk (copy the artifact, or point --model at a view on NVMe)"
L4T_VERIFIED = {(38, 4): "write-up 000 (SGLang, JetPack 7.1)"}
JETSON_PROFILES = ("thor",)  # launch profiles written for a Jetson: its host checks (L4T, swap, journal) apply
MODEL_FIX = ("pass the right --model (the model view: config.json, model.safetensors.index.json and its shards) "
             "and --draft; sglang-ssd-stream model fetch builds both")
RECIPE_DISK_BYTES = 180 * GIB  # write-up 000: model files, PLE sidecar, runtime and compile caches on NVMe


# ----------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Device:
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    integrated: bool  # unified memory (Jetson Thor, GB10): device memory is the host's
    pageable_memory_access: bool | None  # cudaDevAttrPageableMemoryAccessUsesHostPageTables; None: unknown
    # Streaming multiprocessors. Write-up 001 crashed a peer engine whose cooperative launches assumed 128 SMs;
    # sglang 0.5.23's QSA sizes its grids from the device (qsa/mqa.py _num_sms, the backend's tile count), so
    # the count is reported as evidence, not judged.
    sm_count: int | None = None


@dataclass(frozen=True)
class Request:
    """What the launch asks for (server flags and the environment it will run in)."""

    qsa_indexer_dtype: str | None = None
    ple_offload_backend: str | None = None
    moe_runner_backend: str | None = None
    quantization: str | None = None
    mem_fraction_static: float | None = None
    memory_need_bytes: int | None = None  # weights + KV/Mamba pool, from the capacity planner
    memory_plan_error: str | None = None  # the planner refused the pool
    memory_model_error: bool = False  # ... because it cannot read the model (config, index): not the pool's fault
    allow_unpatched: bool = False
    ple_skip_device_check: bool = False
    row_cache: dict | None = None  # operate.capacity.row_cache_budget: the PLE row cache this launch gets
    row_cache_error: str | None = None  # its variable holds a value the plugin refuses
    scheduler_processes: int = 1  # --tp-size x --pp-size x --dp-size: each holds its own row cache
    jetson_profile: str | None = None  # the launch's profile is written for a Jetson (JETSON_PROFILES)
    knob_refusals: tuple[str, ...] = ()  # the kit's knob values the plugin would refuse (settings.refusals)


@dataclass(frozen=True)
class DiskSpace:
    path: str  # where it will be written (its nearest existing ancestor is measured)
    free_bytes: int
    need_bytes: int
    what: str


@dataclass(frozen=True)
class Facts:
    device: Device | None  # None: no CUDA device
    source: Verdict
    c_compiler: str | None
    cxx_compiler: str | None
    swap_bytes: int | None
    swappiness: int | None
    journald_persistent: bool | None  # None: no systemd-journald here
    sidecar_disks: tuple[Disk, ...] = ()
    request: Request = field(default_factory=Request)
    tegra: TegraRelease | None = None  # /etc/nv_tegra_release (None: not a Jetson)
    cpu: CpuBudget | None = None
    read_workers: int | None = None  # the PLE reader pool in effect (SGLANG_SSD_STREAM_READ_WORKERS or default)
    disk_space: tuple[DiskSpace, ...] = ()
    locked: LockedMemory | None = None  # the locked-memory limit (the row cache registers its rows)
    mem_available_bytes: int | None = None  # /proc/meminfo MemAvailable


def _cuda_device() -> Device | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    try:  # sglang's own query of attribute 100 (ctypes on libcudart); one source for what it refuses
        from sglang.srt.models.qwen4_exp_ple_table import device_uses_host_page_tables

        pageable = device_uses_host_page_tables(0)
    except ImportError:
        pageable = None
    return Device(name=props.name, capability=(props.major, props.minor), total_memory_bytes=props.total_memory,
                  integrated=bool(getattr(props, "is_integrated", False)), pageable_memory_access=pageable,
                  sm_count=getattr(props, "multi_processor_count", None))


def _read_int(path: str | Path) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def journald_persistent(etc: str | Path = "/etc/systemd", var_log: str | Path = "/var/log/journal") -> bool | None:
    """Storage= from journald.conf and its drop-ins (last wins); ``auto`` persists iff /var/log/journal exists."""
    etc = Path(etc)
    main = etc / "journald.conf"
    dropins = sorted((etc / "journald.conf.d").glob("*.conf")) if (etc / "journald.conf.d").is_dir() else []
    if not main.exists() and not dropins:
        return None
    storage = "auto"
    for conf in [main, *dropins]:
        try:
            text = conf.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip() == "Storage":
                storage = value.strip().lower()
    if storage == "persistent":
        return True
    if storage == "auto":
        return Path(var_log).is_dir()
    return False


def _compiler(names: Iterable[str]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _read_workers(env: Mapping[str, str]) -> int | None:
    try:
        return settings.READ_WORKERS.read(env)
    except ValueError:
        return None  # check_knobs reports it; the plugin refuses it at start


def disk_space(model: str | None, data_dir: str | os.PathLike | None, home: str | None,
               model_bytes: int | None) -> tuple[DiskSpace, ...]:
    """Free space where the first start writes (compile caches under $HOME), or, before any model is
    there, where the recipe downloads it: write-up 000's 180 GiB, less what the model already holds."""
    out = []
    if model and model_bytes is not None and home:
        need = max(RECIPE_DISK_BYTES - model_bytes, 0)
        free, at = free_bytes(home)
        out.append(DiskSpace(at, free, need, "the first start's compile caches and the runtime (write-up 000's "
                             f"180 GiB less the model's {model_bytes / GIB:.0f} GiB)"))
    elif not model and data_dir is not None:
        free, at = free_bytes(data_dir)
        out.append(DiskSpace(at, free, RECIPE_DISK_BYTES, "the model, its PLE sidecar, runtime and compile caches "
                             "(write-up 000)"))
    return tuple(out)


def gather_facts(*, python: str | None = None, sidecar_paths: Iterable[str] = (),
                 request: Request | None = None, env: Mapping[str, str] | None = None,
                 disks: tuple[DiskSpace, ...] = ()) -> Facts:
    """The facts of this machine (no CUDA device is a fact, not an error)."""
    mem = meminfo()
    return Facts(
        device=_cuda_device(),
        source=verdict("sglang", python=python),
        c_compiler=_compiler(C_COMPILERS),
        cxx_compiler=_compiler(CXX_COMPILERS),
        swap_bytes=mem.get("SwapTotal"),
        swappiness=_read_int("/proc/sys/vm/swappiness"),
        journald_persistent=journald_persistent(),
        sidecar_disks=tuple(classify_disk(p) for p in sidecar_paths),
        request=request or Request(),
        tegra=tegra_release(),
        cpu=cpu_budget(),
        read_workers=_read_workers(os.environ if env is None else env),
        disk_space=disks,
        locked=locked_memory(),
        mem_available_bytes=mem.get("MemAvailable"),
    )


# ----------------------------------------------------------------------------- requested server args


def request_from_argv(argv: Iterable[str], env: Mapping[str, str] | None = None, *,
                      memory_need_bytes: int | None = None, memory_plan_error: str | None = None) -> Request:
    """The flags the checks read, from a launch command line (``--flag value`` or ``--flag=value``)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--qsa-indexer-dtype", "--ple-offload-backend", "--moe-runner-backend", "--quantization"):
        parser.add_argument(flag)
    parser.add_argument("--mem-fraction-static", type=float)
    for flags in (("--tp-size", "--tensor-parallel-size"), ("--pp-size", "--pipeline-parallel-size"),
                  ("--dp-size", "--data-parallel-size")):
        parser.add_argument(*flags, type=int, default=1)
    known, _ = parser.parse_known_args([str(a) for a in argv])
    return Request(qsa_indexer_dtype=known.qsa_indexer_dtype, ple_offload_backend=known.ple_offload_backend,
                   moe_runner_backend=known.moe_runner_backend, quantization=known.quantization,
                   mem_fraction_static=known.mem_fraction_static, memory_need_bytes=memory_need_bytes,
                   memory_plan_error=memory_plan_error, allow_unpatched=env.get(ALLOW_UNPATCHED_ENV) == "1",
                   knob_refusals=tuple(settings.refusals(env)),
                   ple_skip_device_check=env.get(PLE_SKIP_DEVICE_CHECK_ENV, "").lower() in ("1", "true"),
                   scheduler_processes=max(1, known.tp_size) * max(1, known.pp_size) * max(1, known.dp_size))


# ----------------------------------------------------------------------------- checks


def _arch(device: Device) -> str:
    return f"{device.name} (SM{device.capability[0]}{device.capability[1]})"


def check_device(facts: Facts) -> Finding:
    if facts.device is None:
        return Finding(ERROR, "device", "no CUDA device: torch sees no GPU here",
                       "run on the GPU host; check the driver with nvidia-smi and that this Python's torch is a CUDA "
                       "build")
    d = facts.device
    return Finding(OK, "device", f"{_arch(d)}, {d.total_memory_bytes / GIB:.1f} GiB"
                   + (f", {d.sm_count} SMs" if d.sm_count else "") + (", unified memory" if d.integrated else ""))


def check_fp8_indexer(facts: Facts) -> Finding | None:
    if facts.request.qsa_indexer_dtype != "fp8_e4m3" or facts.device is None:
        return None
    if facts.device.capability[0] in FP8_INDEXER_MAJORS:
        return Finding(OK, "qsa_indexer_dtype", f"fp8_e4m3 is supported on {_arch(facts.device)}")
    return Finding(ERROR, "qsa_indexer_dtype", f"--qsa-indexer-dtype fp8_e4m3 needs SM90/SM100; sglang refuses it on "
                   f"{_arch(facts.device)} at startup",
                   "drop --qsa-indexer-dtype fp8_e4m3 (auto keeps the bfloat16 indexer)")


def check_ple_backend(facts: Facts) -> Finding | None:
    if facts.request.ple_offload_backend != "file" or facts.device is None:
        return None
    access = facts.device.pageable_memory_access
    if access:
        return Finding(OK, "ple_offload_backend", "the device reads pageable host memory through the host page tables")
    if facts.request.ple_skip_device_check:
        return Finding(WARNING, "ple_offload_backend", f"device check skipped by {PLE_SKIP_DEVICE_CHECK_ENV}; "
                       f"{'the device reports no' if access is False else 'unknown'} pageable-memory access",
                       "--ple-offload-backend pinned")
    if access is False:
        return Finding(ERROR, "ple_offload_backend", f"--ple-offload-backend file needs pageable host memory read "
                       f"through the host page tables; {_arch(facts.device)} reports it does not, and sglang refuses "
                       f"after loading the weights", "--ple-offload-backend pinned")
    return Finding(ERROR, "ple_offload_backend", "cannot query cudaDevAttrPageableMemoryAccessUsesHostPageTables; "
                   "sglang refuses the file backend without it", "--ple-offload-backend pinned")


def _unified_row_cache_bytes(facts: Facts) -> int:
    """The PLE row cache's bytes where they come out of the device's memory (unified memory), else 0."""
    rc = facts.request.row_cache
    if facts.device is None or not facts.device.integrated or not rc:
        return 0
    return rc["mib"] << 20


def check_memory(facts: Facts) -> Finding | None:
    r = facts.request
    if r.memory_plan_error and r.memory_model_error:  # a smaller pool cannot fix a model that cannot be read
        return Finding(ERROR, "memory", f"cannot size weights and pool: {r.memory_plan_error}", MODEL_FIX)
    if r.memory_plan_error:
        return Finding(ERROR, "memory", r.memory_plan_error, "lower --max-total-tokens or --context-length; see "
                       "sglang-ssd-stream plan")
    if r.memory_need_bytes is None or facts.device is None:
        return None
    fraction = r.mem_fraction_static if r.mem_fraction_static is not None else 1.0
    usable = facts.device.total_memory_bytes * fraction
    cache = _unified_row_cache_bytes(facts)
    need = r.memory_need_bytes + cache
    what = "weights and pool" + (f" (+ the {cache >> 20} MiB PLE row cache: unified memory)" if cache else "")
    if need > usable:
        return Finding(ERROR, "memory", f"{what} need {need / GIB:.2f} GiB, but {_arch(facts.device)} "
                       f"gives sglang {usable / GIB:.2f} GiB ({facts.device.total_memory_bytes / GIB:.1f} GiB x "
                       f"{fraction:g})", "lower --max-total-tokens or --max-mamba-cache-size (sglang-ssd-stream plan "
                       "shows what fits)" + (f", or lower {r.row_cache['variable']}" if cache else ""))
    return Finding(OK, "memory", f"{need / GIB:.2f} GiB needed of {usable / GIB:.2f} GiB"
                   + (f" (the PLE row cache's {cache >> 20} MiB included: unified memory)" if cache else ""))


def check_row_cache(facts: Facts) -> list[Finding]:
    """The PLE row cache budget: host memory every scheduler process registers for PLE rows, against the
    locked-memory limit and MemAvailable (the floor's checks, as on vLLM)."""
    r = facts.request
    if r.row_cache_error:
        return [Finding(ERROR, "row_cache", f"{r.row_cache_error}; the plugin refuses it at start",
                        "set it to a whole number of MiB for all PLE layers (0: no row cache)")]
    rc = r.row_cache
    if rc is None:
        return []
    if not rc["mib"]:
        return [Finding(OK, "row_cache", f"off ({rc['variable']}=0, {rc['source']}): PLE rows are read through the "
                        f"mapped or pread reader, without prompt-ahead prefetch")]
    unified = facts.device is not None and facts.device.integrated
    out = [Finding(OK, "row_cache", f"{rc['mib']:,} MiB of registered host memory per scheduler process for all PLE "
                   f"layers ({rc['variable']}, {rc['source']}), with prompt-ahead prefetch"
                   + ("; unified memory: the KV cache cannot use it" if unified else ""))]
    budget, what = rc["mib"] << 20, f"the PLE row cache ({rc['variable']}={rc['mib']} per scheduler process)"
    if facts.locked is not None:
        out.append(check_memlock(facts.locked, budget, what))
    out.append(check_row_cache_memory(budget, r.scheduler_processes, facts.mem_available_bytes,
                                      knob=rc["variable"], process_kind="scheduler process"))
    return out


def check_compilers(facts: Facts) -> Finding:
    missing = [what for what, found in (("C", facts.c_compiler), ("C++", facts.cxx_compiler)) if not found]
    if missing:
        return Finding(ERROR, "compiler", f"no {' or '.join(missing)} compiler on PATH; the first start compiles "
                       f"kernels for this device (Triton launchers, sglang JIT, FlashInfer) and the PLE sidecar's "
                       f"native code (the row cache; the host-node read for CUDA graphs)",
                       "sudo apt-get install -y build-essential")
    return Finding(OK, "compiler", f"{facts.c_compiler}, {facts.cxx_compiler}")


def check_sidecar_disks(facts: Facts) -> list[Finding]:
    out = []
    for disk in facts.sidecar_disks:
        where = f"{disk.path} ({disk.fstype or 'unknown fs'}{', ' + disk.device if disk.device else ''})"
        if disk.kind == "nvme":
            out.append(Finding(OK, "sidecar_disk", f"{where}: local NVMe"))
        else:
            why = {"network": "a network filesystem", "hdd": "a rotational disk", "ssd": "a non-NVMe SSD",
                   "memory": "memory (lost on reboot, and it competes with the model for RAM)",
                   "unknown": "storage of unknown type"}[disk.kind]
            out.append(Finding(WARNING, "sidecar_disk", f"{where} is on {why}; PLE rows are random 4 KiB reads",
                               NVME_FIX))
    return out


def check_moe_runner(facts: Facts) -> Finding | None:
    r, d = facts.request, facts.device
    if d is None or d.capability[0] != SM110_MAJOR or r.quantization != "modelopt_fp4":
        return None
    if r.moe_runner_backend in (None, "auto"):
        return Finding(WARNING, "moe_runner_backend", "NVFP4 MoE with --moe-runner-backend auto resolves to "
                       "flashinfer_trtllm on SM110, whose kernels are unverified there",
                       "--moe-runner-backend flashinfer_cutlass (the Thor profile's)")
    return Finding(OK, "moe_runner_backend", r.moe_runner_backend)


def check_unified_memory_host(facts: Facts) -> list[Finding]:
    """Write-up 000's host advice for unified-memory boards (swap, swappiness, persistent journal)."""
    if facts.device is None or not facts.device.integrated:
        return []
    out = []
    if facts.swap_bytes is not None and facts.swap_bytes < THOR_SWAP_MIN_BYTES:
        out.append(Finding(WARNING, "swap", f"{facts.swap_bytes / GIB:.1f} GiB of swap; CPU and GPU share memory "
                           f"here, and about 16 GiB absorbs transient pressure", SWAP_FIX))
    if facts.swappiness is not None and facts.swappiness != THOR_SWAPPINESS:
        out.append(Finding(WARNING, "swappiness", f"vm.swappiness is {facts.swappiness}; the write-up runs 10",
                           SWAPPINESS_FIX))
    if facts.journald_persistent is False:
        out.append(Finding(WARNING, "journald", "the journal is not persistent: a watchdog reboot erases the logs "
                           "of the run that caused it", JOURNALD_FIX))
    return out


def check_l4t(facts: Facts) -> Finding | None:
    d = facts.device
    jetson = d is not None and d.integrated and "thor" in d.name.lower()
    return tegra_finding(facts.tegra, L4T_VERIFIED, expected=jetson)


def check_jetson_host(facts: Facts) -> Finding | None:
    """A Jetson profile checked on a machine that is not one: say which host checks did not run, and why."""
    profile, d = facts.request.jetson_profile, facts.device
    if profile is None:
        return None
    skipped = []
    if d is None or not d.integrated:
        skipped.append("swap, swappiness and persistent journal (" + ("no CUDA device here" if d is None else
                       f"{d.name} has its own memory, not unified memory") + ")")
    if facts.tegra is None and check_l4t(facts) is None:
        skipped.append(f"L4T release (no {TEGRA_RELEASE}: not a Jetson)")
    if not skipped:
        return None
    return Finding(WARNING, "jetson_host", f"profile {profile} is written for Jetson AGX Thor and this machine is "
                   f"not one, so its host checks were skipped: {'; '.join(skipped)}",
                   f"run `sglang-ssd-stream doctor --profile {profile}` on the Thor that will serve; for a discrete "
                   f"GPU use --profile discrete-gpu")


def check_reader_threads(facts: Facts) -> list[Finding]:
    if facts.cpu is None or facts.read_workers is None:
        return []
    return thread_findings({settings.READ_WORKERS.name: facts.read_workers}, facts.cpu)


def check_knobs(facts: Facts) -> list[Finding]:
    """Every knob value the plugin would refuse at start (it stops at the first; the doctor lists them all)."""
    return [Finding(ERROR, "knobs", message, "fix or unset it (docs/configuration.md)")
            for message in facts.request.knob_refusals if message != facts.request.row_cache_error]


def check_disk_space(facts: Facts) -> list[Finding]:
    out = []
    for d in facts.disk_space:
        if d.free_bytes < d.need_bytes:
            out.append(Finding(WARNING, "disk", f"{d.free_bytes / GIB:.1f} GiB free at {d.path}; {d.what} need "
                               f"{d.need_bytes / GIB:.1f} GiB", "free space there, or move $HOME's caches / the "
                               "data dir ($SGLANG_SSD_STREAM_HOME) to a larger local NVMe disk"))
        else:
            out.append(Finding(OK, "disk", f"{d.free_bytes / GIB:.1f} GiB free at {d.path} ({d.what}: "
                               f"{d.need_bytes / GIB:.1f} GiB)"))
    return out


def run_checks(facts: Facts) -> list[Finding]:
    findings = facts.source.findings(allow_unpatched=facts.request.allow_unpatched)
    findings += [check_device(facts), check_compilers(facts)]
    for check in (check_fp8_indexer, check_ple_backend, check_memory, check_moe_runner):
        found = check(facts)
        if found is not None:
            findings.append(found)
    findings += check_row_cache(facts)
    findings += check_sidecar_disks(facts)
    findings += check_unified_memory_host(facts)
    for found in (check_l4t(facts), check_jetson_host(facts)):
        findings += [found] if found else []
    findings += check_reader_threads(facts)
    findings += check_knobs(facts)
    findings += check_disk_space(facts)
    return findings


# ----------------------------------------------------------------------------- launch inputs


def _profile_argv(profile: str | None, model: str | None, draft: str | None) -> list[str]:
    if profile is None:
        return []
    from ..operate.profiles import DRAFT, MODEL, get_profile

    argv = []
    for flag, value in get_profile(profile, "sglang").args:
        argv.append(flag)
        if value is not None:
            argv.append({MODEL: model or "", DRAFT: draft or ""}.get(value, value))
    return argv


def _flag(argv: list[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def memory_need(model: str, argv: list[str]) -> tuple[int | None, str | None]:
    """(weights + KV/Mamba pool bytes, or the planner's refusal) for a launch that names its pool.

    The weights are the model's and, when the launch drafts (``--speculative-algorithm``), the NEXTN draft
    model's (``--speculative-draft-model-path``): write-up 000 loads 8.08 GB of MTP beside 77.97 GB."""
    return _memory_need(model, argv)[:2]


def _memory_need(model: str, argv: list[str]) -> tuple[int | None, str | None, bool]:
    """:func:`memory_need`, and whether its refusal is the model's (config or index unreadable)."""
    from ..errors import KitError
    from ..operate.capacity import GIB as PLAN_GIB
    from ..operate.capacity import load_geometry, mamba_slots_per_request_of, plan, weights_bytes
    from ..operate.errors import ModelConfigError

    def num(flag, default=None):
        v = _flag(argv, flag)
        return default if v is None else int(v)

    context, pool = num("--context-length"), num("--max-total-tokens")
    if context is None or pool is None:
        return None, None, False
    steps = num("--speculative-num-steps", 0) if _flag(argv, "--speculative-algorithm") else 0
    try:
        p = plan(load_geometry(Path(model) / "config.json"), context_length=context, pool_tokens=pool,
                 running=num("--max-running-requests", 1), draft_steps=steps,
                 mamba_slots=num("--max-mamba-cache-size"), page_size=num("--page-size", 1),
                 mamba_per_request=mamba_slots_per_request_of(lambda f: _flag(argv, f), lambda f: f in argv),
                 target_kv_dtype=_flag(argv, "--kv-cache-dtype") or "bfloat16",
                 draft_kv_dtype=_flag(argv, "--speculative-draft-kv-cache-dtype"),
                 ssm_dtype=_flag(argv, "--mamba-ssm-dtype") or "float32")
        weights = weights_bytes(model)
        draft = _flag(argv, "--speculative-draft-model-path")
        if steps and draft:
            weights += weights_bytes(draft)
    except ModelConfigError as exc:
        return None, exc.message, True
    except KitError as exc:
        return None, exc.message, False
    return int(weights + (p.pool_gib["total"] + p.mamba["total_gib"]) * PLAN_GIB), None, False


def _with_row_cache(request: Request, profile: str | None, env: Mapping[str, str]) -> Request:
    """The row cache this launch gets: the exported value (a launch keeps it), else the profile's, else the
    default (``operate.capacity.row_cache_budget``)."""
    from dataclasses import replace

    from ..errors import KitError
    from ..operate.capacity import row_cache_budget
    from ..operate.profiles import get_profile
    knob = settings.ROW_CACHE_MB
    profile_env = get_profile(profile, "sglang").env if profile else {}
    try:
        return replace(request, row_cache=row_cache_budget((knob.name, knob.default), profile_env, env))
    except KitError as exc:
        return replace(request, row_cache_error=exc.message)


def sidecar_paths(model: str | None, explicit: Iterable[str] = ()) -> list[str]:
    paths = list(explicit)
    if model and not paths and Path(model, "ssd-stream.json").exists():
        from ..sidecar.view import load_sidecar

        manifest = load_sidecar(model, check_files=False)
        paths = sorted({str(f) for t in manifest.tables for f in t.files})  # an in-place table: its shards
    return paths


def diagnose(*, profile: str | None = None, model: str | None = None,
             draft: str | None = None, argv: Iterable[str] = (), env: Mapping[str, str] | None = None,
             python: str | None = None, sidecars: Iterable[str] = (),
             data_dir: str | None = None, verify_sha: bool = False) -> tuple[Facts, list[Finding]]:
    from dataclasses import replace

    env = os.environ if env is None else env
    full = _profile_argv(profile, model, draft) + [str(a) for a in argv]
    need, plan_error, model_error = _memory_need(model, full) if model else (None, None, False)
    request = request_from_argv(full, env, memory_need_bytes=need, memory_plan_error=plan_error)
    request = _with_row_cache(replace(request, memory_model_error=model_error,
                                      jetson_profile=profile if profile in JETSON_PROFILES else None), profile, env)
    sidecar_error, paths = None, []
    try:
        paths = sidecar_paths(model, sidecars)
    except KitError as exc:  # a malformed ssd-stream.json: reported, not raised, so the report prints whole
        sidecar_error = exc.message
    facts = gather_facts(python=python, sidecar_paths=paths, request=request, env=env,
                         disks=disk_space(model, data_dir, env.get("HOME"), _model_bytes(model, full)))
    findings = run_checks(facts)
    if model:  # the config as sglang will load it (transformers' own class), issue 28 item 6
        from ..operate.engine_config import engine_config_finding

        loaded = engine_config_finding(model)
        findings += [loaded] if loaded else []
    if sidecar_error:
        findings.append(Finding(ERROR, "sidecar", sidecar_error, "rebuild or re-download the sidecar "
                                "(sglang-ssd-stream model fetch verifies every file)"))
    else:
        findings += check_sidecar(model, env, verify_sha=verify_sha)
    return facts, findings


def check_sidecar(model: str | None, env: Mapping[str, str], *, verify_sha: bool) -> list[Finding]:
    """The sidecar the plugin will serve (the knob's, else the model's), judged by the floor both engines share
    (checks/sidecar.py): its tables load at full size and, with ``verify_sha``, match their SHA-256."""
    from ..checks.sidecar import load_finding, sha_finding
    from ..sidecar.view import extra_trusted_roots

    try:
        s = settings.read_settings(env)
    except ValueError:
        return []  # check_knobs names the bad value
    path = s.sidecar or (str(Path(model, "ssd-stream.json")) if model and Path(model, "ssd-stream.json").exists()
                         else None)
    if s.sidecar_off or path is None:
        return []
    roots = extra_trusted_roots(s.trusted_roots)
    loaded, manifest = load_finding(path, extra_roots=roots)
    if manifest is None or not (verify_sha or s.no_verify):
        return [loaded]
    return [loaded, sha_finding(path, knob=settings.NO_VERIFY.name, no_verify=s.no_verify, extra_roots=roots)]


def _model_bytes(model: str | None, argv: list[str]) -> int | None:
    """What the model's weights and sidecar already occupy (None when they cannot be read)."""
    if not model:
        return None
    from ..operate.capacity import weight_files

    try:  # each file once: an in-place sidecar's tables are regions of the shards the index maps
        files = {os.path.realpath(f) for f in weight_files(model)} | {os.path.realpath(p) for p in sidecar_paths(model)}
        total = sum(os.path.getsize(f) for f in files)
    except (KitError, OSError):
        return None
    return total


def preflight(*, profile: str, model: str, draft: str | None, env: Mapping[str, str],
              argv: Iterable[str] = ()) -> list[Finding]:
    """The ``serve`` seam (``side.preflight``): the findings for a launch line."""
    _, findings = diagnose(profile=profile, model=model, draft=draft, argv=argv, env=env)
    return findings


# ----------------------------------------------------------------------------- command line


def _profile_name(name: str) -> str:
    """--profile: an SGLang profile; anything else is a usage error (exit 64), a vLLM profile named as one."""
    from ..operate.profiles import profiles_for

    if name in profiles_for("sglang"):
        return name
    vllm = (f"{name!r} is a vllm-ple-offload profile: check it with `vllm-ple-offload serve --profile {name} "
            f"--model DIR --dry-run` in the vLLM runtime (./install.sh --engine vllm); " if name in profiles_for("vllm")
            else f"unknown profile {name!r}; ")
    raise argparse.ArgumentTypeError(f"{vllm}sglang-ssd-stream's profiles: {', '.join(profiles_for('sglang'))}")


def add_doctor_command(subparsers) -> None:
    from ..operate.profiles import profiles_for

    p = subparsers.add_parser(
        "doctor", help="check this machine and the sglang install before serving (exit 2 on a refusal)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--python", metavar="PATH", help="check the sglang that this interpreter imports")
    p.add_argument("--profile", type=_profile_name, help="take the server flags of a launch profile: "
                   + ", ".join(profiles_for("sglang")))
    p.add_argument("--model", metavar="DIR", help="model view: sidecar location and memory need")
    p.add_argument("--draft", metavar="DIR", help="MTP draft directory (for the profile's flags)")
    p.add_argument("--sidecar", action="append", default=[], metavar="PATH", help="a sidecar file or folder to check")
    p.add_argument("--data-dir", metavar="DIR", help="where `model fetch` will download (without --model: its free "
                   "space is checked; default $SGLANG_SSD_STREAM_HOME)")
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then the sglang flags of the launch")
    p.set_defaults(func=run_doctor_command)


def run_doctor_command(args) -> int:
    extra = list(args.server_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    from ..paths import data_dir

    facts, findings = diagnose(profile=args.profile, model=args.model, draft=args.draft, argv=extra,
                               python=args.python, sidecars=args.sidecar, data_dir=args.data_dir or str(data_dir()),
                               verify_sha=True)
    if args.json:
        print(json.dumps(as_json(facts, findings), indent=2))
    else:
        print_report(findings, tool="sglang-ssd-stream")
    return exit_code(findings)
