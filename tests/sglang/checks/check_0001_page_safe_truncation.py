"""RED/GREEN check for patch 0001 (page-safe auto-truncation, sglang 0.5.23).

Runs inside the sglang venv against whichever sglang is first on sys.path and
calls the real code: ``TokenizerManager._validate_one_request``,
``TpModelWorker.get_worker_info`` and ``Scheduler.handle_generate_request``
(which runs the real ``init_req_max_new_tokens``, ``validate_input_length``
and ``Req``). Only the objects around them are minimal stand-ins. It fails on
pristine sglang 0.5.23 and passes once the patch is applied.
"""

from __future__ import annotations

import contextlib
import itertools
from array import array
from types import SimpleNamespace
from unittest.mock import patch

import pytest
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import compute_num_reserved_tokens
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.runtime_context import get_context, get_parallel, get_spec
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

PAGE_SIZES = (1, 64, 512)
# Absent max_new_tokens means the sampling default; the rest are client asks.
ABSENT = object()
REQUESTED = (ABSENT, None, 1, 8, 1000)
# MTP on Qwen4 Exp is NEXTN (an EAGLE variant with reserved draft slots).
SPEC = {"off": {}, "mtp": {
    "speculative_algorithm": "NEXTN",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}}


# --------------------------------------------------------------------------
# Config: publish a dummy ServerArgs through sglang's own test hook.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _server_args(page_size: int, spec: str, allow_auto_truncate: bool = True):
    with get_context().override_server_args(
        page_size=page_size,
        allow_auto_truncate=allow_auto_truncate,
        **SPEC[spec],
    ), get_parallel().override(tp_rank=0, pp_rank=0):
        yield


# --------------------------------------------------------------------------
# The three real layers, each on a minimal object.
# --------------------------------------------------------------------------


def worker_limits(context_len: int, kv_capacity: int):
    """Real TpModelWorker.get_worker_info -> (max_req_len, max_req_input_len)."""
    worker = object.__new__(TpModelWorker)
    worker._model_runner = SimpleNamespace(
        effective_logical_max_total_num_tokens=kv_capacity,
        logical_max_total_num_tokens=kv_capacity,
        token_to_kv_pool_allocator=None,
        max_running_requests=8,
        forward_stream=None,
        req_to_token_pool=SimpleNamespace(size=8, max_context_len=context_len),
        token_to_kv_pool=SimpleNamespace(size=kv_capacity),
    )
    worker.model_config = SimpleNamespace(context_len=context_len)
    worker.dllm_algorithm = None
    worker.random_seed = 0
    worker.device = "cpu"
    info = worker.get_worker_info()
    return info[4], info[5]


def tokenizer_validate(
    ids, requested, context_len: int, max_req_input_len, *, auto_truncate=True
):
    """Real TokenizerManager._validate_one_request; returns (ids, sampling)."""
    tm = object.__new__(TokenizerManager)
    tm.context_len = context_len
    tm.max_req_input_len = max_req_input_len
    tm.num_reserved_tokens = compute_num_reserved_tokens()
    tm.allow_auto_truncate = auto_truncate
    tm.validate_total_tokens = True
    tm.is_generation = True
    tm.model_config = SimpleNamespace(
        joint_head_config=None, pointer_head=None, vocab_size=1 << 20
    )
    sampling = {} if requested is ABSENT else {"max_new_tokens": requested}
    ids = list(ids)
    obj = GenerateReqInput(input_ids=ids, sampling_params=sampling)
    tm._validate_one_request(obj, ids)
    return ids, obj.sampling_params


class _Queued(Exception):
    pass


