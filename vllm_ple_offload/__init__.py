"""vLLM general plugin for Qwen3.8 Flash-Next PLE offload (stdlib-only at import time).

Modules: ``plugin`` (the entry point), ``env`` (every ``VLLM_PLE_*`` variable), ``activate``
(guard, preflight, backend swap), ``hook`` (post-import callbacks), ``preflight``, ``guard``,
``host_memory``, ``row_sources``, ``streaming``, ``backends`` (imports vLLM), ``cli``.
"""

LOGGER_NAME = "vllm.ple_offload"  # a child of vLLM's logger, so vLLM's handlers print it
