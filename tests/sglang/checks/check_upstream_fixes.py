"""Fixes the deployment write-ups needed that sglang already ships (issue 9 item 6).

Each test asserts, on the pinned release, that one such fix is present, so a release that loses
it is caught. Behavioural where CPU allows: the real functions and methods are called on
minimal stand-ins for the objects around them (``self`` included). Where not, a precise source
check, with the reason in its docstring.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
import types
import uuid
from array import array
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import zmq
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers import tokenizer_manager as tm
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components import idle_sleeper
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context, get_parallel


def _source_tree(fn) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


# --------------------------------------------------------------------------------------------
# Ghost radix nodes (upstream PR #35821's first half; mamba_radix_cache.py removed in #40313)
# --------------------------------------------------------------------------------------------


class _Component:
    """A tree component that can donate nothing (cache length 0), recording what the cache asks."""

    def __init__(self, cache_len):
        self.cache_len, self.calls = cache_len, []

    def prepare_for_caching_req(self, **kw):
        self.calls.append("prepare")
        return self.cache_len

    def floor_cache_len(self, n):
        return n

    def free_out_of_window_slots(self, *a):
        self.calls.append("free_out_of_window")

    def cleanup_after_caching_req(self, req, **kw):
        self.calls.append(("cleanup", kw.get("insert_result")))


def _cache_and_req(component):
    tokens = array("l", range(32))
    cache = SimpleNamespace(disable=False, page_size=4, _components_tuple=(component,),
                            tree_core=SimpleNamespace(is_eagle=False),
                            req_to_token_pool=SimpleNamespace(req_to_token=torch.arange(64).view(1, 64)),
                            insert=mock.Mock(side_effect=AssertionError("inserted a node with nothing to donate")))
    req = SimpleNamespace(finished=lambda: False, full_untruncated_fill_ids=tokens, priority=None, session_id=None,
                          kv_rotation_base=None, extra_key=None, cache_salt=None,
                          kv=SimpleNamespace(req_pool_idx=0, cache_protected_len=0, cache_inserted_len=0))
    return cache, req


def test_ghost_nodes_zero_cache_len_inserts_nothing():
    """UnifiedRadixCache.checkpoint_into_tree returns early when a component can donate nothing."""
    component = _Component(cache_len=0)
    cache, req = _cache_and_req(component)
    UnifiedRadixCache.checkpoint_into_tree(cache, req, up_to=32)
    cache.insert.assert_not_called()
    assert component.calls[-1] == ("cleanup", None)  # the request's state is released, not leaked


def test_ghost_nodes_mamba_component_donates_nothing_without_a_checkpoint():
    """MambaComponent reports 0 (not the token length) when no tracked mamba state exists."""
    component = SimpleNamespace(cache=SimpleNamespace(enable_mamba_extra_buffer=True), int8_ckpt_pool=None)
    unfinished = SimpleNamespace(kv=SimpleNamespace(mamba_last_track_seqlen=None))
    assert MambaComponent.prepare_for_caching_req(component, unfinished, InsertParams(), 32, False) == 0

    pool = SimpleNamespace(get_mamba_ping_pong_keep_idx=lambda req: 0, mamba_ping_pong_track_buffer_size=2)
    component.cache.req_to_token_pool = pool
    component._select_finished_checkpoint = types.MethodType(MambaComponent._select_finished_checkpoint, component)
    finished = SimpleNamespace(kv=SimpleNamespace(mamba_last_track_seqlen=None, mamba_prev_track_seqlen=None,
                                                  mamba_ping_pong_track_buffer=torch.zeros(2, dtype=torch.int64)))
    params = InsertParams()
    assert MambaComponent.prepare_for_caching_req(component, finished, params, 32, True) == 0


def test_ghost_nodes_tree_core_refuses_empty_keys():
    """match_prefix answers an empty (or sub-page) key without walking; an empty insert creates no node."""
    walked = mock.Mock(side_effect=AssertionError("walked the tree for an empty key"))
    core = SimpleNamespace(is_eagle=False, page_size=4, _empty_match_result="empty", _match_prefix_helper=walked)
    for tokens in ([], [1, 2, 3]):
        assert UnifiedTreeCore.match_prefix(core, MatchPrefixParams(key=RadixKey(array("l", tokens)))) == "empty"

    root = SimpleNamespace(id=0, priority=0)
    core = SimpleNamespace(is_eagle=False, page_size=4, _ongoing_insert_walk_state=None, root_node=root,
                           _touch_node=lambda node: None)
    step = UnifiedTreeCore.begin_insert(core, InsertParams(key=RadixKey(array("l", [1, 2])), value=None))
    assert step.actions == [] and step.result.prefix_len == 0 and step.result.last_device_node == root.id
    assert step.result.mamba_exist  # so the caller frees its unused mamba value instead of keeping a ghost


# --------------------------------------------------------------------------------------------
# Client disconnect -> abort (PR #35255 family)
# --------------------------------------------------------------------------------------------


def _state(dispatched: bool) -> tm.ReqState:
    return tm.ReqState(out_list=[], finished=False, event=asyncio.Event(), obj=None, time_stats=None,
                       dispatched=dispatched)


def _tokenizer_manager(states: dict):
    manager = SimpleNamespace(rid_to_state=dict(states), encoder_dispatch_ready={}, enable_metrics=False,
                              sent=[], released=[])
    manager._dispatch_to_scheduler = manager.sent.append
    manager._release_lora_once = manager.released.append
    manager.abort_request = types.MethodType(tm.TokenizerManager.abort_request, manager)
    return manager


def test_disconnect_aborts_dispatched_requests():
    """A failed handler aborts what reached the scheduler and drops only what did not."""
    sent, local = _state(dispatched=True), _state(dispatched=False)
    manager = _tokenizer_manager({"sent": sent, "local": local})
    tm.TokenizerManager._release_req_states_on_failure(manager, {"sent": sent, "local": local})
    assert [(type(r), r.rid, r.abort_all) for r in manager.sent] == [(AbortReq, "sent", False)]
    assert manager.rid_to_state == {"sent": sent}  # kept until the scheduler's reply removes it
    assert sent.abort_sent and manager.released == [local]


def test_disconnect_abort_is_sent_once():
    state = _state(dispatched=True)
    manager = _tokenizer_manager({"r": state})
    manager.abort_request("r")
    manager.abort_request("r")
    assert len(manager.sent) == 1


def test_disconnect_dispatch_marks_state():
    state = _state(dispatched=False)
    manager = SimpleNamespace(rid_to_state={"r": state})
    tm.TokenizerManager._mark_state_dispatched(manager, "r")
    assert state.dispatched


def test_disconnect_handler_failure_releases_states():
    """generate_request catches BaseException (client disconnect cancels the handler), releases, re-raises.

    Source check: driving the async generator needs a running tokenizer, scheduler sockets and a model.
    """
    tree = _source_tree(tm.TokenizerManager.generate_request)
    handlers = [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)
                and isinstance(h.type, ast.Name) and h.type.id == "BaseException"]
    bodies = [[ast.unparse(s) for s in h.body] for h in handlers]
    assert ["self._release_req_states_on_failure(request_states)", "raise"] in bodies, bodies


# --------------------------------------------------------------------------------------------
# SGLANG_EMPTY_CACHE_INTERVAL only from the fully idle path, only with --sleep-on-idle
# --------------------------------------------------------------------------------------------


@pytest.fixture
def sockets():
    context = zmq.Context.instance()
    recv, send = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    address = f"inproc://idle-sleeper-check-{uuid.uuid4().hex}"
    recv.bind(address)
    send.connect(address)
    yield recv, send
    recv.close(linger=0)
    send.close(linger=0)


@pytest.mark.parametrize("interval, paused, empties", [(0.001, False, True), (0.001, True, False), (-1, False, False)])
def test_idle_sleeper_empty_cache(monkeypatch, sockets, interval, paused, empties):
    """IdleSleeper empties the cache only with an interval set and the engine not paused."""
    recv, send = sockets
    monkeypatch.setenv("SGLANG_EMPTY_CACHE_INTERVAL", str(interval))
    emptied = []
    monkeypatch.setattr(idle_sleeper, "current_platform", SimpleNamespace(empty_cache=lambda: emptied.append(1)))
    sleeper = idle_sleeper.IdleSleeper([recv], can_empty_cache=lambda: not paused)
    sleeper.last_empty_time -= 1.0
    send.send(b"wake")  # a pending message: poll returns at once
    sleeper.maybe_sleep()
    assert bool(emptied) is empties


@pytest.mark.parametrize("sleep_on_idle", [False, True])
def test_idle_sleeper_only_with_sleep_on_idle(sockets, sleep_on_idle):
    scheduler = SimpleNamespace(ipc_channels=SimpleNamespace(recv_from_tokenizer=sockets[0],
                                                             recv_from_rpc=sockets[0]), _engine_paused=False)
    with get_context().override_server_args(sleep_on_idle=sleep_on_idle), \
            get_parallel().override(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0):
        Scheduler.init_idle_sleeper(scheduler)
    assert isinstance(scheduler.idle_sleeper, idle_sleeper.IdleSleeper) is sleep_on_idle


@pytest.mark.parametrize("fully_idle", [False, True])
def test_on_idle_sleeps_only_when_fully_idle(fully_idle):
    scheduler = mock.MagicMock(_last_stall_publish_ts=0.0, disaggregation_mode=DisaggregationMode.NULL,
                               enable_hicache_storage=False, enable_lmcache=False, enable_unified_memory=False,
                               enable_hisparse=False)
    scheduler.is_fully_idle.return_value = fully_idle
    scheduler.invariant_checker._check_all_pools.return_value = (False, [])
    scheduler.token_to_kv_pool_allocator.verify_byte_accounting.return_value = []
    Scheduler.on_idle(scheduler)
    assert scheduler.maybe_sleep_on_idle.call_count == int(fully_idle)


def test_maybe_sleep_on_idle_is_only_called_from_on_idle():
    """Source check over the scheduler package: the only caller is Scheduler.on_idle (its fully idle tail)."""
    import sglang

    root = inspect.getfile(sglang).rsplit("/", 1)[0]
    callers = []
    import pathlib

    for path in pathlib.Path(root, "srt").rglob("*.py"):
        text = path.read_text(errors="replace")
        if "maybe_sleep_on_idle(" not in text:
            continue
        for func in ast.walk(ast.parse(text)):
            if isinstance(func, ast.FunctionDef) and func.name != "maybe_sleep_on_idle":
                if any(isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "maybe_sleep_on_idle"
                       for c in ast.walk(func)):
                    callers.append(func.name)
    assert callers == ["on_idle"]


# --------------------------------------------------------------------------------------------
# QSA: FP8 K/V widened to the query dtype on read; prefill logits tiled by rows
# --------------------------------------------------------------------------------------------


def test_qsa_fp8_reads_widen_to_query_dtype():
    """Source check: the regression is a GPU compile error (``Unsupported rhs dtype fp8e4nv`` at
    ``tl.dot(q_values, keys)``, PR #36644) that the CPU interpreter cannot raise, and the launchers
    probe the CUDA device. So: in ``_sparse_gqa_chunk_prefill`` both loads are cast to the query
    dtype before the first ``tl.dot``; ``_compact_kv`` stores into the scratch dtype."""
    from sglang.srt.layers.attention.qsa import sparse_attn

    tree = _source_tree(sparse_attn._sparse_gqa_chunk_prefill.fn)
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    lines = [ast.unparse(s) for s in loop.body]
    widen = [lines.index("keys = keys.to(q_values.dtype)"), lines.index("values = values.to(q_values.dtype)")]
    first_dot = next(i for i, line in enumerate(lines) if "tl.dot(" in line)
    assert max(widen) < first_dot, lines

    compact = ast.unparse(_source_tree(sparse_attn._compact_kv.fn))
    assert "out_dtype = out_k.dtype.element_ty" in compact
    assert compact.count(".to(out_dtype)") == 2


def test_qsa_prefill_rows_are_tiled(monkeypatch):
    """The row chunk follows the budget, and select_prefill_tokens scores chunk by chunk."""
    from sglang.srt.layers.attention.qsa import qsa_indexer

    assert qsa_indexer._qsa_prefill_row_chunk_size(rows=10_000, keys=1 << 16, heads=16) == 512  # 128 MiB / 256 KiB
    monkeypatch.setattr(qsa_indexer, "_QSA_PREFILL_LOGITS_BUDGET_BYTES", 64 * 1024)
    assert qsa_indexer._qsa_prefill_row_chunk_size(rows=100, keys=1024, heads=16) == 16  # 64 KiB / 4 KiB
    assert qsa_indexer._qsa_prefill_row_chunk_size(rows=100, keys=1 << 20, heads=16) == 8  # never below block_q

    calls = []
    scorer = qsa_indexer.qsa_mqa_prefill
    monkeypatch.setattr(qsa_indexer, "qsa_mqa_prefill", lambda q, *a, **k: (calls.append(q.shape[0]),
                                                                            scorer(q, *a, **k))[1])
    gen = torch.Generator().manual_seed(1)
    rows, keys = 40, 1024
    q = torch.randint(-3, 4, (rows, 16, 8), generator=gen).float()
    k = torch.randint(-3, 4, (keys, 1, 8), generator=gen).float()
    positions = torch.arange(rows) * 100 + 99
    sizes = SimpleNamespace(token_topk=16, compress_ratio=4, block_topk=4)
    args = (q, k, torch.zeros(rows, dtype=torch.int32), ((positions + 1) // 4).to(torch.int32), positions,
            torch.full((rows,), 4 * keys))
    tiled = qsa_indexer.QSAIndexer.select_prefill_tokens(sizes, *args)
    assert calls == [16, 16, 8]
    monkeypatch.setattr(qsa_indexer, "_QSA_PREFILL_LOGITS_BUDGET_BYTES", 1 << 30)
    assert torch.equal(qsa_indexer.QSAIndexer.select_prefill_tokens(sizes, *args), tiled)
