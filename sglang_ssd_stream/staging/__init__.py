"""Engine-neutral GPU staging of PLE sidecar rows, shared by the SGLang hooks and the vLLM backends.

- :mod:`.gather`: :class:`~.gather.SidecarGather`, ids on the device -> sidecar rows in fixed pinned
  host memory -> rows on the device (converted to BF16 for SGLang, raw lookup-dtype bytes for
  vLLM), eager (a worker thread) or captured in a CUDA graph;
- :mod:`.native_read` (+ ``native_read.c``): the captured read as a native host-node function;
- :mod:`.hostfunc`: ``cuLaunchHostFunc``;
- :mod:`.kernels`: the FP8/BF16 -> BF16 conversion kernel (Triton);
- :mod:`.host_memory`: page-aligned CUDA-registered host memory and its accounting.
- :mod:`.verify_rows`: an MTP verify step's tokens and n-gram histories copied off the device for the
  prefetch thread, with an event it waits for (the engine never does).

Imports neither sglang nor vllm (``tests/test_import_boundaries.py``). Importing the package
imports nothing heavy; :mod:`.gather`/:mod:`.kernels` need torch and triton.
"""

LOGGER_NAME = "sglang_ssd_stream.staging"
