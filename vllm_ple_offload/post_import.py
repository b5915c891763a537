"""Run a callback right after a named module is imported (stdlib only).

The plugin must not import vLLM's model code itself: ``register()`` also runs while the CLI
parses arguments and in the API server, where importing ``vllm.models.qwen4_exp`` costs seconds
and pulls Triton. So the backend swap waits for the import that the model build does anyway:
a ``sys.meta_path`` finder wraps the target module's loader, and the callback runs after the
module body, before anyone can use it. A module that is already imported gets the callback at
once. An exception in a callback propagates out of the ``import`` statement, so a failed swap
stops the model build (and the worker) instead of leaving upstream's class in place.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

Callback = Callable[[object], None]

_lock = threading.RLock()
_callbacks: dict[str, list[Callback]] = {}
_finder: _PostImportFinder | None = None


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader, name: str):
        self._wrapped = wrapped
        self._name = name

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module) -> None:
        self._wrapped.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, attr):  # get_source, get_code, is_package, … stay the original loader's
        return getattr(self._wrapped, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # let the other finders locate the real module
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def _run(name: str, module) -> None:
    with _lock:
        pending = list(_callbacks.get(name, ()))
    for callback in pending:
        callback(module)


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` after ``name`` is imported (now, if it already is)."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
        _callbacks.setdefault(name, []).append(callback)
        module = sys.modules.get(name)
    if module is not None:
        callback(module)


def registered(name: str) -> int:
    """How many callbacks wait for (or ran on) ``name``; for tests and ``doctor``."""
    with _lock:
        return len(_callbacks.get(name, ()))
