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
class Profile:
    name: str
    engine: str  # "sglang" | "vllm"
    summary: str
    args: tuple[tuple[str, str | None], ...]  # (flag, value); None = bare switch
    env: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    port: int = 8000
    default_served_name: str | None = None
    needs_sidecar: bool = False  # preflight: the model dir must hold a valid ssd-stream.json
    needs_draft: bool = False  # NEXTN draft (the MTP directory) must exist

    def value(self, flag: str) -> str | None:
        """The value a profile gives ``flag`` (KeyError when it does not set it)."""
        for f, v in self.args:
            if f == flag:
                return v
        raise KeyError(f"profile {self.name} does not set {flag}")

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.args)


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
    ("--allow-auto-truncate", None),  # page-safe with patch 0001: keeps the client's output budget
    ("--enable-multimodal", None),
    ("--reasoning-parser", "auto"),
    ("--tool-call-parser", "auto"),
)

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
    }),
    port=8000,
    needs_sidecar=True,
    needs_draft=True,
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
    }),
    port=30000,
    needs_sidecar=True,
    needs_draft=True,
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
)

PROFILES: MappingProxyType = MappingProxyType({p.name: p for p in (_THOR, _DISCRETE, _A100X4)})

def profiles_for(engine: str) -> list[str]:
    return [name for name, p in PROFILES.items() if p.engine == engine]


def get_profile(name: str, engine: str) -> Profile:
    from .errors import ServeRefused

    p = PROFILES.get(name)
    if p is None or p.engine != engine:
        raise ServeRefused(f"unknown {engine} profile {name!r}; known: {', '.join(profiles_for(engine))}")
    return p
