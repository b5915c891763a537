"""The house's import rules, read from the source (every import, also inside functions and
``importlib.import_module``/``pkgutil.resolve_name`` look-ups by string):

- the engine-neutral floors import no engine: ``patching/``, ``sidecar/``, ``checks/``, ``findings``, ``errors``,
  ``paths`` import neither sglang, vllm, torch nor triton; ``staging/`` imports neither engine;
- only the SGLang adapter (``sglang_ssd_stream/sglang/``) imports sglang, only ``vllm_ple_offload``
  imports vllm, and neither adapter imports the other;
- the floors never import the adapters or ``operate``;
- ``operate/`` (the shared operations layer) imports neither adapter: engine specifics are passed in;
- there is no import cycle among our modules, nor among our subpackages.

Plus runtime checks that the floors really import with the engines blocked.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sglang_ssd_stream", "vllm_ple_offload")
FLOORS = ("sglang_ssd_stream.patching", "sglang_ssd_stream.sidecar", "sglang_ssd_stream.findings",
          "sglang_ssd_stream.errors", "sglang_ssd_stream.paths", "sglang_ssd_stream.env_numbers",
          "sglang_ssd_stream.checks", "sglang_ssd_stream.knobs", "sglang_ssd_stream.atomic_file",
          "sglang_ssd_stream.ple_metrics")
STAGING = "sglang_ssd_stream.staging"
SGLANG_ADAPTER = "sglang_ssd_stream.sglang"
OPERATE = "sglang_ssd_stream.operate"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module: str, level: int, name: str | None) -> str:
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    if level:
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))
    return name or ""


def _string_target(node: ast.Call) -> str | None:
    """``importlib.import_module("x.y")`` / ``pkgutil.resolve_name("x.y:z")`` with a literal."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in ("import_module", "resolve_name", "find_spec") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.split(":")[0]
        if isinstance(arg, ast.Name):
            return f"<variable {arg.id}>"
    return None


def imports_of(module: str) -> set[str]:
    """Every module name ``module`` imports, statically or by a string literal."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
                 and isinstance(n.value.value, str)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Call):
            target = _string_target(node)
            if target and target.startswith("<variable "):
                target = constants.get(target[10:-1])
            if target:
                while target and target not in MODULES and "." in target and target.split(".")[0] in PACKAGES:
                    target = target.rpartition(".")[0]  # "pkg.mod.Class.attr" -> "pkg.mod"
                found.add(target)
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_scanner_sees_every_kind_of_import():
    """Guard against a vacuous scan: the module that looks up sglang targets by string is seen to."""
    hooks = imports_of("sglang_ssd_stream.sglang.hooks")
    assert "sglang_ssd_stream.sglang.config" in hooks  # from . import config
    assert any(_under(m, "sglang.srt.models") for m in hooks)  # pkgutil.resolve_name / import_module strings
    assert len(MODULES) > 50


def test_floors_import_no_engine_and_no_adapter():
    bad = []
    for module in MODULES:
        if any(_under(module, f) for f in FLOORS):
            banned = ("sglang", "vllm", "torch", "triton")
        elif _under(module, STAGING):
            banned = ("sglang", "vllm")
        else:
            continue
        for imp in imports_of(module):
            if _top(imp) in banned or _under(imp, SGLANG_ADAPTER) or _under(imp, OPERATE) \
                    or _top(imp) == "vllm_ple_offload":
                bad.append(f"{module} imports {imp}")
    assert not bad, "\n".join(bad)


def test_only_each_adapter_imports_its_engine():
    bad = []
    for module in MODULES:
        for imp in imports_of(module):
            if _top(imp) == "sglang" and not _under(module, SGLANG_ADAPTER):
                bad.append(f"{module} imports {imp} (only {SGLANG_ADAPTER} may import sglang)")
            if _top(imp) == "vllm" and _top(module) != "vllm_ple_offload":
                bad.append(f"{module} imports {imp} (only vllm_ple_offload may import vllm)")
            if _top(module) == "vllm_ple_offload" and _under(imp, SGLANG_ADAPTER):
                bad.append(f"{module} imports the SGLang adapter {imp}")
            if _under(module, SGLANG_ADAPTER) and _top(imp) == "vllm_ple_offload":
                bad.append(f"{module} imports the vLLM adapter {imp}")
    assert not bad, "\n".join(bad)


def test_operate_imports_no_adapter():
    bad = [f"{m} imports {i}" for m in MODULES if _under(m, OPERATE) for i in imports_of(m)
           if _under(i, SGLANG_ADAPTER) or _top(i) in ("vllm_ple_offload", "sglang", "vllm")]
    assert not bad, "\n".join(bad)


def test_plugin_tops_import_only_the_standard_library():
    """Issue 25 item 7: the engines load our plugins from entry points and only log an import error, so the
    plugin modules' tops (and the vLLM settings parser) must import with nothing but the standard library."""
    code = ("import sys; import sglang_ssd_stream.sglang.plugin, vllm_ple_offload.plugin, vllm_ple_offload.env; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names "
            "and m.split('.')[0] not in ('sglang_ssd_stream', 'vllm_ple_offload', '__main__')))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})  # -S: no site-packages at all
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_the_data_path_imports_no_doctor():
    """The code that serves rows (vLLM's embedding and prefetch, SGLang's hooks) takes its checks from the
    floor and the runtime checks, never from a doctor (issue 25: vLLM's embedding imported its doctor)."""
    runtime = ("vllm_ple_offload.embedding", "vllm_ple_offload.prompt_prefetch", "sglang_ssd_stream.sglang.hooks")
    bad = [f"{m} imports {i}" for m in runtime for i in imports_of(m) if i.rsplit(".", 1)[-1] == "doctor"]
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _our_graph() -> dict[str, set[str]]:
    # A package's own __init__ is not an edge from its submodules (Python imports parents first by design).
    return {m: {i for i in imports_of(m) if i in MODULES and i != m and not _under(m, i)} for m in MODULES}


def test_no_import_cycle():
    cycles = _cycles(_our_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _unit(module: str) -> str:
    """The subpackage a module belongs to (``sglang_ssd_stream.operate.cli`` -> ``sglang_ssd_stream.operate``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_cycle_between_subpackages():
    units: dict[str, set[str]] = {}
    for m, deps in _our_graph().items():
        units.setdefault(_unit(m), set()).update(_unit(d) for d in deps if _unit(d) != _unit(m))
    cycles = _cycles(units)
    assert not cycles, "subpackage cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    """Guard against a vacuous cycle test."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


RUNTIME = textwrap.dedent(
    """
    import sys
    for name in ("sglang", "vllm", "torch", "triton", "vllm_ple_offload"):
        sys.modules[name] = None  # any import of them raises ImportError
    import importlib, pkgutil, sglang_ssd_stream
    for m in pkgutil.walk_packages(sglang_ssd_stream.patching.__path__, "sglang_ssd_stream.patching."):
        importlib.import_module(m.name)
    import sglang_ssd_stream.findings, sglang_ssd_stream.patching.guard
    from sglang_ssd_stream.patching.guard import verdict
    v = verdict("sglang", site_packages=sys.argv[1])
    print(v.state)
    """
)


def test_patching_runs_without_engines(tmp_path):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", "import sglang_ssd_stream.patching" + RUNTIME, str(site)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "error"  # no dist-info: no release, so no verdict; reached without an engine
