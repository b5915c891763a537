"""NEXTN/Mamba track-index bounds in sglang 0.5.23: proved safe, so no patch (issue 9 item 1).

Upstream PR #35821 clamps the interval-crossing step with ``min(tp - pre, al - 1)``. sglang 0.5.23
already uses the shifted index ``tp - pre - 1`` with ``post = pre + al`` computed in the same
function, so on a crossing the index lies in ``[0, al - 1]``; a clamp would be a no-op and the
verbatim upstream form would be off by one. This module proves both claims on the real code:

- a hypothesis property over random seq_lens, accept_lens >= 1, tracking grids (built by the real
  ``mamba_track_grid`` from chunk/page/interval) and draft widths, run through every site that
  computes these indices: ``spec_utils._verify_commit_step_indices`` (eager torch), the KDA
  ReplaySSM branch of ``spec_utils.commit_mamba_states_after_verify``, the Triton launcher
  ``fused_commit_track_indices`` (what the eager function calls when tensors are on CUDA, called
  here with the same arguments) and ``eagle.prepare_verify_commit_outputs`` (the fused NEXTN
  topk=1 verify path; a fourth site the reference does not list). Triton runs under
  ``TRITON_INTERPRET=1`` on CPU tensors;
- the same property against each site rewritten to upstream's verbatim form: hypothesis must find
  a counterexample, so the property can fail;
- the ``accept_lens >= 1`` precondition (``last`` reads ``accept_index[al - 1]``) where the sites
  are called. Running a whole verify step needs CUDA kernels, so this is an AST inventory of the
  call sites and of ``eagle_sample`` (which returns ``num_correct_drafts + 1``), plus real runs of
  the Triton producers of ``num_correct_drafts`` and a source check of the CUDA ones.

The oracle (``expected``) lives in ``scripts/gpu/nextn_track_bounds_h200.py``, which runs the same
property on an H200; it enumerates accepted slots instead of reusing the kernels' closed form.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import math
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang
import sglang.kernels.ops.attention.linear.kda_replayssm_spec_decode as kda_commit
import sglang.srt.speculative.eagle_utils as eagle_utils
import sglang.srt.speculative.spec_utils as spec_utils
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
from sglang.kernels.ops.speculative import eagle as eagle_kernels
from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
from sglang.srt.configs.kimi_linear import KimiLinearConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_context, mamba_track_grid

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "nextn_track_bounds_h200.py"
_spec = importlib.util.spec_from_file_location("nextn_track_bounds_h200", _SCRIPT)
h200 = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = h200
_spec.loader.exec_module(h200)
Batch, expected = h200.Batch, h200.expected

SGLANG = Path(sglang.__file__).parent
# Deterministic in CI; the interpreter is slow, so examples are few and shapes small.
PROPERTY = settings(derandomize=True, database=None, max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEARCH = settings(derandomize=True, database=None, max_examples=300, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 to run the Triton kernels on CPU"


# --------------------------------------------------------------------------------------------
# Cases: a verify batch plus the (chunk, page, interval) that give its tracking grid.
# --------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    chunk = draw(st.sampled_from([1, 4, 64]))  # mamba_cache_chunk_size (FLA chunk is 64)
    page = draw(st.sampled_from([1, 2, 16, 64]))
    track = draw(st.one_of(st.integers(1, 3), st.integers(1, 96)))  # --mamba-track-interval; tiny: >1 boundary
    dtn = draw(st.integers(1, 8))  # --speculative-num-draft-tokens
    batch = Batch(dtn, math.lcm(chunk, page, track))
    for _ in range(draw(st.integers(1, 4))):
        al = draw(st.integers(1, dtn))
        k = draw(st.sampled_from([1, 2, 3, 0, 50_000]))
        # near a boundary; half of the draws land so that the verify crosses it
        offset = draw(st.one_of(st.integers(-al, -1), st.integers(-dtn - 1, dtn + 1)))
        pre = max(1, k * batch.interval + offset)
        if draw(st.sampled_from(["tree", "chain"])) == "chain":  # topk=1
            nodes = list(range(al))
        else:  # tree: the accepted path visits increasing node ids
            nodes = [0] + sorted(draw(st.lists(st.integers(1, max(1, dtn - 1)), min_size=al - 1,
                                               max_size=al - 1, unique=True)))
        batch.add(pre, al, nodes)
    return chunk, page, track, batch


@contextlib.contextmanager
def tracking_grid(chunk: int, page: int, track: int, batch: Batch):
    """Publish server args so the real ``mamba_track_grid(page)`` is the case's interval."""
    with get_context().override_server_args(page_size=page, mamba_track_interval=track) as server_args:
        server_args._mamba_cache_chunk_size = chunk  # sglang's fixture seam (arg_groups.overrides)
        assert mamba_track_grid(page) == batch.interval
        yield