def _make_scheduler(max_req_len, max_req_input_len, kv_capacity, page_size):
    """A Scheduler with only the state request intake reads; real methods."""
    sched = object.__new__(Scheduler)
    allocator = SimpleNamespace(page_size=page_size)
    allocator.max_new_tokens_for_memory = (
        lambda *a, **kw: BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
            allocator, *a, **kw
        )
    )
    state = dict(
        max_req_len=max_req_len,
        max_req_input_len=max_req_input_len,
        max_total_num_tokens=kv_capacity,
        kv_shard_widening=1,
        page_size=page_size,
        token_to_kv_pool_allocator=allocator,
        sliding_window_size=None,
        chunked_prefill_size=None,
        max_new_tokens_limit=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(
            get_spec().speculative_algorithm
        ),
        enable_session_radix_cache=False,
        disaggregation_mode=DisaggregationMode.NULL,
        model_config=SimpleNamespace(hf_eos_token_id=None, vocab_size=1 << 20),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        metrics_collector=None,
        dllm_config=None,
        tokenizer=None,
        enable_overlap=False,
        queued=[],
        tree_cache=SimpleNamespace(cache_controller=None),
        grammar_manager=SimpleNamespace(process_req_with_grammar=lambda req: False),
    )
    sched.__dict__.update(state)
    # Side effects after intake that this check does not exercise.
    sched._maybe_namespace_elastic_radix_cache = lambda req: None
    sched._record_kv_event_lora_name = lambda req, lora_name: None
    sched._add_request_to_queue = sched.queued.append
    return sched


def scheduler_intake(
    ids, sampling: dict, max_req_len, max_req_input_len, kv_capacity, page_size
):
    """Real Scheduler.handle_generate_request; returns the Req it enqueued."""
    sched = _make_scheduler(max_req_len, max_req_input_len, kv_capacity, page_size)
    sampling_params = SamplingParams(**sampling)
    sampling_params.normalize(None)
    recv_req = TokenizedGenerateReqInput(
        rid="check-0001",
        input_text=None,
        input_ids=array("q", ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sampling_params,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )
    sched.handle_generate_request(recv_req)
    assert len(sched.queued) == 1, "request intake did not enqueue the request"
    return sched.queued[0]


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

BIG_KV = 1 << 22


def _default_budget():
    return SamplingParams().max_new_tokens


def _client_budget(requested):
    """The output the client asked for: its max_new_tokens, else the default."""
    return _default_budget() if requested in (ABSENT, None) else requested


def _boundary_inputs(context_len: int, max_req_input_len: int, page: int):
    """Prompt lengths around the context and the scheduler limit, +- a page."""
    points = set()
    for anchor in (context_len, max_req_input_len):
        for delta in (-page - 1, -page, -page + 1, -6, -5, -1, 0, 1, 5, page, page + 1):
            points.add(anchor + delta)
    points.add(context_len + 20)  # well past the window
    return sorted(n for n in points if n > 0)


def _cases():
    for page, spec in itertools.product(PAGE_SIZES, SPEC):
        for context_len in (4096, 65536):
            yield page, spec, context_len


def test_seed_example_120_in_8_out():
    """Seed write-up: 120 in, 8 out, 100 total, 90 scheduler limit -> 82 + 8.

    Pristine 0.5.23 gives 90 + 0 (the tokenizer cuts to 100 and zeroes the
    budget, the scheduler then cuts to 90 and keeps 0).
    """
    for spec in SPEC:
        with _server_args(1, spec):
            reserved = compute_num_reserved_tokens()
            ids, sampling = tokenizer_validate(range(120), 8, 100, 90)
            req = scheduler_intake(ids, sampling, 99, 90, BIG_KV, 1)
            got = (len(req.origin_input_ids), req.sampling_params.max_new_tokens)
            assert got == (82 - reserved, 8), f"spec={spec}: got {got[0]} + {got[1]}"
            assert req.to_finish is None and not req.finished()


def _pool_input_len(kv_capacity: int, page: int) -> int:
    """The longest prompt whose page-rounded length leaves the allocator's
    page and one output token in the pool, in whole pages."""
    bound = kv_capacity - page - 2
    return bound // page * page if bound >= page else bound


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_worker_input_limit_page_aligned(page):
    """TpModelWorker.get_worker_info: max_req_input_len is 0.5.23's context
    bound (context - 6, token-exact) or, where the KV pool binds, the pool's
    bound in whole KV pages; a prompt at the limit can still generate within
    the KV pool."""
    with _server_args(page, "off"):
        for context_len, kv_capacity in itertools.product(
            (1000, 4096, 4097, 65536, 262144), (None, 4096, 300000)
        ):
            kv_capacity = kv_capacity or context_len
            if min(context_len, kv_capacity) < 4 * page:
                continue  # a pool of under four pages is not a served setup
            max_req_len, max_req_input_len = worker_limits(context_len, kv_capacity)
            assert max_req_len == min(context_len, kv_capacity) - 1
            where = f"page={page} context={context_len} kv={kv_capacity}"
            unaligned = max_req_len - 5
            assert max_req_input_len <= unaligned
            # The context bound is not rounded to a page (issue 38 item 3);
            # only the pool's bound is, where it is the smaller.
            pool = _pool_input_len(kv_capacity, page)
            assert max_req_input_len == min(unaligned, pool), (
                f"{where}: max_req_input_len={max_req_input_len}, want "
                f"min({unaligned}, pool bound {pool})"
            )
            if pool < unaligned:
                assert max_req_input_len % page == 0, where
            # A prompt at the limit still has room for output in the KV pool
            # (the allocator holds one page back).
            room = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
                SimpleNamespace(page_size=page),
                max_req_input_len,
                1 << 30,
                token_capacity=kv_capacity,
                sliding_window_size=None,
                chunk_size=None,
            )
            assert room >= 1, (
                f"{where}: a {max_req_input_len}-token prompt at the limit leaves "
                f"{room} tokens to generate"
            )


