"""Validated sparse GQA operators migrated from the QSA reference branch."""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

_H20_CONFIGS = [
    (32, (32, 8, 2)),
    (64, (64, 8, 2)),
    (1024, (32, 4, 2)),
    (float("inf"), (16, 1, 2)),
]
_L20_CONFIGS = [
    (32, (32, 8, 2)),
    (64, (64, 8, 2)),
    (128, (64, 4, 2)),
    (512, (32, 4, 2)),
    (float("inf"), (16, 1, 2)),
]


def _get_best_config(total_q: int):
    if is_batch_invariant_mode_enabled():
        return (32, 4, 2)
    table = _H20_CONFIGS if "H20" in torch.cuda.get_device_name(0) else _L20_CONFIGS
    return next(cfg for limit, cfg in table if total_q <= limit)


@triton.jit
def _sparse_gqa_prefill(
    q,
    k,
    v,
    out,
    indices,
    cu_seqlens,
    scale,
    topk,
    sq_m: tl.constexpr,
    sq_h: tl.constexpr,
    sq_d: tl.constexpr,
    sk_n: tl.constexpr,
    sk_h: tl.constexpr,
    sk_d: tl.constexpr,
    sv_n: tl.constexpr,
    sv_h: tl.constexpr,
    sv_d: tl.constexpr,
    so_m: tl.constexpr,
    so_h: tl.constexpr,
    so_d: tl.constexpr,
    si_m: tl.constexpr,
    si_g: tl.constexpr,
    si_n: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    batch_group = tl.program_id(1)
    group = batch_group % NUM_KV_HEADS
    batch = batch_group // NUM_KV_HEADS
    seq_start = tl.load(cu_seqlens + batch).to(tl.int64)
    seq_end = tl.load(cu_seqlens + batch + 1).to(tl.int64)
    query_relative = tl.program_id(0).to(tl.int64)
    query = seq_start + query_relative
    if query >= seq_end:
        return

    row_topk = tl.minimum(topk, query_relative + 1)
    row_limit = tl.minimum(topk, ((row_topk + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    offs_h = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head_start = group * GROUP_SIZE
    q_values = tl.load(
        q
        + query * sq_m
        + (head_start + offs_h[:, None]) * sq_h
        + offs_d[None, :] * sq_d,
        mask=(offs_h < GROUP_SIZE)[:, None],
        other=0.0,
    )
    q_values = (q_values * scale * 1.4426950408).to(q_values.dtype)
    k_base = k + seq_start * sk_n + group * sk_h
    v_base = v + seq_start * sv_n + group * sv_h
    idx_row = indices + query * si_m + group * si_g
    max_value = tl.full([BLOCK_M], -float("inf"), tl.float32)
    normalizer = tl.zeros([BLOCK_M], tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, row_limit, BLOCK_N):
        current = start + offs_n
        token = tl.load(idx_row + current * si_n, mask=current < topk, other=-1)
        valid = token >= 0
        keys = tl.load(
            k_base + token[None, :] * sk_n + offs_d[:, None] * sk_d,
            mask=valid[None, :],
            other=0.0,
        )
        values = tl.load(
            v_base + token[:, None] * sv_n + offs_d[None, :] * sv_d,
            mask=valid[:, None],
            other=0.0,
        )
        scores = tl.where(valid[None, :], tl.dot(q_values, keys), -float("inf"))
        next_max = tl.maximum(max_value, tl.max(scores, 1))
        alpha = tl.math.exp2(max_value - next_max)
        probabilities = tl.math.exp2(scores - next_max[:, None])
        accumulator = tl.dot(
            probabilities.to(values.dtype), values, accumulator * alpha[:, None]
        )
        normalizer = normalizer * alpha + tl.sum(probabilities, 1)
        max_value = next_max
    output = accumulator / normalizer[:, None]
    tl.store(
        out
        + query * so_m
        + (head_start + offs_h[:, None]) * so_h
        + offs_d[None, :] * so_d,
        output,
        mask=(offs_h < GROUP_SIZE)[:, None],
    )


def _widen_in_registers(q, k):
    return k.is_cuda and k.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def _check_kv_descales(k_scale, v_scale, widens=True):
    """Descales of an FP8 KV pool (stored = x / scale): finite and positive; a
    non-unit scale needs a path that widens the cache, or it would be dropped."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"QSA {name} must be finite and > 0, got {value!r}")
        if not widens and value != 1.0:
            raise ValueError(
                f"QSA {name}={value!r} given for a copy that keeps the cache dtype"
            )


def sparse_gqa_fwd_interface_triton(q, k, v, max_seqlen_k, indices, cu_seqlens, scale):
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group_size))
    block_n, warps, stages = _get_best_config(total_q)
    out = torch.empty_like(q)
    _sparse_gqa_prefill[(max_seqlen_k, (cu_seqlens.shape[0] - 1) * num_kv_heads)](
        q,
        k,
        v,
        out,
        indices,
        cu_seqlens,
        scale,
        indices.shape[-1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        indices.stride(0),
        indices.stride(1) if indices.ndim == 3 else 0,
        indices.stride(2) if indices.ndim == 3 else indices.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        num_warps=warps,
        num_stages=stages,
    )
    return out



@triton.jit
def _stage_in_registers(x):
    return tl.inline_asm_elementwise(
        asm="mov.b32 $0, $1;",
        constraints="=r,r",
        args=[x],
        dtype=x.dtype,
        is_pure=False,
        pack=2,
    )


@triton.jit
def _sparse_gqa_chunk_prefill(
    q,
    k,
    v,
    out,
    indices,
    cu_q,
    cu_k,
    kv_lens,
    scale,
    v_scale,
    topk,
    sq_m: tl.constexpr,
    sq_h: tl.constexpr,
    sq_d: tl.constexpr,
    sk_n: tl.constexpr,
    sk_h: tl.constexpr,
    sk_d: tl.constexpr,
    sv_n: tl.constexpr,
    sv_h: tl.constexpr,
    sv_d: tl.constexpr,
    so_m: tl.constexpr,
    so_h: tl.constexpr,
    so_d: tl.constexpr,
    si_m: tl.constexpr,
    si_g: tl.constexpr,
    si_n: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SLOT_INDICES: tl.constexpr,
    WIDEN_IN_REGISTERS: tl.constexpr,
):
    """One query row x one KV head group over its ``topk`` selected tokens.

    ``indices`` hold positions relative to row ``cu_k[batch]`` of ``k``/``v``
    (a packed context), or, with ``SLOT_INDICES``, rows of ``k``/``v`` itself
    (KV-pool slots; ``cu_k`` is unused).

    An FP8 pool holds ``k / k_scale`` and ``v / v_scale``: the host folds
    ``k_scale`` into ``scale``, and ``v_scale`` divides the per-row normalizer."""
    query_relative = tl.program_id(0).to(tl.int64)
    batch_group = tl.program_id(1)
    group = batch_group % NUM_KV_HEADS
    batch = batch_group // NUM_KV_HEADS
    q_start = tl.load(cu_q + batch)
    q_end = tl.load(cu_q + batch + 1)
    query = (q_start + query_relative).to(tl.int64)
    if query >= q_end:
        return
    if SLOT_INDICES:
        k_start = 0
    else:
        k_start = tl.load(cu_k + batch).to(tl.int64)
    kv_len = tl.load(kv_lens + batch).to(tl.int64)
    visible = query_relative + kv_len - (q_end - q_start) + 1
    row_topk = tl.minimum(topk, visible)
    row_limit = tl.minimum(topk, ((row_topk + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    offs_h = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_values = tl.load(
        q
        + query * sq_m
        + (group * GROUP_SIZE + offs_h[:, None]) * sq_h
        + offs_d[None, :] * sq_d,
        mask=(offs_h < GROUP_SIZE)[:, None],
        other=0.0,
    )
    if WIDEN_IN_REGISTERS:
        q32 = q_values * scale * 1.4426950408
        amax = tl.max(tl.max(tl.abs(q32), 1), 0)
        shift = tl.math.ceil(tl.math.log2(tl.maximum(amax, 1e-30))) - 14.0
        q_values = (q32 * tl.math.exp2(-shift)).to(tl.float16)
        score_scale = tl.math.exp2(shift)
    else:
        q_values = (q_values * scale * 1.4426950408).to(q_values.dtype)
        score_scale = 1.0
    k_base = k + k_start * sk_n + group * sk_h
    v_base = v + k_start * sv_n + group * sv_h
    idx_row = indices + query * si_m + group * si_g
    max_value = tl.full([BLOCK_M], -float("inf"), tl.float32)
    normalizer = tl.zeros([BLOCK_M], tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, row_limit, BLOCK_N):
        current = start + offs_n
        token = tl.load(idx_row + current * si_n, mask=current < topk, other=-1)
        valid = token >= 0
        if SLOT_INDICES:
            # 64-bit: slot * sk_n overflows int32 on a pool of a few M tokens.
            token = token.to(tl.int64)
        keys = tl.load(
            k_base + token[None, :] * sk_n + offs_d[:, None] * sk_d,
            mask=valid[None, :],
            other=0.0,
        )
        values = tl.load(
            v_base + token[:, None] * sv_n + offs_d[None, :] * sv_d,
            mask=valid[:, None],
            other=0.0,
        )
        # Direct callers and the KV pool can be FP8; packing uses Q's dtype.
        # Widening is exact; the descales are applied outside the loop.
        if WIDEN_IN_REGISTERS:
            keys = keys.to(tl.float16)
            values = _stage_in_registers(values.to(tl.float16))
            scores = tl.where(
                valid[None, :], tl.dot(q_values, keys) * score_scale, -float("inf")
            )
        else:
            keys = keys.to(q_values.dtype)
            values = values.to(q_values.dtype)
            scores = tl.where(valid[None, :], tl.dot(q_values, keys), -float("inf"))
        next_max = tl.maximum(max_value, tl.max(scores, 1))
        alpha = tl.math.exp2(max_value - next_max)
        probabilities = tl.math.exp2(scores - next_max[:, None])
        accumulator = tl.dot(
            probabilities.to(values.dtype), values, accumulator * alpha[:, None]
        )
        normalizer = normalizer * alpha + tl.sum(probabilities, 1)
        max_value = next_max
    # P @ (v_scale * V) = v_scale * (P @ V): one divide per row, and exact
    # (normalizer / 1.0) for an unscaled pool.
    output = accumulator / (normalizer / v_scale)[:, None]
    tl.store(
        out
        + query * so_m
        + (group * GROUP_SIZE + offs_h[:, None]) * so_h
        + offs_d[None, :] * so_d,
        output,
        mask=(offs_h < GROUP_SIZE)[:, None],
    )


@triton.jit(do_not_specialize=["TOTAL_K", "BS"])
def _pack_qsa_prefill_kv(
    k,
    v,
    packed_k,
    packed_v,
    req_to_token,
    req_indices,
    cu_k,
    k_scale,
    v_scale,
    SK0: tl.constexpr,
    SK1: tl.constexpr,
    SK2: tl.constexpr,
    SV0: tl.constexpr,
    SV1: tl.constexpr,
    SV2: tl.constexpr,
    SR0: tl.constexpr,
    SR1: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TOTAL_K,
    BS,
    COMPACT: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    token = offsets // (HEADS * DIM)
    if COMPACT:
        valid = token < TOTAL_K
        lo = tl.full((BLOCK,), 0, tl.int32)
        hi = lo + BS
        steps = BS
        while steps > 0:
            mid = (lo + hi + 1) // 2
            start = tl.load(cu_k + mid).to(tl.int64)
            after = token >= start
            lo = tl.where(after, mid, lo)
            hi = tl.where(after, hi, mid - 1)
            steps = steps // 2
        start = tl.load(cu_k + lo, valid, 0).to(tl.int64)
        req = tl.load(req_indices + lo, valid, 0).to(tl.int64)
        token = token - start
        dst = offsets
    else:
        batch = tl.program_id(1)
        start = tl.load(cu_k + batch).to(tl.int64)
        end = tl.load(cu_k + batch + 1).to(tl.int64)
        valid = token < end - start
        req = tl.load(req_indices + batch).to(tl.int64)
        dst = start * HEADS * DIM + offsets
    head = offsets // DIM % HEADS
    dim = offsets % DIM
    slot = tl.load(req_to_token + req * SR0 + token * SR1, valid, 0).to(tl.int64)
    keys = tl.load(k + slot * SK0 + head * SK1 + dim * SK2, valid, 0.0)
    values = tl.load(v + slot * SV0 + head * SV1 + dim * SV2, valid, 0.0)
    if packed_k.dtype.element_ty != k.dtype.element_ty:
        # Widening an FP8 pool: descale in fp32, rounded once by the store.
        keys = keys.to(tl.float32) * k_scale
        values = values.to(tl.float32) * v_scale
    tl.store(packed_k + dst, keys, valid)
    tl.store(packed_v + dst, values, valid)


def pack_qsa_prefill_kv(
    *,
    k,
    v,
    req_to_token,
    req_indices,
    cu_k,
    total_k,
    max_k,
    output_dtype=None,
    k_scale=1.0,
    v_scale=1.0,
):
    """``k_scale``/``v_scale``: descales of an FP8 pool, applied while widening
    to ``output_dtype``."""
    heads, dim = k.shape[1:]
    _check_kv_descales(k_scale, v_scale, widens=(output_dtype or k.dtype) != k.dtype)
    packed_k = torch.empty(
        (total_k, heads, dim), dtype=output_dtype or k.dtype, device=k.device
    )
    packed_v = torch.empty(
        (total_k, heads, dim), dtype=output_dtype or v.dtype, device=v.device
    )
    batch_size = req_indices.numel()
    blocks_per_request = triton.cdiv(max_k * heads * dim, 1024)
    compact = (
        max_k * batch_size > 2 * total_k and blocks_per_request * batch_size >= 4096
    )
    grid = (
        (triton.cdiv(total_k * heads * dim, 1024),)
        if compact
        else (blocks_per_request, batch_size)
    )
    _pack_qsa_prefill_kv[grid](
        k,
        v,
        packed_k,
        packed_v,
        req_to_token,
        req_indices,
        cu_k,
        float(k_scale),
        float(v_scale),
        *k.stride(),
        *v.stride(),
        *req_to_token.stride(),
        HEADS=heads,
        DIM=dim,
        BLOCK=1024,
        TOTAL_K=total_k,
        BS=batch_size,
        COMPACT=compact,
    )
    return packed_k, packed_v


def sparse_gqa_fwd_interface_triton_ck(
    q,
    k,
    v,
    indices,
    cu_q,
    cu_k,
    kv_lens,
    scale,
    max_q: Optional[int] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """``k_scale``/``v_scale``: descales of FP8 ``k``/``v`` (stored = x / scale)."""
    _check_kv_descales(k_scale, v_scale)
    k, v = k.contiguous(), v.contiguous()
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_q_heads // num_kv_heads
    if max_q is None:
        # Host sync; callers that know the longest entry pass it instead.
        max_q = int((cu_q[1:] - cu_q[:-1]).max().item())
    block_m = max(16, triton.next_power_of_2(group_size))
    block_n, warps, stages = _get_best_config(total_q)
    out = torch.empty_like(q)
    _sparse_gqa_chunk_prefill[(max_q, (cu_q.shape[0] - 1) * num_kv_heads)](
        q,
        k,
        v,
        out,
        indices,
        cu_q,
        cu_k,
        kv_lens,
        scale * k_scale,
        float(v_scale),
        indices.shape[-1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        indices.stride(0),
        indices.stride(1) if indices.ndim == 3 else 0,
        indices.stride(2) if indices.ndim == 3 else indices.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        SLOT_INDICES=False,
        WIDEN_IN_REGISTERS=_widen_in_registers(q, k),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def sparse_gqa_packed_decode_triton(
    q, k, v, indices, cu_q, cu_k, kv_lens, scale, *, k_scale=1.0, v_scale=1.0
):
    """Run one packed sparse-attention row per request without a host sync.

    Reuses the chunk-prefill kernel at a fixed query length of one, so graph
    capture never hits the ``.item()`` that the general interface needs to
    derive ``max_q``.
    """

    _check_kv_descales(k_scale, v_scale)
    k, v = k.contiguous(), v.contiguous()
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group_size))
    block_n, warps, stages = _get_best_config(total_q)
    out = torch.empty_like(q)
    _sparse_gqa_chunk_prefill[(1, (cu_q.shape[0] - 1) * num_kv_heads)](
        q,
        k,
        v,
        out,
        indices,
        cu_q,
        cu_k,
        kv_lens,
        scale * k_scale,
        float(v_scale),
        indices.shape[-1],
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        indices.stride(0),
        indices.stride(1) if indices.ndim == 3 else 0,
        indices.stride(2) if indices.ndim == 3 else indices.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        SLOT_INDICES=False,
        WIDEN_IN_REGISTERS=_widen_in_registers(q, k),
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _resolve_prefill_slots(
    indices,
    slots,
    cu_q,
    slot_table,
    slot_rows,
    topk,
    si_m,
    ss_m,
    st_m,
    BLOCK: tl.constexpr,
):
    """``slots[row, j] = slot_table[entry % slot_rows, indices[row, j]]``, -1
    where the index is; one program per query row of an entry."""
    entry = tl.program_id(1)
    q_start = tl.load(cu_q + entry)
    row = q_start + tl.program_id(0)
    if row >= tl.load(cu_q + entry + 1):
        return
    row = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    token = tl.load(indices + row * si_m + cols, mask=cols < topk, other=-1)
    valid = token >= 0
    table_row = slot_table + (entry % slot_rows).to(tl.int64) * st_m
    slot = tl.load(table_row + token, mask=valid, other=-1)
    tl.store(slots + row * ss_m + cols, slot, mask=cols < topk)


def sparse_gqa_paged_prefill_triton(
    q,
    k_cache,
    v_cache,
    slot_table,
    indices,
    cu_q,
    kv_lens,
    scale,
    *,
    max_q,
    k_scale=1.0,
    v_scale=1.0,
):
    """Chunk-prefill sparse attention that reads K/V in place from the KV pool.

    Same entry geometry as ``sparse_gqa_fwd_interface_triton_ck`` (``cu_q`` and
    ``kv_lens`` per entry, ``indices`` are logical positions of the entry's
    request), but no packed copy of each request's context: entry ``e``'s
    position ``t`` is read from pool slot
    ``slot_table[e % slot_table.shape[0], t]``. Prefill CP passes two entries
    per request (zigzag prev blocks, then next blocks) over one table row per
    request. ``max_q`` is the longest entry's query count, from host lengths.
    The selected tokens, the current chunk's included, must already be in the
    pool.

    The slots are resolved in a pass of their own: looking them up inside the
    attention loop puts a second dependent load in front of every K/V load and
    made the kernel 1.5x slower.

    ``k_scale``/``v_scale``: descales of an FP8 pool (stored = x / scale)."""
    _check_kv_descales(k_scale, v_scale)
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_q_heads // num_kv_heads
    num_entries = cu_q.shape[0] - 1
    out = torch.empty_like(q)
    if total_q == 0 or num_entries == 0:
        return out
    indices = indices[:total_q]
    topk = indices.shape[-1]
    assert indices.ndim == 2 and indices.stride(-1) == 1
    assert slot_table.stride(-1) == 1
    slots = torch.empty((total_q, topk), dtype=slot_table.dtype, device=indices.device)
    _resolve_prefill_slots[(max_q, num_entries)](
        indices,
        slots,
        cu_q,
        slot_table,
        slot_table.shape[0],
        topk,
        indices.stride(0),
        slots.stride(0),
        slot_table.stride(0),
        BLOCK=triton.next_power_of_2(topk),
        num_warps=4,
    )
    block_m = max(16, triton.next_power_of_2(group_size))
    block_n, warps, stages = _get_best_config(total_q)
    _sparse_gqa_chunk_prefill[(max_q, num_entries * num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        slots,
        cu_q,
        cu_q,
        kv_lens,
        scale * k_scale,
        float(v_scale),
        topk,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        slots.stride(0),
        0,
        slots.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        SLOT_INDICES=True,
        WIDEN_IN_REGISTERS=_widen_in_registers(q, k_cache),
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _fa2_valid_counts(
    seq_lens,
    indices,
    counts,
    topk: tl.constexpr,
    stride_i: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_TOPK)
    length = tl.load(seq_lens + row)
    positions = tl.load(
        indices + row * stride_i + cols,
        mask=cols < topk,
        other=-1,
    )
    valid = (positions >= 0) & (positions < length)
    tl.store(counts + row, tl.sum(valid.to(tl.int32), axis=0))


@triton.jit
def _fa2_prefix_sum(counts, cu_k, batch, BLOCK_B: tl.constexpr):
    rows = tl.arange(0, BLOCK_B)
    valid_rows = rows < batch
    row_counts = tl.load(counts + rows, mask=valid_rows, other=0)
    tl.store(cu_k, 0)
    tl.store(cu_k + rows + 1, tl.cumsum(row_counts, 0), mask=valid_rows)


def qwen_sparse_fa2_cu_seqlens_triton(
    seq_lens, indices, counts, cu_k, batch, topk, block_b: Optional[int] = None
):
    block_b = block_b or triton.next_power_of_2(batch)
    # One request per program: Triton caps a tile at 1M elements,
    # which [next_pow2(topk), next_pow2(batch)] exceeds at topk=2051, batch=512.
    _fa2_valid_counts[(batch,)](
        seq_lens,
        indices,
        counts,
        topk,
        indices.stride(0),
        BLOCK_TOPK=triton.next_power_of_2(topk),
        num_warps=8,
    )
    # Prefix sum is only over the batch dimension and remains a small 1-D
    # tensor, including during CUDA graph capture.
    _fa2_prefix_sum[(1,)](
        counts,
        cu_k,
        batch,
        BLOCK_B=block_b,
        num_warps=8,
    )


@triton.jit
def _compact_kv(
    k,
    v,
    req_to_token,
    req_indices,
    indices,
    seq_lens,
    cu_k,
    out_k,
    out_v,
    k_scale,
    v_scale,
    topk: tl.constexpr,
    heads: tl.constexpr,
    dim: tl.constexpr,
    req_stride: tl.constexpr,
    idx_stride: tl.constexpr,
    pad_cols,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ZERO_FILL: tl.constexpr,
):
    batch, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = block * BLOCK_TOPK + tl.arange(0, BLOCK_TOPK)
    dims = tl.arange(0, BLOCK_D)
    length = tl.load(seq_lens + batch)
    req = tl.load(req_indices + batch)
    pack_start = tl.load(cu_k + batch)
    valid_count = tl.load(cu_k + batch + 1) - pack_start
    positions = tl.load(indices + batch * idx_stride + cols, mask=cols < topk, other=-1)
    valid = (cols < valid_count) & (positions >= 0) & (positions < length)
    slots = tl.load(
        req_to_token + req * req_stride + tl.where(valid, positions, 0),
        mask=valid,
        other=0,
    )
    # 64-bit element offsets: slot * heads * dim exceeds int32 once the pool holds
    # more than 2^31 / (heads * dim) tokens (~4.2M for 2 x 256), which an FP8 pool
    # on one GPU does reach.
    src = slots.to(tl.int64)[:, None] * heads * dim + head * dim + dims[None, :]
    dst = (
        (pack_start + cols).to(tl.int64)[:, None] * heads * dim
        + head * dim
        + dims[None, :]
    )
    load_mask = valid[:, None] & (dims[None, :] < dim)
    if ZERO_FILL:
        # Strided (page-aligned) packing: the paged decode kernel reads whole pages,
        # so every slot in [valid_count, pad_cols) must hold zeros, never stale bytes.
        # `valid_count` here is the row's page-aligned stride, not its valid count, so
        # the store covers the full region while the load stays limited to valid rows.
        store_mask = (cols < pad_cols)[:, None] & (dims[None, :] < dim)
    else:
        store_mask = load_mask
    # Dequantize while gathering: the scratch is allocated in the query dtype, so an
    # FP8 pool is read as fp8 and stored as bf16. The pool holds k / k_scale and
    # v / v_scale (set_kv_buffer calls in qwen_sparse_attn_backend.py), so widening
    # descales in fp32 and rounds once; a same-dtype copy stays a plain copy.
    out_dtype = out_k.dtype.element_ty
    keys = tl.load(k + src, mask=load_mask, other=0.0)
    values = tl.load(v + src, mask=load_mask, other=0.0)
    if out_dtype != k.dtype.element_ty:
        keys = keys.to(tl.float32) * k_scale
        values = values.to(tl.float32) * v_scale
    tl.store(out_k + dst, keys.to(out_dtype), mask=store_mask)
    tl.store(out_v + dst, values.to(out_dtype), mask=store_mask)


def qwen_sparse_valid_counts_triton(seq_lens, indices, counts, batch, topk):
    """Valid-count pass alone, without the packed cu_seqlens prefix sum."""
    _fa2_valid_counts[(batch,)](
        seq_lens,
        indices,
        counts,
        topk,
        indices.stride(0),
        BLOCK_TOPK=triton.next_power_of_2(topk),
        num_warps=8,
    )


def qwen_sparse_kv_extraction_compact_triton(
    k,
    v,
    req_to_token,
    req_indices,
    indices,
    seq_lens,
    cu_k,
    out_k,
    out_v,
    batch,
    topk,
    zero_fill_cols: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Gather the selected K/V rows into ``out_k``/``out_v``.

    ``zero_fill_cols`` > 0 selects the strided (page-aligned) layout used by the paged
    decode kernel: row ``b`` owns ``[cu_k[b], cu_k[b] + zero_fill_cols)`` and every slot
    past its valid rows is zero-filled. Paged kernels read whole pages and multiply the
    masked probabilities into V, so stale or uninitialized bytes there (NaN/Inf bit
    patterns) would otherwise leak into the output. ``0`` keeps the compact layout for
    the varlen fallback, whose rows are packed back-to-back.

    ``out_k``/``out_v`` may use a wider dtype than the pool (bf16 scratch for an FP8
    pool); rows are converted while gathering and multiplied by ``k_scale`` /
    ``v_scale``, the pool's descales. A same-dtype copy takes no scale.

    Both layouts assume the valid entries of each ``indices`` row are contiguous at
    the front (``expand_qsa_block_indices`` sorts them that way): ``valid_count`` is a
    count, not a mask, so a ``-1`` in the middle of a row would shift the packing.
    """
    _check_kv_descales(k_scale, v_scale, widens=out_k.dtype != k.dtype)
    _, heads, dim = k.shape
    block_topk = 16
    zero_fill = zero_fill_cols > 0
    num_cols = zero_fill_cols if zero_fill else topk
    _compact_kv[(batch, heads, triton.cdiv(num_cols, block_topk))](
        k,
        v,
        req_to_token,
        req_indices,
        indices,
        seq_lens,
        cu_k,
        out_k,
        out_v,
        float(k_scale),
        float(v_scale),
        topk,
        heads,
        dim,
        req_to_token.stride(0),
        indices.stride(0),
        num_cols,
        BLOCK_TOPK=block_topk,
        BLOCK_D=triton.next_power_of_2(dim),
        ZERO_FILL=zero_fill,
        num_warps=8,
    )


__all__ = [
    "pack_qsa_prefill_kv",
    "qwen_sparse_fa2_cu_seqlens_triton",
    "qwen_sparse_valid_counts_triton",
    "qwen_sparse_kv_extraction_compact_triton",
    "sparse_gqa_fwd_interface_triton",
    "sparse_gqa_fwd_interface_triton_ck",
    "sparse_gqa_packed_decode_triton",
    "sparse_gqa_paged_prefill_triton",
]