def _schedule_batch(batch: Batch, page: int, seq_lens: torch.Tensor):
    bs = len(batch.al)
    return SimpleNamespace(seq_lens=seq_lens, mamba_track_indices=torch.arange(bs, dtype=torch.int64),
                           tree_cache=SimpleNamespace(page_size=page), forward_mode=ForwardMode.TARGET_VERIFY,
                           req_pool_indices=torch.arange(bs, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# The four sites, each returning (last steps, tracked steps) for a case.
# --------------------------------------------------------------------------------------------


def run_eager(case, fn=None):
    chunk, page, track, batch = case
    accept_index, accept_lens, seq_lens = batch.tensors("cpu")
    with tracking_grid(chunk, page, track, batch):
        last, steps = (fn or spec_utils._verify_commit_step_indices)(
            batch=_schedule_batch(batch, page, seq_lens), accept_index=accept_index,
            accept_lens=accept_lens, draft_token_num=batch.dtn)
    return last.tolist(), steps.tolist()


def run_kda(case, fn=None):
    """The KDA ReplaySSM branch; its kernel launcher is replaced by a recorder of its arguments."""
    chunk, page, track, batch = case
    accept_index, accept_lens, seq_lens = batch.tensors("cpu")
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(replayssm_spec_fold=True, replayssm_is_kda=True),
                           get_speculative_mamba2_params_all_layers=lambda: "spec-state",
                           get_mamba_indices=lambda indices: indices)
    worker = SimpleNamespace(model_runner=SimpleNamespace(
        model_config=SimpleNamespace(hf_config=KimiLinearConfig(), is_draft_model=False), req_to_token_pool=pool))
    seen = []
    original = kda_commit.commit_kda_replayssm_after_verify
    kda_commit.commit_kda_replayssm_after_verify = lambda **kw: seen.append(kw)
    try:
        with tracking_grid(chunk, page, track, batch):
            (fn or spec_utils.commit_mamba_states_after_verify)(
                worker, _schedule_batch(batch, page, seq_lens), accept_lens, accept_index, batch.dtn)
    finally:
        kda_commit.commit_kda_replayssm_after_verify = original
    assert len(seen) == 1, "the KDA ReplaySSM branch was not taken"
    return seen[0]["last_correct_step_indices"].tolist(), seen[0]["mamba_steps_to_track"].tolist()


def run_fused_commit(case, module=None):
    chunk, page, track, batch = case
    with tracking_grid(chunk, page, track, batch):  # the call site passes mamba_track_grid(page)
        return h200.run_fused_commit(module or scatter, batch, "cpu")


def run_verify_commit_outputs(case, module=None):
    chunk, page, track, batch = case
    with tracking_grid(chunk, page, track, batch):
        return h200.run_verify_commit_outputs(module or eagle_kernels, batch, "cpu")


SITES = {"eager": run_eager, "kda": run_kda, "fused_commit": run_fused_commit,
         "verify_commit_outputs": run_verify_commit_outputs}


def property_violations(case, site, impl=None) -> list[dict]:
    """Rows where a site's (last, tracked) differ from the oracle or track a step that was not accepted."""
    return h200.violations(case[3], *SITES[site](case, impl))


@given(cases())
@PROPERTY
def test_real_sites_track_only_accepted_steps(case):
    for site in SITES:
        bad = property_violations(case, site)
        assert not bad, f"{site}: {bad}"


def test_h200_script_grid_on_cpu(tmp_path):
    """The H200 script's exhaustive small grid, on the real kernel files under the interpreter."""
    import json
    import shutil

    for module in (scatter, eagle_kernels):
        shutil.copy(module.__file__, tmp_path)
    out = tmp_path / "result.json"
    assert h200.main(["--src", str(tmp_path), "--out", str(out), "--device", "cpu", "--quick"]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and all(r["rows"] > 3000 for r in result["real"].values()), result


def test_oracle_distinguishes_the_boundary_step():
    """Hand-checked rows: pre=5, al=3, grid 3 -> state after 6 tokens is slot 0; pre=7, al=2 -> slot 1."""
    assert expected(5, 3, [0, 2, 5], 3) == (5, 0)
    assert expected(7, 2, [0, 1], 3) == (1, 1)
    assert expected(1, 1, [0], 4) == (0, -1)
    assert expected(3, 4, [0, 1, 2, 3], 2) == (3, 2)  # two boundaries crossed: the last one is tracked


# --------------------------------------------------------------------------------------------
# Upstream's verbatim form at each site: the property must catch it.
# --------------------------------------------------------------------------------------------

# site -> (0.5.23 expression, upstream PR #35821's verbatim form of the same expression)
TORCH_UPSTREAM_FORMS = {
    "eager": ("tracking_point - seq_lens_pre_verify - 1",
              "torch.minimum(tracking_point - seq_lens_pre_verify, accept_lens - 1)"),
    "kda": ("tracking_point - seq_pre - 1", "torch.minimum(tracking_point - seq_pre, accept_lens - 1)"),
}
TORCH_FUNCTIONS = {"eager": spec_utils._verify_commit_step_indices,
                   "kda": spec_utils.commit_mamba_states_after_verify}


def torch_upstream_variant(site: str):
    """The real function with its one index expression replaced, compiled in spec_utils' namespace."""
    old, new = TORCH_UPSTREAM_FORMS[site]
    source = textwrap.dedent(inspect.getsource(TORCH_FUNCTIONS[site]))
    assert source.count(old) == 1, f"{site}: {old!r} not found exactly once; sglang changed this code"
    namespace = dict(vars(spec_utils))
    exec(compile(source.replace(old, new), f"<upstream form of {site}>", "exec"), namespace)
    return namespace[TORCH_FUNCTIONS[site].__name__]


def kernel_upstream_variant(site: str):
    module = {"fused_commit": scatter, "verify_commit_outputs": eagle_kernels}[site]
    names = h200.KERNELS[Path(module.__file__).name]
    return h200.extract_module(Path(module.__file__), names, upstream_form=True)


@pytest.mark.parametrize("site", list(SITES))
def test_upstream_form_is_off_by_one(site):
    variant = torch_upstream_variant(site) if site in TORCH_UPSTREAM_FORMS else kernel_upstream_variant(site)
    counterexample = find(cases(), lambda case: bool(property_violations(case, site, variant)), settings=SEARCH)
    (row, *_) = property_violations(counterexample, site, variant)
    # The off-by-one: upstream tracks the slot after the boundary slot, i.e. one token too late.
    want_slot = row["accepted_nodes"].index(row["want"][1])
    assert row["got"][1] == row["accepted_nodes"][want_slot + 1], row


# --------------------------------------------------------------------------------------------
# accept_lens >= 1 where the sites are called
# --------------------------------------------------------------------------------------------

INDEX_FUNCTIONS = {  # function -> position of accept_lens
    "_verify_commit_step_indices": None,  # keyword-only
    "commit_mamba_states_after_verify": 2,
    "fused_commit_track_indices": 1,
    "prepare_verify_commit_outputs": 2,
}
# (file, caller, callee) -> where the caller's accept_lens comes from. A new call site, or a new
# origin, fails the inventory so a release that adds one is reviewed.
CALL_SITES = {
    ("srt/speculative/spec_utils.py", "_verify_commit_step_indices", "fused_commit_track_indices"): "parameter",
    ("srt/speculative/spec_utils.py", "commit_mamba_states_after_verify", "_verify_commit_step_indices"): "parameter",
    ("srt/speculative/eagle_worker_common.py", "run_eagle_verify", "prepare_verify_commit_outputs"): "eagle_sample",
    ("srt/speculative/eagle_worker_common.py", "run_eagle_verify", "commit_mamba_states_after_verify"): "eagle_sample",
    # ngram starts from ones (the non-verify path) and rebinds from eagle_sample when verifying
    ("srt/speculative/ngram_worker.py", "forward_batch_generation", "commit_mamba_states_after_verify"):
        "eagle_sample | torch.ones(bs, dtype=torch.int32, device=self.device)",
    ("srt/managers/scheduler_pp_mixin.py", "_pp_spec_commit_relayed_accept", "commit_mamba_states_after_verify"):
        "pp_outputs['spec_accept_lens'].to(device)",
}


def _accept_lens_arg(call: ast.Call, callee: str):
    for kw in call.keywords:
        if kw.arg == "accept_lens":
            return kw.value
    pos = INDEX_FUNCTIONS[callee]
    return call.args[pos] if pos is not None and len(call.args) > pos else None


def _origin(func: ast.FunctionDef, name: str) -> str:
    """How ``name`` is bound in ``func``: a parameter, an unpack of eagle_sample(...), or the expression."""
    if name in {a.arg for a in func.args.args + func.args.kwonlyargs}:
        return "parameter"
    origins = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = [t.id for t in ast.walk(target) if isinstance(t, ast.Name)]
                if name in names:
                    value = node.value
                    is_eagle_sample = (isinstance(target, ast.Tuple) and isinstance(value, ast.Call)
                                       and getattr(value.func, "id", None) == "eagle_sample")
                    origins.add("eagle_sample" if is_eagle_sample else ast.unparse(value).replace('"', "'"))
    return " | ".join(sorted(origins)) or "unbound"


def _call_sites():
    found = {}
    for path in SGLANG.rglob("*.py"):
        text = path.read_text(errors="replace")
        if not any(f"{name}(" in text for name in INDEX_FUNCTIONS):
            continue
        tree = ast.parse(text)
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(func):
                callee = getattr(call.func, "id", getattr(call.func, "attr", None)) if isinstance(call, ast.Call) \
                    else None
                if callee in INDEX_FUNCTIONS:
                    arg = _accept_lens_arg(call, callee)
                    origin = _origin(func, arg.id) if isinstance(arg, ast.Name) else ast.unparse(arg)
                    found[(str(path.relative_to(SGLANG)), func.name, callee)] = origin
    return found


def test_index_sites_get_accept_lens_from_eagle_sample():
    assert _call_sites() == CALL_SITES


def test_pp_relay_forwards_the_last_rank_accept_lens():
    """The PP relay's ``spec_accept_lens`` is the last rank's verify result, unchanged."""
    source = (SGLANG / "srt/managers/scheduler_pp_mixin.py").read_text()
    assert source.count('tensor_dict["spec_accept_lens"] = result.accept_lens') == 1
    worker = (SGLANG / "srt/speculative/eagle_worker_common.py").read_text()
    assert "accept_lens=accept_lens," in worker  # GenerationBatchResult built from run_eagle_verify's tensor


def test_eagle_sample_counts_the_bonus_token():
    tree = ast.parse(textwrap.dedent(inspect.getsource(eagle_utils.eagle_sample)))
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "accept_lens" for t in n.targets)]
    assert [ast.unparse(a.value) for a in assigns] == ["num_correct_drafts + 1"]
    returns = [ast.unparse(r.value) for r in ast.walk(tree) if isinstance(r, ast.Return)]
    # the idle batch returns empty tensors (no row, so no accept_index[al - 1] read); otherwise accept_lens
    assert sorted(returns) == ["(predict, accept_lens, accept_index)", "(predict, num_correct_drafts, accept_index)"]
    idle = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and "is_idle" in ast.unparse(n.test))
    assert "num_correct_drafts = torch.empty(0," in ast.unparse(idle)


