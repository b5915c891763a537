"""Errors of the vLLM plugin, on top of the kit's closed set (``sglang_ssd_stream.errors``).

Both subclass a builtin and pickle like every kit error: they are raised inside vLLM worker
processes and may cross to the parent.
"""

from __future__ import annotations

from sglang_ssd_stream.errors import EXIT_ENVIRONMENT, EXIT_USAGE, KitError


class PleSettingsError(KitError, ValueError):
    """A ``VLLM_PLE_*`` variable has a bad value, or the variables contradict each other."""

    exit_code = EXIT_USAGE


class PreflightFailed(KitError, RuntimeError):
    """The machine or process cannot run the configured PLE backend (each finding names its fix)."""

    exit_code = EXIT_ENVIRONMENT