def test_tokenizer_truncation_keeps_output_budget():
    """TokenizerManager._validate_one_request with --allow-auto-truncate: a
    prompt is cut only where 0.5.23 would cut it (input + reserved slots at
    the context, or input at the scheduler's limit); then it keeps the
    client's output budget and is cut to whole pages below both limits."""
    for page, spec, context_len in _cases():
        with _server_args(page, spec):
            reserved = compute_num_reserved_tokens()
            _, max_req_input_len = worker_limits(context_len, BIG_KV)
            limit = min(context_len, max_req_input_len)
            for n, requested in itertools.product(
                _boundary_inputs(context_len, max_req_input_len, page), REQUESTED
            ):
                ids, sampling = tokenizer_validate(
                    range(n), requested, context_len, max_req_input_len
                )
                where = f"page={page} spec={spec} ctx={context_len} n={n} req={requested}"
                if n + reserved < context_len and n < max_req_input_len:
                    assert len(ids) == n, where  # a prompt that fits is never cut
                    continue
                budget = max(1, _client_budget(requested))
                kept = len(ids)
                assert 0 < kept < n, where
                assert kept % page == 0, f"{where}: kept {kept} tokens, not whole pages"
                assert kept + reserved + budget <= limit, (
                    f"{where}: kept {kept} + reserved {reserved} + output "
                    f"{budget} > limit {limit}"
                )
                assert kept + reserved + budget > limit - page, where
                # The client's own budget is passed on unchanged.
                if requested is ABSENT:
                    assert "max_new_tokens" not in sampling, where
                else:
                    assert sampling["max_new_tokens"] == requested, where


def test_scheduler_recomputes_budget_after_truncation():
    """Scheduler.handle_generate_request: a prompt the scheduler cuts gets its
    output budget computed from the cut prompt, not the original one."""
    for page, spec in itertools.product(PAGE_SIZES, SPEC):
        with _server_args(page, spec):
            context_len = 4096
            max_req_len, max_req_input_len = worker_limits(context_len, BIG_KV)
            for n, requested in itertools.product(
                (max_req_input_len, max_req_input_len + 1, max_req_len, context_len),
                (1, 4, 8, 1000),
            ):
                req = scheduler_intake(
                    range(n),
                    {"max_new_tokens": requested},
                    max_req_len,
                    max_req_input_len,
                    BIG_KV,
                    page,
                )
                kept = len(req.origin_input_ids)
                out = req.sampling_params.max_new_tokens
                where = f"page={page} spec={spec} n={n} req={requested}: {kept} + {out}"
                assert kept == max_req_input_len, where
                assert out == min(requested, max_req_len - kept - 1), where
                assert out >= 1, where
                assert req.to_finish is None, where


