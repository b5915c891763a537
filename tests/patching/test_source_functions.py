"""A watched function's hash from a file parsed once (state.SourceFunctions) equals the one ``ast`` gives it.

The guard hashes every watched function at each engine process's start; eight of sglang's live in one file.
SourceFunctions parses and splits a file once for all of them; these tests hold its segments to
``ast.get_source_segment`` on awkward sources and on every function of the installed engine's watched files.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

import pytest

from sglang_ssd_stream.patching import guard, state
from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests
from sglang_ssd_stream.patching.state import SourceFunctions, function_node, function_sha256

AWKWARD = [
    "def f():\n    return 1\n",
    "def f():\n    return 1",  # no newline at the end
    "class A:\r\n    def m(self):\r\n        return 'x'\r\n\r\ndef g(): pass\r\n",  # CRLF
    "class A:\r    def m(self):\r        return 2\rdef g(): pass",  # old Mac line ends
    "def f():\n    x = 1\f\n    return x\n\fdef g():\n    return 'a\\fb'\n",  # form feeds stay inside lines
    "def héllo():\n    return 'ünïcode → ✓'\n\nclass Ω:\n    def μ(self): return 'ß'\n",  # multi-byte columns
    "@decorator\ndef f(a,\n      b):\n    return a + b\n\nasync def g():\n    await f\n",
    "class A:\n    class B:\n        def m(self):\n            def inner():\n                return 1\n"
    "            return inner\n",
    "x = 1; def_ = 2\ndef f(): return 3  # one line\n",
    "def f():\n    s = '''a\r\nb\rc\n'''\n    return s\n",  # line ends inside a string
]


def _qualnames(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _qualnames(node, name + ".")


def _expected(text: str, node: ast.AST) -> str | None:
    seg = ast.get_source_segment(text, node)
    return None if seg is None else hashlib.sha256(seg.encode()).hexdigest()


@pytest.mark.parametrize("text", AWKWARD, ids=range(len(AWKWARD)))
def test_segments_equal_ast_get_source_segment(text):
    parsed = SourceFunctions(text.encode())
    names = list(_qualnames(parsed.tree))
    assert names
    for qualname, node in names:
        assert parsed.segment(node) == ast.get_source_segment(text, node), qualname
        assert parsed.sha256(qualname) == function_sha256(text.encode(), qualname) == _expected(text, node)
    assert parsed.sha256("no_such_function") is None and parsed.sha256("A.no_such_method") is None


def _installed_watch_files() -> list[tuple[Path, list[str]]]:
    """The watched files of the pinned sglang manifest in the sglang install these tests run in (the sglang venv:
    scripts/test.sh), each with its watched functions."""
    spec = importlib.util.find_spec(ENGINES["sglang"].package)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("sglang is not importable here: run the tests through scripts/test.sh (the sglang venv)")
    site = Path(next(iter(spec.submodule_search_locations))).parent
    manifest = next(m for m in known_manifests(ENGINES["sglang"]) if m.release == ENGINES["sglang"].pinned)
    by_path: dict[str, list[str]] = {}
    for w in manifest.watch:
        by_path.setdefault(w.path, []).append(w.function)
    return [(site / p, fns) for p, fns in by_path.items()]


def test_every_function_of_the_installed_watched_files_hashes_as_before():
    checked = 0
    for path, watched in _installed_watch_files():
        data = path.read_bytes()
        text = data.decode()
        parsed = SourceFunctions(data)
        for qualname, node in _qualnames(parsed.tree):
            if function_node(parsed.tree, qualname) is not node:  # a later def of the same name shadows it
                continue
            assert parsed.sha256(qualname) == _expected(text, node), f"{path}:{qualname}"
            checked += 1
        for fn in watched:
            assert parsed.sha256(fn) == function_sha256(data, fn), f"{path}:{fn}"
    assert checked > 100


def test_the_guard_parses_each_watched_file_once(monkeypatch):
    files = _installed_watch_files()
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(state.ast, "parse", lambda text, *a, **k: (parsed.append(text), real_parse(text, *a, **k))[1])
    v = guard.verdict("sglang")
    watched = [w for _, fns in files for w in fns]
    assert v.watch_ok + len(v.watch_changed) == len(watched)
    assert len(parsed) == len(files) < len(watched)  # one parse per file, fewer than the functions
