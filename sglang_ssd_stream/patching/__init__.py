"""Engine-neutral patch core: manifests, strict diff application, file states, transactions.

Imports neither sglang nor vllm; both engine sides (``sglang-ssd-stream patch`` and
``vllm-ple-offload patch``) drive the same code with a different ``Engine``.
"""

from .engines import ENGINES, Engine

__all__ = ["ENGINES", "Engine", "Manifest", "load_manifest", "known_manifests", "FileState", "survey"]
_LAZY = {"Manifest": "manifest", "load_manifest": "manifest", "known_manifests": "manifest", "FileState": "state",
         "survey": "state"}


def __getattr__(name: str):
    # Lazy: the plugins' top levels import .engines (stdlib-only); the manifest needs `packaging`.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
