"""QSA prefill logits budget as a runtime knob (issue 9 item 5), checked in real sglang processes.

``SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB`` is applied by our ``sglang.srt.plugins`` entry point
(``ssd_stream``) when sglang's own ``load_plugins()`` runs, by setting
``qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES``, which ``_qsa_prefill_row_chunk_size`` reads at
call time. Each case runs in a process of its own (this file run as a script, ``probe`` mode) because
``load_plugins()`` runs once per process, as in a scheduler process: the outer test
(tests/sglang/test_qsa_budget_knob.py) runs the :data:`PROBES` through ``EngineVenv.run_script`` (a fork of the
venv's zygote that imports sglang and the kit afresh, else a new interpreter) and hands their exit status, output
and results to these checks in ``$QSA_CHECK_OUT``.

The plugin's guard refuses a pristine sglang unless ``SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1``; the
knob does not depend on any patch, so the probes set it and the check passes on pristine and
patched sglang alike.

Selection identity: ``QSAIndexer.select_prefill_tokens`` (the real method; ``self`` carries only
its three sizes) on CPU, where scoring is the torch fallback ``torch_qsa_mqa_prefill`` and top-k
the CPU reference of ``qsa_fast_topk`` (the request-relative TileLang path needs CUDA). Inputs are
small integers, so fp32 scores are exact whatever the tiling and a difference can only come
from the row tiling itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BUDGET_ENV = "SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB"
MIB = 1 << 20
UPSTREAM_DEFAULT = 128 * MIB  # qsa_indexer.py:41 in 0.5.23
# Row tiling of the chunk-size probe: heads=2 gives block_q=64; 8192 keys are 32 KiB per row.
CHUNK_SHAPE = {"rows": 100_000, "keys": 8192, "heads": 2}
# Selection inputs: 4 requests x 4096 compressed blocks (ratio 4), 384 query rows each.
REQUESTS, BLOCKS, ROWS_PER_REQUEST, HEADS, HEAD_DIM = 4, 4096, 384, 2, 16
COMPRESS_RATIO, TOKEN_TOPK = 4, 64


# --------------------------------------------------------------------------------------------
# Probe: runs in a fresh process; the plugin is loaded by sglang exactly as a scheduler does.
# --------------------------------------------------------------------------------------------


def _selection_inputs():
    import torch

    gen = torch.Generator().manual_seed(5)
    rows = REQUESTS * ROWS_PER_REQUEST
    q = torch.randint(-4, 5, (rows, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
    keys = torch.randint(-4, 5, (REQUESTS * BLOCKS, 1, HEAD_DIM), generator=gen).to(torch.bfloat16)
    seq_len = BLOCKS * COMPRESS_RATIO
    positions = torch.randint(0, seq_len, (REQUESTS, ROWS_PER_REQUEST), generator=gen).sort(dim=1).values
    base = (torch.arange(REQUESTS) * BLOCKS)[:, None]
    row_starts = base.expand(-1, ROWS_PER_REQUEST).reshape(-1)
    row_ends = (base + (positions + 1) // COMPRESS_RATIO).reshape(-1)  # complete blocks visible to the row
    return (q, keys, row_starts.to(torch.int32), row_ends.to(torch.int32), positions.reshape(-1),
            torch.full((rows,), seq_len, dtype=torch.int64))


def probe(mode: str, out: str) -> None:
    import sglang.srt.plugins as plugins

    result = {}
    if mode == "untouched":  # the module's own value, read before any plugin runs
        from sglang.srt.layers.attention.qsa import qsa_indexer

        result["before_plugins"] = qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES
    plugins.load_plugins()
    from sglang.srt.layers.attention.qsa import qsa_indexer

    import sglang_ssd_stream.sglang.plugin as ours

    result["plugin_registered"] = ours._registered
    result["budget"] = qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES
    result["chunk"] = qsa_indexer._qsa_prefill_row_chunk_size(**CHUNK_SHAPE)
    if mode == "select":
        import types

        import torch

        calls = []
        scorer = qsa_indexer.qsa_mqa_prefill
        qsa_indexer.qsa_mqa_prefill = lambda q, *a, **k: (calls.append(q.shape[0]), scorer(q, *a, **k))[1]
        sizes = types.SimpleNamespace(token_topk=TOKEN_TOPK, compress_ratio=COMPRESS_RATIO,
                                      block_topk=(TOKEN_TOPK + COMPRESS_RATIO - 1) // COMPRESS_RATIO)
        with torch.no_grad():
            selected = qsa_indexer.QSAIndexer.select_prefill_tokens(sizes, *_selection_inputs())
        torch.save(selected, out + ".pt")
        result["scored_row_chunks"] = calls
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__" and sys.argv[1:2] == ["probe"]:
    probe(sys.argv[2], sys.argv[3])
    sys.exit(0)


# --------------------------------------------------------------------------------------------
# Checks (pytest, in the sglang venv)
# --------------------------------------------------------------------------------------------


def probe_env(budget: str | None) -> dict:
    """What a probe process's environment adds to a check's (the plugin, the guard's escape, the budget)."""
    env = {"SGLANG_PLUGINS": "ssd_stream", "SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"}
    if budget is not None:
        env[BUDGET_ENV] = budget
    return env


# The probes the outer test runs (tests/sglang/test_qsa_budget_knob.py), one process each: name -> (mode, budget).
# A probe's environment lacks the budget variable where its budget is None.
PROBES = {"128": ("select", "128"), "32": ("select", "32"), "1": ("select", "1"), "unset": ("untouched", None),
          **{f"bad{i}": ("chunk", raw) for i, raw in enumerate(
              ("abc", "", "0", "-1", "65537", "1" + "0" * 30))}}


def probe_runs(names) -> dict:
    """The outer test's probe processes, from $QSA_CHECK_OUT: {name: (process, result or None)}."""
    out = Path(os.environ["QSA_CHECK_OUT"])
    runs = {}
    for name in names:
        proc = json.loads((out / f"{name}.proc.json").read_text())
        result = out / f"{name}.json"
        runs[name] = (subprocess.CompletedProcess(proc["args"], proc["returncode"], proc["stdout"], proc["stderr"]),
                      json.loads(result.read_text()) if result.exists() else None)
    return runs


def _ok(proc, result):
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    assert result["plugin_registered"], "sglang's load_plugins() did not run our entry point"
    return result


@pytest.fixture(scope="module")
def selections():
    return Path(os.environ["QSA_CHECK_OUT"]), probe_runs(("128", "32", "1"))


def test_budget_32_gives_smaller_chunks_than_default(selections):
    _, runs = selections
    r32, r128 = _ok(*runs["32"]), _ok(*runs["128"])
    assert r32["budget"] == 32 * MIB and r128["budget"] == 128 * MIB
    assert (r32["chunk"], r128["chunk"]) == (1024, 4096)  # 32 MiB / 32 KiB rows; 128 MiB / 32 KiB


def test_unset_keeps_the_upstream_default():
    result = _ok(*probe_runs(("unset",))["unset"])
    assert result["before_plugins"] == UPSTREAM_DEFAULT
    assert result["budget"] == UPSTREAM_DEFAULT and result["chunk"] == 4096


BAD_VALUES = {  # value -> what the refusal must say
    "abc": "'abc' is not an integer number of MiB",
    "": "'' is not an integer number of MiB",
    "0": "=0 is out of range 1..65536 MiB",
    "-1": "=-1 is out of range 1..65536 MiB",
    "65537": "=65537 is out of range 1..65536 MiB",
    "1" + "0" * 30: "is out of range 1..65536 MiB",
}


@pytest.fixture(scope="module")
def refusals():
    assert [PROBES[f"bad{i}"][1] for i in range(len(BAD_VALUES))] == list(BAD_VALUES)
    return probe_runs(f"bad{i}" for i in range(len(BAD_VALUES)))


@pytest.mark.parametrize("index, raw", list(enumerate(BAD_VALUES)), ids=["abc", "empty", "0", "-1", "65537", "1e30"])
def test_bad_values_stop_the_process(refusals, index, raw):
    proc, result = refusals[f"bad{index}"]
    assert proc.returncode != 0 and result is None, proc.stdout
    assert f"sglang-ssd-stream plugin: KnobError: {BUDGET_ENV}" in proc.stderr, proc.stderr
    assert BAD_VALUES[raw] in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, "expected a clean SystemExit, not a crash"


def test_tiling_keeps_topk_selection_identical(selections):
    import torch

    tmp, runs = selections
    rows = REQUESTS * ROWS_PER_REQUEST
    # 128 MiB: one chunk; 32 MiB: 512-row chunks (16384 keys = 64 KiB a row); 1 MiB: block_q = 64 rows.
    assert [len(_ok(*runs[mb])["scored_row_chunks"]) for mb in ("128", "32", "1")] == [1, 3, rows // 64]
    chosen = {mb: torch.load(tmp / f"{mb}.json.pt") for mb in runs}
    assert chosen["128"].shape == (rows, TOKEN_TOPK + COMPRESS_RATIO - 1)
    assert (chosen["128"] >= 0).sum() > rows * TOKEN_TOPK // 2  # real selections, not padding
    assert torch.equal(chosen["128"], chosen["32"]) and torch.equal(chosen["128"], chosen["1"])
