"""The runtime half of the source guard: the objects vLLM calls are the functions whose source was verified.

:mod:`sglang_ssd_stream.patching.guard` hashes the source of every ``watch`` entry of the
manifest (the vLLM code the PLE backends rely on without patching it). A source hash alone passes
a watched method rebound after its class is defined, a wrapper put around it (in the file or at
run time), a module global rebound, a module imported from somewhere else, or stale bytecode in
``__pycache__``. So, right after vLLM imports a watched module (:mod:`.post_import`), each watched
function is checked *as Python will call it*:

1. the module was loaded from the verified file, and that file's function still has the recorded
   source hash (read once here; this is the source compiled below);
2. the live object, looked up with ``vars()`` on the module and class (never an inherited or
   rebound attribute), is a plain function;
3. each decorator in the verified source is itself a watched function, and the live object is
   the wrapper that decorator builds (its code object equals one compiled from the decorator's
   verified source, and ``__wrapped__`` leads inwards);
4. the innermost function's code object equals the one compiled from the verified source
   (bytecode, constants, names, line table: CPython's code equality).

Not covered (README): what happens after the check (a later monkeypatch), globals and callees
that watched functions use without being watched themselves, default values and closure cells,
and compiled kernels (C++, CUDA, Triton).
"""

from __future__ import annotations

import ast
import os
import types
from collections.abc import Iterable
from pathlib import Path

from sglang_ssd_stream.errors import RefusedSourceState
from sglang_ssd_stream.patching.state import function_node


def module_name(path: str) -> str:
    """``vllm/models/x.py`` -> ``vllm.models.x`` (a package's ``__init__.py`` -> the package)."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _code_of(code: types.CodeType, qualname: str) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_qualname == qualname:
                return const
            found = _code_of(const, qualname)
            if found is not None:
                return found
    return None


def _nested_codes(code: types.CodeType) -> list[types.CodeType]:
    out = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += [const, *_nested_codes(const)]
    return out


class _Verified:
    """One watched file as verified: its bytes, module code and AST (read once)."""

    def __init__(self, site_packages: Path, path: str):
        self.path = site_packages / path
        self.rel = path
        self.data = self.path.read_bytes()
        self.code = compile(self.data, str(self.path), "exec", dont_inherit=True)
        self.tree = ast.parse(self.data)
        self._functions = None  # made at the first hash, on the parse above

    def sha256(self, qualname: str) -> str | None:
        from sglang_ssd_stream.patching.state import SourceFunctions

        if self._functions is None:
            self._functions = SourceFunctions(self.data, self.tree)
        return self._functions.sha256(qualname)


def _live(module, qualname: str):
    owner, parts = module, qualname.split(".")
    for part in parts[:-1]:
        owner = vars(owner).get(part)
        if not isinstance(owner, type):
            return None, f"{'.'.join(parts[:-1])} is {owner!r}, not the class the source defines"
    raw = vars(owner).get(parts[-1])
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    if not isinstance(raw, types.FunctionType):
        return None, f"is {raw!r}, not a function"
    return raw, None


_OWN_WRAPPERS: set[types.CodeType] = set()  # code of the kit's own wrappers around watched functions


def own_wrapper(fn: types.FunctionType) -> None:
    """Declare ``fn`` (a wrapper whose ``__wrapped__`` is the watched function) the kit's own: a check
    after it was installed (a second ``register()``, a module imported again) looks through it."""
    _OWN_WRAPPERS.add(fn.__code__)


def _through_own_wrappers(live):
    while (isinstance(live, types.FunctionType) and live.__code__ in _OWN_WRAPPERS
           and isinstance(getattr(live, "__wrapped__", None), types.FunctionType)):
        live = live.__wrapped__
    return live


def check_entries(module, entries: Iterable, site_packages: Path, all_entries: Iterable) -> list[str]:
    """Problems with the live objects of ``entries`` (watch entries of ``module``); empty when all hold.

    ``all_entries`` are every watch entry of the manifest: a decorator in the verified source is
    accepted only when it is one of them."""
    entries = list(entries)
    if not entries:
        return []
    problems: list[str] = []
    files: dict[str, _Verified] = {}

    def verified(path: str) -> _Verified:
        if path not in files:
            files[path] = _Verified(site_packages, path)
        return files[path]

    first = verified(entries[0].path)
    loaded = getattr(module, "__file__", None)
    if loaded is None or os.path.realpath(loaded) != os.path.realpath(first.path):
        return [f"{module.__name__} was imported from {loaded}, not from the verified {first.path}"]
    decorators = {}  # decorator name -> code objects of the wrappers its verified source builds
    for w in all_entries:
        if "." not in w.function and w.path.endswith(".py"):
            src = verified(w.path)
            code = _code_of(src.code, w.function)
            if code is not None and src.sha256(w.function) == w.sha256:
                decorators[w.function] = _nested_codes(code)
    for w in entries:
        src = verified(w.path)
        where = f"{w.path}:{w.function}"
        if src.sha256(w.function) != w.sha256:
            problems.append(f"{where}: its source changed after the guard verified it")
            continue
        expected, node = _code_of(src.code, w.function), function_node(src.tree, w.function)
        live, why = _live(module, w.function)
        live = _through_own_wrappers(live)
        if live is None or expected is None or node is None:
            problems.append(f"{where} {why or 'is missing from the compiled source'}")
            continue
        for deco in node.decorator_list:
            name = ast.unparse(deco)
            wrappers = decorators.get(name)
            if wrappers is None:
                problems.append(f"{where} is decorated with @{name}, which the kit does not verify")
                break
            inner = getattr(live, "__wrapped__", None)
            if not any(live.__code__ == c for c in wrappers) or not isinstance(inner, types.FunctionType):
                problems.append(f"{where} is not the wrapper @{name} builds (its code is "
                                f"{live.__code__.co_filename}:{live.__code__.co_firstlineno})")
                break
            live = inner
        else:
            if live.__code__ != expected:
                problems.append(f"{where} as Python calls it is not the verified function (its code is "
                                f"{live.__code__.co_qualname} at {live.__code__.co_filename}:"
                                f"{live.__code__.co_firstlineno}: rebound, wrapped or stale bytecode)")
    return problems


def checks() -> dict:
    """{module name: callback(module)} checking that module's watched functions; the caller runs each
    right after vLLM imports the module (:mod:`.post_import`). A callback raises
    :class:`~sglang_ssd_stream.errors.RefusedSourceState`, failing that import, on any unverifiable one."""
    from sglang_ssd_stream.patching.commands import select_manifest
    from sglang_ssd_stream.patching.engines import ENGINES
    from sglang_ssd_stream.patching.target import from_this_process

    target = from_this_process(ENGINES["vllm"])
    manifest, _ = select_manifest(target)
    by_module: dict[str, list] = {}
    for w in manifest.watch:
        by_module.setdefault(module_name(w.path), []).append(w)

    def checker(entries):
        def check(module) -> None:
            problems = check_entries(module, entries, target.site_packages, manifest.watch)
            if problems:
                raise RefusedSourceState(
                    f"vllm {manifest.release}: the code vLLM runs is not the code the kit verified: "
                    + "; ".join(problems) + f". Reinstall vllm=={manifest.release} as released (pip install "
                    f"--force-reinstall --no-deps vllm=={manifest.release}), then vllm-ple-offload patch apply; "
                    f"remove any other plugin that rewraps these functions")
        return check

    return {name: checker(entries) for name, entries in by_module.items()}