def test_scheduler_guard_finishes_zero_budget_under_mtp():
    """A budget clipped to 0 (here by the KV pool) under speculative decoding
    is not prefill-only and would never finish: the scheduler ends it."""
    page = 64
    kv_capacity = context_len = 1024
    for spec in SPEC:
        with _server_args(page, spec):
            max_req_len, max_req_input_len = worker_limits(context_len, kv_capacity)
            n = max_req_input_len // page * page
            req = scheduler_intake(
                range(n), {"max_new_tokens": 8}, max_req_len, max_req_input_len,
                kv_capacity, page,
            )
            out = req.sampling_params.max_new_tokens
            if spec == "off":
                # Without speculation a 0 budget is a finishing prefill-only request.
                assert out >= 1 or req.is_prefill_only
                continue
            assert out >= 1 or req.to_finish is not None or req.finished(), (
                f"n={n}: max_new_tokens={out} under MTP with no finish reason: "
                "the request never finishes"
            )


def test_scheduler_guard_keeps_explicit_zero_budget():
    """A client asking for 0 tokens (e.g. scoring) is not aborted."""
    for spec in SPEC:
        with _server_args(64, spec):
            max_req_len, max_req_input_len = worker_limits(4096, BIG_KV)
            req = scheduler_intake(
                range(100), {"max_new_tokens": 0}, max_req_len, max_req_input_len,
                BIG_KV, 64,
            )
            assert req.sampling_params.max_new_tokens == 0
            assert req.to_finish is None and len(req.origin_input_ids) == 100


def test_auto_truncate_off_unchanged():
    """Without --allow-auto-truncate an over-long prompt is still refused."""
    with _server_args(64, "off", allow_auto_truncate=False):
        max_req_len, max_req_input_len = worker_limits(4096, BIG_KV)
        with pytest.raises(ValueError, match="longer than the model's context length"):
            tokenizer_validate(range(4096), 8, 4096, max_req_input_len,
                               auto_truncate=False)
        ids, sampling = tokenizer_validate(range(4000), 8, 4096, max_req_input_len,
                                           auto_truncate=False)
        assert len(ids) == 4000 and sampling["max_new_tokens"] == 8
        req = scheduler_intake(range(4090), {"max_new_tokens": 8}, max_req_len,
                               max_req_input_len, BIG_KV, 64)
        assert isinstance(req.to_finish, FINISH_ABORT)


def test_end_to_end_boundary_sweep():
    """Worker limits -> tokenizer validation -> scheduler intake, around the
    boundary: every request fits, gets >= 1 output token, and can finish."""
    for page, spec, context_len in _cases():
        with _server_args(page, spec):
            reserved = compute_num_reserved_tokens()
            for kv_capacity in (BIG_KV, context_len):
                max_req_len, max_req_input_len = worker_limits(context_len, kv_capacity)
                for n, requested in itertools.product(
                    _boundary_inputs(context_len, max_req_input_len, page), REQUESTED
                ):
                    ids, sampling = tokenizer_validate(
                        range(n), requested, context_len, max_req_input_len
                    )
                    req = scheduler_intake(
                        ids, sampling, max_req_len, max_req_input_len,
                        kv_capacity, page,
                    )
                    kept = len(req.origin_input_ids)
                    out = req.sampling_params.max_new_tokens
                    where = (
                        f"page={page} spec={spec} ctx={context_len} kv={kv_capacity} "
                        f"n={n} req={requested}: {kept} + {out}"
                    )
                    assert req.to_finish is None, f"{where}: {req.to_finish}"
                    assert kept <= max_req_input_len, where
                    assert kept + out <= max_req_len - 1, where
                    assert out >= 1, f"{where}: no output budget left"
                    if n + reserved >= context_len or n >= max_req_input_len:
                        # Cut by auto-truncation: whole pages, client budget kept.
                        assert kept % page == 0, where
                        if requested not in (ABSENT, None):
                            assert out == requested, where
                            assert kept + reserved + out <= context_len, where


