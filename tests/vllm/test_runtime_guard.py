"""The runtime guard on throwaway packages (pure Python): what a source hash cannot see, it does.

Each case builds a tiny package with the shape of vLLM's watched code (a class with a plain method
and one wrapped by a watched decorator, a module-level function, the decorator itself), imports
it, and asks :func:`vllm_ple_offload.runtime_guard.check_entries` what Python will really call.
The real vLLM cases (through ``load_general_plugins()``) are in ``checks/check_plugin_bad_input.py``.
"""

from __future__ import annotations

import importlib
import os
import py_compile
import sys
import uuid
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.manifest import WatchEntry
from sglang_ssd_stream.patching.state import function_sha256
from vllm_ple_offload import runtime_guard

DECO = '''import functools


def trusted(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper
'''

MOD = '''import functools

from {pkg}.deco import trusted


def noop(fn):
    return fn


class Table:
    {lookup_decorator}def lookup(self, x):
        return x + 1

    @trusted
    def finish(self, x):
        return x * 2


def helper(x):
    return x - 1
'''

FUNCTIONS = [("mod.py", "Table.lookup"), ("mod.py", "Table.finish"), ("mod.py", "helper"), ("deco.py", "trusted")]


def build(root: Path, pkg: str, *, lookup_decorator: str = "") -> Path:
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / pkg / "deco.py").write_text(DECO)
    (root / pkg / "mod.py").write_text(MOD.format(pkg=pkg, lookup_decorator=lookup_decorator))
    return root


def entries(site: Path, pkg: str) -> list[WatchEntry]:
    out = []
    for name, function in FUNCTIONS:
        path = f"{pkg}/{name}"
        out.append(WatchEntry(id=function, path=path, function=function,
                              sha256=function_sha256((site / path).read_bytes(), function), why="test"))
    return out


@pytest.fixture
def pkg(monkeypatch, tmp_path):
    name = f"_guard_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def check(site: Path, pkg: str, watched=None) -> list[str]:
    watched = watched or entries(site, pkg)
    mod = importlib.import_module(f"{pkg}.mod")
    deco = importlib.import_module(f"{pkg}.deco")
    problems = runtime_guard.check_entries(mod, [w for w in watched if w.path.endswith("mod.py")], site, watched)
    return problems + runtime_guard.check_entries(deco, [w for w in watched if w.path.endswith("deco.py")], site,
                                                  watched)


def test_the_code_as_written_passes(tmp_path, pkg):
    site = build(tmp_path / "site", pkg)
    assert check(site, pkg) == []
    assert importlib.import_module(f"{pkg}.mod").Table().finish(3) == 6


@pytest.mark.parametrize("how", ["rebound", "wrapped"])
def test_a_method_changed_after_the_class_definition(tmp_path, pkg, how):
    import functools

    site = build(tmp_path / "site", pkg)
    mod = importlib.import_module(f"{pkg}.mod")
    original = mod.Table.lookup

    def other(self, x):
        return original(self, x)

    mod.Table.lookup = other if how == "rebound" else functools.wraps(original)(other)
    [problem] = check(site, pkg)
    assert problem.startswith(f"{pkg}/mod.py:Table.lookup as Python calls it is not the verified function")


def test_a_wrapper_of_another_decorator_around_a_decorated_method(tmp_path, pkg):
    import functools

    site = build(tmp_path / "site", pkg)
    mod = importlib.import_module(f"{pkg}.mod")
    released = mod.Table.__dict__["finish"]
    mod.Table.finish = functools.wraps(released)(lambda *a, **k: released(*a, **k))
    [problem] = check(site, pkg)
    assert problem.startswith(f"{pkg}/mod.py:Table.finish is not the wrapper @trusted builds")


def test_a_module_global_rebound(tmp_path, pkg):
    site = build(tmp_path / "site", pkg)
    mod = importlib.import_module(f"{pkg}.mod")
    mod.helper = lambda x: x
    [problem] = check(site, pkg)
    assert problem.startswith(f"{pkg}/mod.py:helper as Python calls it is not the verified function")


def test_a_decorator_added_in_the_source_is_invisible_to_the_hash_but_refused(tmp_path, pkg):
    plain = build(tmp_path / "plain", "plainpkg")
    site = build(tmp_path / "site", pkg, lookup_decorator="@noop\n    ")
    # The guard's source hash (the def segment) cannot tell the two files apart ...
    assert function_sha256((site / pkg / "mod.py").read_bytes(), "Table.lookup") == \
        function_sha256((plain / "plainpkg" / "mod.py").read_bytes(), "Table.lookup")
    # ... the runtime check can, even though @noop returns the function itself.
    [problem] = check(site, pkg)
    assert problem == f"{pkg}/mod.py:Table.lookup is decorated with @noop, which the kit does not verify"


def test_stale_bytecode_is_refused(tmp_path, pkg):
    """Python runs __pycache__'s code when the source's size and mtime match its record: the file says
    `x + 2`, the hash verifies `x + 2`, but `x + 1` would run."""
    site = build(tmp_path / "site", pkg)
    source = site / pkg / "mod.py"
    py_compile.compile(str(source), doraise=True)  # records this source's size and mtime
    st = source.stat()
    source.write_text(source.read_text().replace("return x + 1", "return x + 2"))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert importlib.import_module(f"{pkg}.mod").Table().lookup(1) == 2  # the stale bytecode runs
    [problem] = check(site, pkg)
    assert problem.startswith(f"{pkg}/mod.py:Table.lookup as Python calls it is not the verified function")
    assert "stale bytecode" in problem


def test_a_module_imported_from_somewhere_else(tmp_path, pkg, monkeypatch):
    verified = build(tmp_path / "verified", pkg)
    build(tmp_path / "site", pkg)  # what sys.path finds first
    problems = check(verified, pkg, entries(verified, pkg))
    assert problems and all("was imported from" in p and str(verified) in p for p in problems)


def test_a_source_changed_after_the_guard(tmp_path, pkg):
    site = build(tmp_path / "site", pkg)
    watched = entries(site, pkg)
    importlib.import_module(f"{pkg}.mod")
    source = site / pkg / "mod.py"
    source.write_text(source.read_text().replace("return x - 1", "return x - 2"))
    assert check(site, pkg, watched) == [f"{pkg}/mod.py:helper: its source changed after the guard verified it"]


def test_module_names():
    assert runtime_guard.module_name("vllm/models/qwen4_exp/common/ple.py") == "vllm.models.qwen4_exp.common.ple"
    assert runtime_guard.module_name("vllm/compilation/__init__.py") == "vllm.compilation"
