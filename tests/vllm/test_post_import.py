"""Post-import callbacks on throwaway modules (never vLLM's)."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

from vllm_ple_offload import post_import as hook


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    name = f"_ple_hook_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "table.py").write_text("class Upstream:\n    pass\nchosen = Upstream\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def test_callback_runs_after_the_module_body(pkg):
    seen = []

    def swap(module):
        seen.append(module.chosen.__name__)  # the body has run
        module.chosen = type("Ours", (module.Upstream,), {})

    hook.when_imported(f"{pkg}.table", swap)
    assert seen == []  # nothing imported yet: nothing done
    module = importlib.import_module(f"{pkg}.table")
    assert seen == ["Upstream"] and module.chosen.__name__ == "Ours"
    assert hook.registered(f"{pkg}.table") == 1


def test_already_imported_module_gets_the_callback_at_once(pkg):
    module = importlib.import_module(f"{pkg}.table")
    hook.when_imported(f"{pkg}.table", lambda m: setattr(m, "chosen", int))
    assert module.chosen is int


def test_callback_failure_fails_the_import(pkg):
    def broken(module):
        raise RuntimeError("swap refused")

    hook.when_imported(f"{pkg}.table", broken)
    with pytest.raises(RuntimeError, match="swap refused"):
        importlib.import_module(f"{pkg}.table")
    assert f"{pkg}.table" not in sys.modules  # no half-initialised module stays behind


def test_unrelated_imports_are_untouched(pkg):
    hook.when_imported(f"{pkg}.other", lambda m: (_ for _ in ()).throw(AssertionError("must not run")))
    module = importlib.import_module(f"{pkg}.table")
    assert module.chosen.__name__ == "Upstream"
