"""The vLLM row of the shared operate commands (:class:`~sglang_ssd_stream.operate.side.EngineSide`)."""

from __future__ import annotations

from sglang_ssd_stream.operate.side import EngineSide, console_script


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
    install_hint="./install.sh --engine vllm",
)
