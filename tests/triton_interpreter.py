"""TEST-ONLY, never shipped: Triton's CPU interpreter (``TRITON_INTERPRET=1``) without the bookkeeping it repeats.

Every engine process the tests start runs the engine's Triton kernels in triton 3.8's interpreter, one Python
call per program; the servers' kernels run one program per token. Measured on the CPU box, 40-55 % of such a
kernel's time was not the kernel: the interpreter re-patches ``triton.language`` (four ``inspect.getmembers``
scans) at every launch *and at every call of a nested ``@jit`` function* (``tl.sigmoid``, a reduction's combine
function, ...), which is once per program. Two changes, both bookkeeping, none to what a kernel computes:

1. Within one launch, a nested call whose language modules this launch has already patched does not patch them
   again: the patches it would install are the ones in place (same members, same interpreter semantic). Its
   first patch of a module the launch has not patched yet is made as upstream makes it (and, as upstream, kept).
2. ``_patch_builtin`` lists a module's builtins once (they are fixed at import) and patches those whose current
   value is still a builtin: the members upstream's per-call ``inspect.getmembers`` scan selects.

Installed only on the interpreter source this module knows (``KNOWN``: SHA-256 of ``triton/runtime/interpreter.py``),
before any launch; any other source runs unchanged and says so once. ``tests/test_triton_interpreter.py`` runs
real engine kernels both ways and requires bit-identical outputs and the same ``triton.language`` state after a
launch. Loaded by the e2e servers' ``sitecustomize`` and by every engine check process (``-p`` plugin);
``SSD_TESTS_TRITON_INTERPRETER=upstream`` leaves the interpreter as shipped (to compare the two).
"""

from __future__ import annotations

import hashlib
import sys
import threading

# triton/runtime/interpreter.py of triton 3.8.0 (the one both engine venvs pin)
KNOWN = {"a17550ad6c58a2d903b64cc2eb8b89aeedc02f3b3f263b0a5a7bab43ef3d2435"}
PREFIX = "tests.triton_interpreter"
OFF_SWITCH = "SSD_TESTS_TRITON_INTERPRETER"  # "upstream": not installed
_tls = threading.local()
_state = {"installed": False, "said": False}


def _say(message: str) -> None:
    print(f"{PREFIX}: {message}", file=sys.stderr, flush=True)


def source_sha256(interp) -> str:
    with open(interp.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def install(interp=None) -> bool:
    """Install on ``triton.runtime.interpreter`` (imported here unless given); True when installed."""
    if _state["installed"]:
        return True
    if interp is None:
        import triton.runtime.interpreter as interp
    sha = source_sha256(interp)
    if sha not in KNOWN:
        if not _state["said"]:
            _state["said"] = True
            _say(f"{interp.__file__} has SHA-256 {sha}, not one this module knows; the interpreter runs unchanged")
        return False
    import inspect

    tl = interp.tl
    upstream_patch_lang = interp._patch_lang
    upstream_call = interp.GridExecutor.__call__
    names: dict[int, list[str]] = {}

    def _patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:
            listed = names[id(pkg)] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in listed:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                interp._patch_attr(pkg, name, member, builder, scope)

    class _Nothing:
        def restore(self) -> None:
            pass

    def _patch_lang(fn):
        done = getattr(_tls, "done", None)
        if done is None:  # not inside a launch: as upstream
            return upstream_patch_lang(fn)
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if langs <= done:
            return _Nothing()
        done |= langs
        return upstream_patch_lang(fn)

    def __call__(self, *args, **kwargs):
        outer = getattr(_tls, "done", None)
        _tls.done = set()  # filled by the launch's own patch (the kernel's modules) and by nested calls
        try:
            return upstream_call(self, *args, **kwargs)
        finally:
            _tls.done = outer

    interp._patch_builtin = _patch_builtin
    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = __call__
    _state["installed"] = True
    return True


def arm() -> None:
    """Install now if triton's interpreter is imported, else right after its import (a one-shot import hook)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(OFF_SWITCH) == "upstream":
        return
    mod = sys.modules.get("triton.runtime.interpreter")
    if mod is not None:
        install(mod)
        return
    import importlib.abc

    class _After(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "triton.runtime.interpreter":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                install(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _After())


# As a pytest plugin (``-p tests.triton_interpreter``, the engine check processes): arm at load.
arm()
