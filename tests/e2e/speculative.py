"""The Thor profile's speculative launch (NEXTN 3/1/4), made to run on this CPU (issue 30 item 1).

The flags come from the profile itself (``sglang-ssd-stream serve --profile thor`` prints the same table), so
a change to the profile changes what the e2e suite serves. Each flag is kept, scaled (context, pool, chunk:
sizes only), or dropped with the reason the CPU cannot take it; a flag this table does not know fails the
suite, so a new profile flag is decided here, never silently passed or lost.
"""

from __future__ import annotations

from pathlib import Path

from sglang_ssd_stream.operate.capacity import mamba_slots_needed, mamba_slots_per_request_of
from sglang_ssd_stream.operate.profiles import get_profile

from .server import CAPS

PROFILE = "thor"

# flag -> why the CPU server leaves it out
DROPPED = {
    "--model-path": "the tiny qwen4_exp is given by the harness",
    "--trust-remote-code": "sglang ships qwen4_exp; nothing remote to trust",
    "--quantization": "NVFP4 (modelopt_fp4) needs Blackwell kernels; the tiny checkpoint is BF16",
    "--fp4-gemm-backend": "an FP4 GEMM backend (flashinfer_cutlass): GPU only",
    "--kv-cache-dtype": "sglang's CPU FP8 KV cache needs Intel AMX (kv_cache_configurator.py raises without it)",
    "--speculative-draft-kv-cache-dtype": "FP8 draft KV: same AMX refusal, measured here; the draft KV is BF16",
    "--attention-backend": "triton on SM110; the CPU engine picks torch_native",
    "--moe-runner-backend": "flashinfer_cutlass: GPU only",
    "--cuda-graph-max-bs-decode": "no CUDA graphs on CPU",
    "--disable-prefill-cuda-graph": "no CUDA graphs on CPU",
    "--mem-fraction-static": "the pool is fixed by --max-total-tokens (CAPS)",
    "--enable-linear-replayssm-spec": ("ReplaySSM's Triton kernel refuses the tiny model's geometry "
                                       "(BKT=8 must be >=16 for tl.dot, measured here)"),
    "--enable-multimodal": "no test sends images; the processor is still built at start",
    "--reasoning-parser": "the tiny tokenizer has no reasoning markers",
    "--tool-call-parser": "the tiny tokenizer has no tool-call markers",
    "--sleep-on-idle": "already in CAPS",
}
# flag -> the CPU-sized value (only sizes change)
SCALED = {
    "--context-length": None,  # CAPS: 256
    "--max-total-tokens": None,  # CAPS: 4096
    "--chunked-prefill-size": "128",
}
KEPT = {
    "--page-size", "--mamba-radix-cache-strategy", "--mamba-track-interval", "--mamba-ssm-dtype",
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--enable-metrics", "--allow-auto-truncate", "--max-running-requests",
    "--max-mamba-cache-size",
}


def mtp_args(draft: Path, *, mamba_slots: int | None = None) -> list[str]:
    """The profile's flags for ``draft`` on this CPU; ``mamba_slots`` overrides the profile's Mamba cache."""
    profile = get_profile(PROFILE, "sglang")
    out: list[str] = []
    for flag, value in profile.args:
        if flag in DROPPED:
            continue
        if flag in SCALED:
            if SCALED[flag] is None:
                assert flag in CAPS, flag
                continue
            value = SCALED[flag]
        elif flag not in KEPT:
            raise AssertionError(f"profile {PROFILE} sets {flag}: decide in tests/e2e/speculative.py whether the "
                                 "CPU server keeps, scales or drops it")
        if flag == "--speculative-draft-model-path":
            value = str(draft)
        if flag == "--speculative-eagle-topk" and value != "1":
            # the CPU stand-in verifies a chain only (its tree verify raises NotImplementedError)
            raise AssertionError(f"profile {PROFILE} drafts a tree (topk {value}): stand in for tree verify first")
        if flag == "--max-mamba-cache-size" and mamba_slots is not None:
            value = str(mamba_slots)
        out += [flag] if value is None else [flag, value]
    return out


def profile_value(flag: str) -> str:
    return get_profile(PROFILE, "sglang").value(flag)


def running() -> int:
    return int(profile_value("--max-running-requests"))


def draft_steps() -> int:
    return int(profile_value("--speculative-num-steps"))


def planned_mamba_slots() -> int:
    """What the planner says the profile's running requests need (its own radix-cache setup)."""
    profile = get_profile(PROFILE, "sglang")
    per = mamba_slots_per_request_of(lambda f: profile.value(f) if profile.has(f) else None, profile.has)
    return mamba_slots_needed(running(), per)
