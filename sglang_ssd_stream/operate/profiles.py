"""Launch profiles: every flag and variable a profile sets, in one table (``PROFILES``).

Values come from the deployment write-ups; each row says why. ``launch.py`` turns a profile into
a command line; ``capacity.py`` reads the same rows for its defaults, and ``service.py`` for the
unit and compose files, so a number is changed here or nowhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType

MODEL = "{model}"  # placeholders filled by launch.py
DRAFT = "{draft}"


@dataclass(frozen=True)
class MtpRule:
    """A measured rule for ``--mtp auto``: drafting loses from this expected prompt context on."""

    off_from_context: int
    source: str  # the write-up that measured it
    long_evidence: str  # why off at long context
    short_evidence: str  # why on below it


@dataclass(frozen=True)
class WatchLimits:
    """Thresholds ``watch`` warns at (``warn``) and writes an incident bundle at (``incident``)."""

    mem_available_warn_gib: float
    mem_available_incident_gib: float
    swap_used_warn_gib: float | None = None
    kv_usage_warn: float = 0.95
    accept_length_warn: float | None = None  # mean accepted tokens per verify step (incl. the bonus token)
    accept_rate_warn: float | None = None
    why: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str  # "sglang" | "vllm"
    summary: str
    args: tuple[tuple[str, str | None], ...]  # (flag, value); None = bare switch
    env: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # values may be MODEL
    port: int = 8000
    default_served_name: str | None = None
    needs_sidecar: bool = False  # preflight: the model dir must hold a valid ssd-stream.json
    needs_draft: bool = False  # NEXTN draft (the MTP directory) must exist
    speculative_flags: tuple[str, ...] = ()  # the flags `--mtp off` drops (the whole speculative setup)
    mtp_rule: MtpRule | None = None  # what `--mtp auto` decides by; None: no measured rule, MTP stays on
    watch: WatchLimits | None = None

    def value(self, flag: str) -> str | None:
        """The value a profile gives ``flag`` (KeyError when it does not set it)."""
        for f, v in self.args:
            if f == flag:
                return v
        raise KeyError(f"profile {self.name} does not set {flag}")

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.args)

    @property
    def running(self) -> int | None:
        for flag in ("--max-running-requests", "--max-num-seqs"):
            if self.has(flag):
                return int(self.value(flag))
        return None

    @property
    def drafts(self) -> bool:
        return any(self.has(f) for f in self.speculative_flags)


# Write-up 000 §§2, 6, 9: the box rebooted (watchdog, no OOM record) with MemAvailable near 2 GB and its
# 2 GB swap full; the 40-minute two-session soak bottomed at 15.06 GiB with +21 MiB swap; KV peaked at
# 90.34 %. Accept length ran 2.7-3.65 (rate 0.57-0.88) with NEXTN 3/1/4; below rate 0.4 decode fell to
# 22 tok/s from 33, and sglang #37326 describes acceptance decaying to zero until a restart.
_UNIFIED_MEMORY_WATCH = WatchLimits(
    mem_available_warn_gib=8.0, mem_available_incident_gib=4.0, swap_used_warn_gib=2.0, kv_usage_warn=0.95,
    accept_length_warn=1.5, accept_rate_warn=0.3,
    why="write-up 000: reboot near 2 GB MemAvailable with swap full; healthy soak floor 15.06 GiB, KV peak 90 %")
# A discrete GPU: host memory holds page cache, pinned staging and the processes; the kernel OOM killer
# is the failure, not a watchdog reboot.
_DISCRETE_WATCH = WatchLimits(mem_available_warn_gib=4.0, mem_available_incident_gib=2.0, kv_usage_warn=0.95,
                              accept_length_warn=1.5, accept_rate_warn=0.3,
                              why="host RAM holds page cache and pinned staging; thresholds are the OOM margin")


# Flags shared by the SGLang profiles (write-up 000, run-thor-hn-fp8.sh): NVFP4 dense path and
# experts, QSA needs page 64, NEXTN 3/1/4 drafts with the MTP layer.
_SGLANG_COMMON: tuple[tuple[str, str | None], ...] = (
    ("--model-path", MODEL),
    ("--trust-remote-code", None),
    ("--quantization", "modelopt_fp4"),
    ("--fp4-gemm-backend", "flashinfer_cutlass"),
    ("--kv-cache-dtype", "fp8_e4m3"),  # 6.5 GiB BF16 → ~3.26 GiB FP8 at 262,144 tokens (000 §5)
    ("--speculative-draft-kv-cache-dtype", "fp8_e4m3"),  # the draft pool has one slot per target token
    ("--page-size", "64"),  # QSA compressed slots are full_slot // ratio: paged KV required
    ("--mamba-radix-cache-strategy", "extra_buffer_lazy"),
    ("--mamba-track-interval", "64"),
    ("--mamba-ssm-dtype", "float32"),
    ("--speculative-algorithm", "NEXTN"),
    ("--speculative-draft-model-path", DRAFT),
    ("--speculative-num-steps", "3"),
    ("--speculative-eagle-topk", "1"),
    ("--speculative-num-draft-tokens", "4"),
    ("--enable-metrics", None),  # /metrics: KV usage and MTP accept length/rate for `watch`
    ("--allow-auto-truncate", None),  # page-safe with patch 0001: keeps the client's output budget
    ("--enable-multimodal", None),
    ("--reasoning-parser", "auto"),
    ("--tool-call-parser", "auto"),
)

_SGLANG_SPECULATIVE = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                       "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                       "--speculative-draft-kv-cache-dtype", "--enable-linear-replayssm-spec")

_THOR = Profile(
    name="thor",
    engine="sglang",
    summary="Jetson AGX Thor 128 GB: 262,144 context, 557,056-token shared pool, 4 requests, FP8 KV, NEXTN+ReplaySSM",
    args=_SGLANG_COMMON + (
        ("--attention-backend", "triton"),  # SM110 is refused by trtllm_mha (sglang ref §b.8)
        ("--moe-runner-backend", "flashinfer_cutlass"),
        ("--context-length", "262144"),  # native window; 261,888-token recall passed (000 §6)
        ("--max-total-tokens", "557056"),  # shared pool: two ~250K sessions or four shorter (000 §9)
        ("--max-running-requests", "4"),
        ("--max-mamba-cache-size", "16"),  # 4 requests x (1 target + 3 draft states); 5 admitted only one
        ("--cuda-graph-max-bs-decode", "4"),
        ("--disable-prefill-cuda-graph", None),
        ("--chunked-prefill-size", "2048"),
        ("--mem-fraction-static", "0.95"),
        ("--enable-linear-replayssm-spec", None),  # ReplaySSM: fewer recurrent snapshots per draft
        ("--sleep-on-idle", None),  # SGLANG_EMPTY_CACHE_INTERVAL only acts from the idle path (ref §g)
    ),
    env=MappingProxyType({
        "SGLANG_PLUGINS": "ssd_stream",
        "SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB": "32",  # 12 layers x 128 MiB = 1.5 GiB peak -> 384 MiB (000 §7)
        "SGLANG_EMPTY_CACHE_INTERVAL": "60",  # return idle allocator blocks after 60 s fully idle
        "SGLANG_SANITIZE_NAN_LOGITS": "1",  # safety net only: the 261,888-token run had no NaN/Inf
        # PLE row cache for all PLE layers: small and fixed on unified memory (every byte is KV lost); on the
        # held-out code trace 1 GiB of rows read 1.06x Belady's optimum and 37-39 % fewer pages than a page
        # cache held to 1 GiB (benchmarks/row_cache/README.md)
        "SGLANG_SSD_STREAM_ROW_CACHE_MB": "1024",
        # MTP's verify rows read as soon as the drafts exist: with Thor-class steps (simulated 1 ms layers on the
        # H200, 49 ms steps) it cut a 256-row step's exposure from 4.5-5.1 % to 2.4-4.2 % and a 1,024-row one's
        # by half; with 12 ms steps it saved nothing (docs/hot-file-measured.md). Not yet run on a Thor.
        "SGLANG_SSD_STREAM_PREFETCH_DRAFTS": "1",
    }),
    port=8000,
    needs_sidecar=True,
    needs_draft=True,
    speculative_flags=_SGLANG_SPECULATIVE,
    watch=_UNIFIED_MEMORY_WATCH,
)

_DISCRETE = Profile(
    name="discrete-gpu",
    engine="sglang",
    summary="one discrete GPU (96 GB class): PLE streamed from the NVMe sidecar, FP8 KV, 131,072 context, 1 request",
    args=_SGLANG_COMMON + (
        ("--context-length", "131072"),  # prior art's RTX PRO 6000 profile (prior-art §1.3)
        ("--max-total-tokens", "131072"),
        ("--max-running-requests", "1"),
        ("--max-mamba-cache-size", "5"),  # 1 request x 4 NEXTN states, one spare
        ("--cuda-graph-max-bs-decode", "1"),
        ("--chunked-prefill-size", "4096"),
        ("--mem-fraction-static", "0.985"),  # prior art's measured RTX PRO 6000 value
        ("--sleep-on-idle", None),
    ),
    env=MappingProxyType({
        "SGLANG_PLUGINS": "ssd_stream",
        "SGLANG_EMPTY_CACHE_INTERVAL": "60",
        # PLE row cache in host RAM (not the GPU's): 4 GiB held the trace's whole 2 GiB working set of rows
        # (13.3M rows: Belady's floor, 28 % fewer disk reads than a 4 GiB page cache; benchmarks/row_cache/)
        "SGLANG_SSD_STREAM_ROW_CACHE_MB": "4096",
    }),
    port=30000,
    needs_sidecar=True,
    needs_draft=True,
    speculative_flags=_SGLANG_SPECULATIVE,
    watch=_DISCRETE_WATCH,
)

_A100X4 = Profile(
    name="a100x4",
    engine="vllm",
    summary="4x A100 80 GB: TP4 + expert parallel, PLE in pinned host RAM, MTP 3, 262,144 context (write-up 002)",
    args=(
        ("serve", MODEL),  # positional: `vllm serve MODEL`
        ("--tensor-parallel-size", "4"),
        ("--enable-expert-parallel", None),  # expert width 640 / TP4 = 160 breaks 128x128 FP8 blocks
        ("--max-model-len", "262144"),
        ("--max-num-seqs", "8"),  # the 2,955,692-token pool holds 11.28 full contexts, above 8
        ("--max-num-batched-tokens", "16384"),  # 64K/c8 sweep: +79.8% prefill over 2,048; 24,576 adds 2.2%
        ("--gpu-memory-utilization", "0.88"),  # 0.90 OOMed at runtime (1.19 GiB needed, ~0.9 free)
        ("--disable-custom-all-reduce", None),
        ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3}, separators=(",", ":"))),
        ("--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, separators=(",", ":"))),
        ("--enable-auto-tool-choice", None),
        ("--tool-call-parser", "qwen3_xml"),
        ("--reasoning-parser", "qwen3"),
        ("--enable-prompt-tokens-details", None),
        ("--enable-prefix-caching", None),  # decides the Mamba align mode; --mamba-cache-mode is a no-op in 0.33.0
    ),
    env=MappingProxyType({
        "VLLM_PLE_CPU_OFFLOAD": "1",  # ~51 GiB PLE in pinned host RAM instead of +12.8 GiB per GPU
        "OMP_NUM_THREADS": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }),
    port=30001,
    default_served_name="qwen3.8-flash-next",
    speculative_flags=("--speculative-config",),
    watch=WatchLimits(mem_available_warn_gib=64.0, mem_available_incident_gib=32.0, kv_usage_warn=0.95,
                      accept_length_warn=1.5, accept_rate_warn=0.3,
                      why="write-up 002: host RAM holds ~51 GiB of pinned PLE and the LMCache run left 743 GiB of "
                          "1.8 TiB; thresholds leave room for the pinned table"),
)

# Write-up 003 (Thor, vLLM): 8 x 16K streams decoded 68.3 tok/s with MTP off vs 36.0 with MTP=2 (+90 %), 4 x 16K
# 37.2 vs 19.6, and the KV pool grew 24 %; short prompts keep it (c4 json 141.3 with MTP=2 vs 90.5 without).
_VLLM_THOR_MTP = MtpRule(
    off_from_context=8192, source="write-up 003",
    long_evidence="write-up 003 measured 8 x 16K streams at 68.3 tok/s without MTP vs 36.0 with MTP=2 (+90 %), "
                  "4 x 16K at 37.2 vs 19.6, and a 24 % larger KV pool; it tiers every prompt of 8K and more to MTP off",
    short_evidence="write-up 003 measured short prompts faster with MTP=2 at every concurrency (c4 json 141.3 vs "
                   "90.5 tok/s without, c1 49.4 with one draft vs 29.2)")

_VLLM_THOR = Profile(
    name="thor",
    engine="vllm",
    summary="Jetson AGX Thor (SM110, 122.86 GiB unified): FP8 KV, FA4, 8 sequences, PLE streamed from the sidecar "
            "by mmap with a 24 x 2,048-row fetch pool, MTP by expected context (write-up 003)",
    args=(
        ("serve", MODEL),
        ("--max-model-len", "262144"),  # the model's native window; 250K prefill measured (003 §2)
        ("--max-num-seqs", "8"),  # SEQS=8
        ("--max-num-batched-tokens", "4096"),  # BATCHED=4096
        ("--gpu-memory-utilization", "0.70"),  # GPU_MEM=0.70: FP8 pool 833,617-872,939 tokens (003 §2)
        ("--kv-cache-dtype", "fp8_e4m3"),  # x1.68-1.76 pool over BF16; prefill -8 %, decode -2..-11 % (003 §2)
        ("--attention-config.flash_attn_version", "4"),  # SM110 defaults to FA2 in vLLM 0.33 (ref §2); 003 ran FA4
        ("--long-prefill-token-threshold", "1024"),  # decode streams starved by prefill less: failures 169 -> 127
        ("--enable-prefix-caching", None),  # 12K-prefix TTFT 8.18 -> 3.87 s (003 §3)
        ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}, separators=(",", ":"))),
        ("--enable-auto-tool-choice", None),  # parsers as write-up 002 (same model family)
        ("--tool-call-parser", "qwen3_xml"),
        ("--reasoning-parser", "qwen3"),
    ),
    env=MappingProxyType({
        "VLLM_PLE_CPU_OFFLOAD": "1",
        "VLLM_PLE_OFFLOAD_BACKEND": "mmap",  # the table stays the sidecar file; PLE pinned in RAM would eat the KV
        "VLLM_PLE_SIDECAR": MODEL,  # the model view holds ssd-stream.json
        "VLLM_PLE_FETCH_WORKERS": "24",  # 003: 24 workers x 2,048 rows per task took 277 -> 10 us/row
        "VLLM_PLE_ROWS_PER_TASK": "2048",
        "VLLM_PLE_PREFETCH_DRAFTS": "1",  # as SGLang's thor profile: it pays with Thor-class steps (measured there)
    }),
    port=8001,  # PORT=8001
    default_served_name="qwen3.8-flash-next",
    needs_sidecar=True,
    speculative_flags=("--speculative-config",),  # MTP=0 is refused by vLLM's validation: drop the whole option
    mtp_rule=_VLLM_THOR_MTP,
    watch=_UNIFIED_MEMORY_WATCH,
)

PROFILES_BY_ENGINE: MappingProxyType = MappingProxyType({
    "sglang": MappingProxyType({p.name: p for p in (_THOR, _DISCRETE)}),
    "vllm": MappingProxyType({p.name: p for p in (_A100X4, _VLLM_THOR)}),
})
# Every profile by (engine, name): both engines have a "thor".
PROFILES: MappingProxyType = MappingProxyType(
    {(engine, name): p for engine, table in PROFILES_BY_ENGINE.items() for name, p in table.items()})

def profiles_for(engine: str) -> list[str]:
    return list(PROFILES_BY_ENGINE.get(engine, {}))


def get_profile(name: str, engine: str) -> Profile:
    from .errors import ServeRefused

    p = PROFILES_BY_ENGINE.get(engine, {}).get(name)
    if p is None:
        raise ServeRefused(f"unknown {engine} profile {name!r}; known: {', '.join(profiles_for(engine))}")
    return p


MTP_MODES = ("auto", "on", "off")


def without_speculation(profile: Profile) -> Profile:
    """The profile with its whole speculative setup dropped (vLLM refuses num_speculative_tokens=0)."""
    from dataclasses import replace

    drop = set(profile.speculative_flags)
    return replace(profile, args=tuple((f, v) for f, v in profile.args if f not in drop), needs_draft=False)


def with_mtp(profile: Profile, mode: str | None = None, *, expected_context: int | None = None,
             concurrency: int | None = None) -> tuple[Profile, str]:
    """Apply ``--mtp auto|on|off`` (None: ``auto`` where the profile has a measured rule, else the profile's own
    drafting); returns the profile to launch and why, for people. ``auto`` without a rule is refused: it
    would only pretend to decide."""
    from .errors import ServeRefused

    if mode is None and profile.drafts and profile.mtp_rule is None:
        return profile, (f"MTP on: profile {profile.name} drafts as its write-up did; no on/off rule was measured "
                         f"for it (--mtp off drops the speculative setup)")
    mode = "auto" if mode is None else mode
    if mode not in MTP_MODES:
        raise ValueError(f"--mtp {mode!r}: expected one of {', '.join(MTP_MODES)}")
    if not profile.drafts:
        return profile, f"MTP: profile {profile.name} does not draft"
    if mode == "on":
        return profile, "MTP on (--mtp on)"
    if mode == "off":
        return without_speculation(profile), "MTP off (--mtp off): the whole speculative setup is dropped"
    rule = profile.mtp_rule
    if rule is None:
        measured = ", ".join(f"{p.engine} {p.name} ({p.mtp_rule.source})" for p in PROFILES.values() if p.mtp_rule)
        raise ServeRefused(f"--mtp auto: profile {profile.name} ({profile.engine}) has no measured on/off rule for "
                           f"MTP (measured: {measured}); choose --mtp on (the profile's drafting) or --mtp off")
    if expected_context is None:
        return profile, (f"MTP on: the profile's default launch; pass --expected-context TOKENS for {rule.source}'s "
                         f"rule (MTP off from {rule.off_from_context:,}-token prompts)")
    streams = concurrency or profile.running or 1
    at = f"expected context {expected_context:,} tokens at {streams} stream(s)"
    if expected_context >= rule.off_from_context:
        caveat = "; one stream at long context was not measured" if streams == 1 else ""
        return without_speculation(profile), f"MTP off: {at} >= {rule.off_from_context:,}: {rule.long_evidence}{caveat}"
    return profile, f"MTP on: {at} < {rule.off_from_context:,}: {rule.short_evidence}"
