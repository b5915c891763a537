"""vLLM general plugin for Qwen3.8 Flash-Next PLE offload (stdlib-only at import time).

The vLLM adapter over the kit's engine-neutral floors (``sglang_ssd_stream.patching``,
``.sidecar``, ``.staging``, ``.findings``):

- :mod:`.plugin`: the ``vllm.general_plugins`` entry point (fatal on failure);
- :mod:`.env`: every ``VLLM_PLE_*`` variable, parsed in one place for the plugin and the doctor;
- :mod:`.activate`: guard, checks, then arm the backend swap;
- :mod:`.post_import`: run a callback right after vLLM imports a module;
- :mod:`.embedding`: the PLE table classes swapped in (imports vLLM);
- :mod:`.doctor`: the checks (``vllm-ple-offload doctor`` and the plugin run the same);
- :mod:`.cli`: ``vllm-ple-offload``.
"""

LOGGER_NAME = "vllm.ple_offload"  # a child of vLLM's logger, so vLLM's handlers print it
