"""TEST-ONLY CPU STAND-IN, never shipped: loaded by every Python process of a vLLM server the e2e tests start
(this directory is put on PYTHONPATH of the server, nowhere else). It only arms an import hook; the stand-ins
themselves live in vllm_cpu_standin.py. Their numbers prove nothing about kernels."""

try:
    import vllm_cpu_standin

    vllm_cpu_standin.arm()
    import tests.triton_interpreter  # noqa: F401 - arms itself: the interpreter without its repeated bookkeeping
except Exception as exc:  # noqa: BLE001 - a broken stand-in must be loud, not silently absent
    import sys

    print(f"vllm_cpu_standin: failed to arm: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    raise