def _chain(bs: int, width: int, gen: torch.Generator):
    offsets = (torch.arange(bs) * width)[:, None]
    retrieve_index = offsets + torch.arange(width)[None, :]
    next_token = torch.arange(1, width + 1).repeat(bs, 1)
    next_token[:, -1] = -1
    candidates = torch.randint(0, 3, (bs, width), generator=gen)
    return retrieve_index, next_token, torch.full((bs, width), -1, dtype=torch.int64), candidates


@pytest.mark.parametrize("width", [1, 2, 4, 6])
def test_triton_verify_counts_are_never_negative(width):
    """num_correct_drafts from the Triton greedy and rejection-sampling verifies: 0 <= n <= width - 1."""
    gen = torch.Generator().manual_seed(width)
    bs, vocab = 8, 3
    for _ in range(4):
        retrieve_index, next_token, next_sibling, candidates = _chain(bs, width, gen)
        greedy = (torch.zeros(bs * width, dtype=torch.int32), torch.full((bs, width), -1, dtype=torch.int32),
                  torch.full((bs,), -7, dtype=torch.int32))
        verify_tree_greedy_triton(*greedy, candidates, retrieve_index, next_token, next_sibling,
                                  torch.randint(0, vocab, (bs * width,), generator=gen))
        target = torch.softmax(torch.randn(bs, width, vocab, generator=gen), -1)
        sampled = (torch.zeros(bs * width, dtype=torch.int32), torch.full((bs, width), -1, dtype=torch.int32),
                   torch.full((bs,), -7, dtype=torch.int32))
        chain_speculative_sampling_triton(*sampled, candidates, retrieve_index, next_token, next_sibling,
                                          torch.rand(bs, width, generator=gen), torch.rand(bs, generator=gen),
                                          target, torch.softmax(torch.randn(bs, width, vocab, generator=gen), -1),
                                          1.0, 1.0, True)
        for _, accept_index, count in (greedy, sampled):
            assert ((count >= 0) & (count <= width - 1)).all(), count
            assert (accept_index[torch.arange(bs), count.long()] >= 0).all()  # slot al - 1 is filled


