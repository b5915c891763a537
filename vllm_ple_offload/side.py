"""The vLLM row of the shared operate commands (:class:`~sglang_ssd_stream.operate.side.EngineSide`)."""

from __future__ import annotations

from sglang_ssd_stream.operate.side import EngineSide, console_script

from . import env
from .doctor import INSTALL_FIX
from .metrics import METRICS


def _preflight(**launch) -> list:
    from . import doctor

    return doctor.preflight(**launch)


SIDE = EngineSide(
    name="vllm",
    display="vLLM",
    tool="vllm-ple-offload",
    launcher=console_script("vllm"),
    preflight=_preflight,
    service="compose",
    # PLE IPC across processes fails with pidfd_getfd EPERM under expandable segments (write-up 002).
    forbidden_env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),),
    install_hint=INSTALL_FIX,
    overlong="refuse",  # vLLM 0.33 answers a prompt over --max-model-len with HTTP 400 (no auto-truncate)
    # Inherited VLLM_PLE_* (and vLLM's plugin allowlist) change what the plugin does: the printed command shows them.
    shown_env=(env.PREFIX, env.PLUGINS_ENV),
    # The streamed backends' fetch pool: serve sizes it to the CPU quota when the launch streams and leaves it unset.
    thread_knobs=((env.FETCH_WORKERS, None),),
    metrics=METRICS,  # what `watch` reads from vLLM's /metrics
    fresh_metrics_dir=True,  # vLLM's workers reach /metrics only through PROMETHEUS_MULTIPROC_DIR
    # `plan` speaks vLLM's flags; vLLM has no pool or Mamba-slot flag (it sizes both from what fits), so
    # those two plan inputs get plain names.
    # The row cache of the streamed backends (the default `pinned` table has none): `plan` counts it.
    row_cache_knob=(env.ROW_CACHE_MB, env.DEFAULT_ROW_CACHE_MB),
    row_cache_when=(env.BACKEND, env.DEFAULT_BACKEND, env.STREAMING_BACKENDS),
    plan_flags=(("--context-length", "--max-model-len"), ("--max-running-requests", "--max-num-seqs"),
                ("--speculative-num-steps", "--num-speculative-tokens"), ("--page-size", "--block-size"),
                ("--mem-fraction", "--gpu-memory-utilization"), ("--max-total-tokens", "--pool-tokens"),
                ("--max-mamba-cache-size", "--mamba-slots")),
)