def test_a_prompt_that_fits_is_never_cut():
    """Issue 38 item 3: context 256, page 64, 220 in + 24 out (244 <= 256) is
    served whole, as pristine serves it (the page-aligned input limit of an
    earlier version of the patch cut it to 128). Swept: every prompt under
    0.5.23's own limits keeps all its tokens, with the budget upstream gives."""
    context_len = 256
    for page, spec in itertools.product((1, 64), SPEC):
        with _server_args(page, spec):
            reserved = compute_num_reserved_tokens()
            max_req_len, max_req_input_len = worker_limits(context_len, BIG_KV)
            ids, sampling = tokenizer_validate(
                range(220), 24, context_len, max_req_input_len
            )
            req = scheduler_intake(
                ids, sampling, max_req_len, max_req_input_len, BIG_KV, page
            )
            got = (len(req.origin_input_ids), req.sampling_params.max_new_tokens)
            assert got == (220, 24), f"page={page} spec={spec}: got {got[0]} + {got[1]}"
            for n, requested in itertools.product(range(150, 260), (1, 8, 24, 100)):
                if n + reserved + requested > context_len or n >= context_len - 6:
                    continue  # does not fit 0.5.23's own limits
                ids, sampling = tokenizer_validate(
                    range(n), requested, context_len, max_req_input_len
                )
                req = scheduler_intake(
                    ids, sampling, max_req_len, max_req_input_len, BIG_KV, page
                )
                kept = len(req.origin_input_ids)
                out = req.sampling_params.max_new_tokens
                where = f"page={page} spec={spec} n={n} req={requested}: {kept} + {out}"
                assert kept == n, where
                assert out == min(requested, max_req_len - n - 1) >= 1, where
                assert req.to_finish is None, where


def test_truncation_log_names_the_limit(caplog):
    """The warning for a cut prompt says which limit it did not fit, the
    reserved draft slots, and what is kept."""
    context_len, page = 256, 64
    for spec in SPEC:
        with _server_args(page, spec):
            reserved = compute_num_reserved_tokens()
            _, max_req_input_len = worker_limits(context_len, BIG_KV)
            cases = {
                275: f"does not fit the model's context length ({context_len} tokens)",
                max_req_input_len: "does not fit the scheduler's input limit "
                f"({max_req_input_len} tokens)",
            }
            for n, why in cases.items():
                caplog.clear()
                with caplog.at_level("WARNING"):
                    ids, _ = tokenizer_validate(range(n), 8, context_len, max_req_input_len)
                text = caplog.text
                where = f"spec={spec} n={n}: {text!r}"
                if n == max_req_input_len and n + reserved >= context_len:
                    why = cases[275]
                assert why in text, where
                assert f"{reserved} reserved draft slots" in text, where
                assert f"Truncating the input to {len(ids)} tokens" in text, where
                assert len(ids) % page == 0 and len(ids) < n, where


# --------------------------------------------------------------------------
# Upstream's test doubles (issue 29 item 10): what other code paths may lack.
# --------------------------------------------------------------------------


def test_worker_limits_with_a_schedule_without_page_size():
    """sglang's own test_dcp_logical_capacity.py patches get_schedule with a
    double that has no page_size: the worker keeps 0.5.23's limits
    (max_req_len - 5), as that test asserts."""
    double = SimpleNamespace(max_prefill_tokens=16384, max_queued_requests=None)
    with _server_args(64, "off"), patch("sglang.srt.managers.tp_worker.get_schedule", return_value=double):
        max_req_len, max_req_input_len = worker_limits(1 << 20, 64 * 3)
    assert (max_req_len, max_req_input_len) == (64 * 3 - 1, 64 * 3 - 6)


def test_tokenizer_without_max_req_input_len_truncates_inside_the_context():
    """A TokenizerManager double without max_req_input_len: an over-long
    prompt is still cut inside the context, without AttributeError."""
    tm = object.__new__(TokenizerManager)
    tm.context_len = 256
    tm.num_reserved_tokens = 0
    tm.allow_auto_truncate = True
    tm.validate_total_tokens = True
    tm.is_generation = True
    tm.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None, vocab_size=1 << 20)
    ids = list(range(10, 310))
    obj = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 8})
    with _server_args(64, "off"):
        tm._validate_one_request(obj, ids)
    assert len(ids) + obj.sampling_params["max_new_tokens"] <= tm.context_len
