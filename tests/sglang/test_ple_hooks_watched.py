"""Every sglang function the PLE hooks wrap, or whose behaviour they reproduce, is watched by the pinned
manifest: a release that changes one is refused by the plugin and the doctor (``watched_code``) and shows
in the drift report, instead of serving with a hook whose assumptions nobody re-checked. The hashes
themselves are checked against the real wheels (``tests/test_wheel_architectures.py``) and, at start,
against the installed engine (``tests/e2e/test_1_plugin_live.py``)."""

from __future__ import annotations

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests
from sglang_ssd_stream.sglang import hooks

# read or reproduced, not wrapped: the one-layer-ahead call the gather relies on, the n-gram hash the
# prefetch computes on the host, where a verify row's n-gram history comes from and is committed, how
# each PLE table is split over TP ranks (sidecar profile reproduces it), and sglang's parallel context
# (the ranks the hooks read, the override sidecar profile splits a table under, an unwritten rank raising)
RELIED_ON = ("sglang.srt.models.qwen4_exp.Qwen4ExpPLELayer.start_prefetch",
             "sglang.srt.models.qwen4_exp.Qwen4ExpNGramEmbedding._hash_contexts",
             "sglang.srt.models.qwen4_exp._prepare_ple_batch",
             "sglang.srt.models.qwen4_exp._commit_ple_batch",
             "sglang.srt.models.qwen4_exp.Qwen4ExpNGramEmbedding.__init__",
             "sglang.srt.runtime_context.get_parallel",
             "sglang.srt.runtime_context.ParallelContext.override",
             "sglang.srt.runtime_context.ParallelContext._read")


def _watched() -> set[tuple[str, str]]:
    engine = ENGINES["sglang"]
    manifest = next(m for m in known_manifests(engine) if m.release == engine.pinned)
    return {(w.path, w.function) for w in manifest.watch}


def _located(target: str, watched: set[tuple[str, str]]) -> bool:
    parts = target.split(".")
    return any(("/".join(parts[:k]) + ".py", ".".join(parts[k:])) in watched for k in range(1, len(parts)))


def test_every_hook_target_is_watched():
    targets = [t for t, _ in hooks._hooks()] + [hooks.RESOLVE, *RELIED_ON]
    watched = _watched()
    missing = [t for t in targets if not _located(t, watched)]
    assert missing == [], f"not in the sglang {ENGINES['sglang'].pinned} manifest's watch list: {missing}"
    assert len(targets) == 18


def test_every_sglang_name_the_hooks_import_from_the_parallel_context_is_relied_on():
    """The hooks' imports from sglang's runtime context are in RELIED_ON (so watched): a new one fails here."""
    import ast
    import inspect

    imported = {f"{n.module}.{a.name}" for n in ast.walk(ast.parse(inspect.getsource(hooks)))
                if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.runtime_context" for a in n.names}
    assert imported and imported <= set(RELIED_ON), imported - set(RELIED_ON)


def test_the_check_sees_a_target_that_is_not_watched():
    watched = _watched()
    assert _located("sglang.srt.mem_cache.common.release_kv_cache", watched)
    assert not _located("sglang.srt.mem_cache.common.release_kv_cache_v2", watched)
    assert not _located("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", watched)
