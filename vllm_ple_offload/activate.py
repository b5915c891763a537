"""What the plugin does when ``VLLM_PLE_CPU_OFFLOAD=1``: guard, preflight, then arm the swap.

At ``register()`` (every vLLM process): the source verdict and the doctor's checks, the same
:func:`.doctor.run_checks` that ``vllm-ple-offload doctor`` runs. Then, right after vLLM imports a
module (:mod:`.post_import`, i.e. only in processes that build a qwen4_exp model): every watched
vLLM function is checked as Python will call it (:mod:`.runtime_guard`); with a streamed backend
the sidecar's SHA-256 is checked once per process (:func:`.doctor.require_verified_sidecar`,
the shared verifier and its cache); then the swap:

=====================================================  ==============================================
``vllm.models.qwen4_exp.nvidia.ngram_embedding``       ``Qwen4ExpPLEPinnedHostEmbedding`` -> our class
                                                       (read by ``Qwen4ExpNGramEmbedding.__init__`` at
                                                       construction); ``Qwen4ExpPLEDeviceEmbedding`` ->
                                                       a class refusing ``cpu_offload: false``
``vllm.models.qwen4_exp.amd.ple_layer``                refused on ROCm (not verified there)
``vllm.v1.worker.gpu.model_runner`` (row cache on)     ``GPUModelRunner.load_model`` builds the prompt-ahead
                                                       prefetcher, ``update_requests`` feeds it
                                                       (:mod:`.prompt_prefetch`)
``vllm.v1.worker.gpu_model_runner`` (row cache on)     the V1 runner refuses to start (prefetch is V2's)
=====================================================  ==============================================
"""

from __future__ import annotations

import logging
import os
import sys

from . import LOGGER_NAME, env, post_import

log = logging.getLogger(LOGGER_NAME)

NVIDIA_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
AMD_MODULE = "vllm.models.qwen4_exp.amd.ple_layer"
COMMON_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"


def install_nvidia(settings: env.PleSettings):
    def callback(module) -> None:
        import importlib

        from .embedding import (
            RefusedDeviceEmbedding,
            RegisteredPinnedPLEEmbedding,
            StreamedPLEEmbedding,
            select_backend,
        )

        if settings.streaming:
            from .runtime_checks import require_verified_sidecar

            require_verified_sidecar(settings)  # before any row can be read; once per process
        common = importlib.import_module(COMMON_MODULE)
        ours = (StreamedPLEEmbedding, RegisteredPinnedPLEEmbedding)
        current = getattr(module, "Qwen4ExpPLEPinnedHostEmbedding", None)
        if current is not common.Qwen4ExpPLEPinnedHostEmbedding and current not in ours:
            raise RuntimeError(f"{NVIDIA_MODULE}.Qwen4ExpPLEPinnedHostEmbedding is {current!r}, not vLLM's class; "
                               f"another plugin replaced it, refusing to stack on top")
        if getattr(module, "Qwen4ExpPLEDeviceEmbedding", None) not in (common.Qwen4ExpPLEDeviceEmbedding,
                                                                      RefusedDeviceEmbedding):
            raise RuntimeError(f"{NVIDIA_MODULE}.Qwen4ExpPLEDeviceEmbedding is not vLLM's class; refusing")
        cls = select_backend(settings)
        module.Qwen4ExpPLEPinnedHostEmbedding = cls
        module.Qwen4ExpPLEDeviceEmbedding = RefusedDeviceEmbedding
        log.info("vllm-ple-offload: qwen4_exp PLE tables use %s (%s) in pid %d", cls.__name__, settings.describe(),
                 os.getpid())
    return callback


def refuse_rocm(module) -> None:
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        from .errors import PreflightFailed

        raise PreflightFailed(f"vllm-ple-offload: the PLE backends are not verified on ROCm; unset "
                              f"{env.CPU_OFFLOAD} to use vLLM's own ROCm PLE path")


def activate(settings: env.PleSettings) -> None:
    """Guard and preflight (fatal on any error finding), then arm the swap."""
    from sglang_ssd_stream.findings import OK, WARNING
    from sglang_ssd_stream.patching.guard import verdict

    from . import doctor, runtime_guard

    findings = verdict("vllm").findings(allow_unpatched=settings.allow_unpatched)
    findings += doctor.run_checks(settings, doctor.gather_facts(settings))
    for f in findings:
        if f.level == WARNING:
            log.warning("vllm-ple-offload: %s", f.line())
        elif f.level == OK and f.check == "source":  # the evidence, per process, that the guard ran and passed:
            # printed, as SGLang's plugin does, since vLLM sets up logging in the API server after plugins run
            print(f"vllm-ple-offload plugin: pid {os.getpid()}: {f.line()}", file=sys.stderr, flush=True)
    doctor.raise_on_errors(findings)
    allow_stop_write(settings)
    guard = runtime_guard.checks()
    then = {NVIDIA_MODULE: install_nvidia(settings), AMD_MODULE: refuse_rocm}
    if settings.prefetch:  # a streamed backend with a row cache: prompt-ahead prefetch in the worker
        from . import prompt_prefetch

        then[prompt_prefetch.RUNNER_V2] = prompt_prefetch.install_v2(settings)
        then[prompt_prefetch.RUNNER_V1] = prompt_prefetch.refuse_v1(settings)
    for name in sorted(guard.keys() | then.keys()):
        post_import.when_imported(name, _in_order(guard.get(name), then.get(name)))


def allow_stop_write(settings: env.PleSettings, environ=os.environ) -> bool:
    """With the hot file on, give a stop the time to write it: :data:`.env.STOP_GRACE_ENV` (vLLM's own bound on
    its shutdown, read when the server stops) set to :data:`.env.STOP_GRACE_S` unless the operator set it. Runs
    in the API server before vLLM starts the engine core, which inherits it (and hands it to its workers).
    Returns whether it was set here."""
    if not settings.hot_share_pct or env.STOP_GRACE_ENV in environ:
        return False
    environ[env.STOP_GRACE_ENV] = str(env.STOP_GRACE_S)
    # printed, not logged: vLLM sets up logging in the API server after plugins run (the children inherit the
    # variable, so only the launcher says it)
    print(f"vllm-ple-offload plugin: pid {os.getpid()}: {env.STOP_GRACE_ENV}={env.STOP_GRACE_S} (unset: vLLM "
          f"would kill the engine at a stop before it writes the PLE hot file)", file=sys.stderr, flush=True)
    return True


def _in_order(*callbacks):
    """One post-import callback running ``callbacks`` in order (the guard's check before the swap)."""
    def run(module) -> None:
        for callback in callbacks:
            if callback is not None:
                callback(module)
    return run
