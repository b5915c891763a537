"""Patches and plugins for serving Qwen3.8 Flash-Next (qwen4_exp) on SGLang and vLLM.

Stdlib-only at import time: the engines load this package from their plugin entry points,
and an import error there would be logged and ignored instead of stopping the worker.
"""

__version__ = "0.1.0"