def test_simulated_acceptance_keeps_one_token():
    """SGLANG_SIMULATE_ACC_LEN's CPU path: any positive length gives num_correct_drafts >= 0."""
    for simulate, method in ((0.01, "match-expected"), (1.0, "match-expected"), (99.0, "match-expected"),
                             (0.01, "multinomial")):
        count = torch.full((2,), -7, dtype=torch.int32)
        spec_utils.generate_simulated_accept_index(
            accept_index=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
            predict=torch.zeros(6, dtype=torch.int32),
            num_correct_drafts=count, candidates=torch.zeros(2, 3, dtype=torch.int64),
            target_predict=torch.zeros(2, 3, dtype=torch.int64), bs=2, spec_steps=2,
            simulate_acc_len=simulate, simulate_acc_method=method, simulate_acc_token_mode="fixed")
        assert ((count >= 0) & (count <= 2)).all(), (simulate, method, count)


def test_cuda_verify_kernels_count_up_from_zero():
    """The CUDA verifies (JIT-compiled; no GPU here) count accepted drafts in an unsigned counter from 0."""
    for rel in ("kernels/jit/include/sgl_kernel/speculative/eagle.cuh",
                "kernels/jit/include/sgl_kernel/speculative/sampling.cuh"):
        source = (SGLANG / rel).read_text()
        assert source.count("uint32_t num_accepted_tokens = 0;") == 1, rel
        assert source.count("accept_token_num[bx] = num_accepted_tokens;") == 1, rel
        assert "num_accepted_tokens -" not in source and "--num_accepted_tokens" not in source, rel
