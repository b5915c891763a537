"""TEST-ONLY CPU STAND-IN for serving the tiny qwen4_exp with the real sglang 0.5.23 server on a CPU box.

NEVER SHIPPED, never imported by the kit: tests/e2e/server.py puts this directory on PYTHONPATH of the
servers it starts, and ``sitecustomize`` arms :func:`arm` in each of their processes.

What it stands in for, and why each is needed (sglang's CPU engine expects the CPU build of sgl-kernel,
which PyPI does not ship; the CUDA build imports only with the stub driver the tests build):

* 10 ``torch.ops.sgl_kernel.*_cpu`` ops that exist only in sgl-kernel's CPU build, looked up when
  ``models/qwen3_5.py``, ``layers/attention/linear/gdn_backend.py`` and ``.../kernels/gdn_triton.py`` import
  or called through ``sgl_kernel.mamba``: written here in plain torch from the math of transformers'
  reference GDN and of sglang's own Triton kernels (``fused_sigmoid_gating_recurrent.py``,
  ``fused_gdn_gating.py``, ``triton_gdn_fused_proj.py``): element-at-a-time loops, not kernels.
* ``cpu_has_amx_support`` pinned to False (the AMX layouts and ops are not stood in), ``RMSNormGated``'s CPU
  branch forced on (it runs only with AMX; its Triton branch needs a GPU), ``QSAIndexer.forward_native``
  pointed at ``forward_cuda`` (whose ``_forward_impl`` has CPU branches).
* The PLE offload path's CUDA side: ``torch.cuda.Stream``/``Event``/``stream``/``current_stream`` become
  synchronous no-op stand-ins (CPU work is already ordered), ``Tensor.record_stream`` ignores them, and
  ``allocate_ple_host_table(backend="pinned")`` returns ordinary memory (pinning needs a driver).

* NEXTN/MTP (speculative decoding): 8 more ``sgl_kernel`` CPU ops (``copy_all_layer_kv_cache_cpu``,
  ``assign_req_to_token_pool_cpu``, ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``,
  ``fill_bonus_tokens_cpu``, ``fill_accept_out_cache_loc_cpu``, and the tree builder / greedy verify run as
  sglang's own Triton forms under the interpreter), the target verify's conv update with intermediate conv
  windows, and the verify commit's state scatters (``mamba_state_scatter_triton``, CUDA/XPU only upstream).

Every number these produce proves nothing about kernels or speed: they make the engine's control flow,
the kit's hooks and patches, and the HTTP contract run on a CPU. Each stand-in logs once per process when
it first runs (``ssd_stream_cpu_standin: ran <name>``), so a test can tell a stand-in from the real thing.

Probes (test evidence, no behaviour change): the QSA prefill row-chunk function logs the budget it read.
"""

from __future__ import annotations

import os
import sys
import threading

PREFIX = "ssd_stream_cpu_standin"
_lock = threading.Lock()
_said: set[str] = set()
_lib = None  # torch.library.Library kept alive for the process


def say(message: str) -> None:
    print(f"{PREFIX}: pid {os.getpid()}: {message}", file=sys.stderr, flush=True)


def ran(name: str) -> None:
    if name not in _said:
        _said.add(name)
        say(f"ran {name}")


# ----------------------------------------------------------------------------- import hook

# module -> what to do *before* its body runs (ops its body looks up) / *after* (attributes to change)
_BEFORE = {
    "sglang.srt.models.qwen3_5", "sglang.srt.models.qwen3_next", "sglang.srt.layers.attention.linear.gdn_backend",
    "sglang.srt.layers.attention.linear.kernels.gdn_triton", "sgl_kernel.mamba", "sgl_kernel.kvcacheio",
    "sgl_kernel.speculative",
}


def _after_utils_common(mod):
    mod.cpu_has_amx_support = lambda: False


def _after_layernorm_gated(mod):
    mod._use_cpu = True


def _after_qsa_indexer(mod):
    mod.QSAIndexer.forward_native = mod.QSAIndexer.forward_cuda
    original = mod._qsa_prefill_row_chunk_size

    def _qsa_prefill_row_chunk_size(rows, keys, heads):
        if "qsa-budget" not in _said:
            _said.add("qsa-budget")
            say(f"probe: QSA prefill row chunk sized with _QSA_PREFILL_LOGITS_BUDGET_BYTES="
                f"{mod._QSA_PREFILL_LOGITS_BUDGET_BYTES}")
        return original(rows, keys, heads)

    mod._qsa_prefill_row_chunk_size = _qsa_prefill_row_chunk_size


def _after_ple_table(mod):
    import torch

    original = mod.allocate_ple_host_table

    def allocate_ple_host_table(shape, dtype, backend="pinned", table_dir=None, tag=None):
        if backend == "pinned":  # pin_memory=True needs a driver; the rows and their addresses are what matter
            ran("pinned PLE table allocation (ordinary memory)")
            return torch.empty(tuple(shape), dtype=dtype, device="cpu")
        return original(shape, dtype, backend, table_dir, tag)

    allocate_ple_host_table.__wrapped__ = original
    mod.allocate_ple_host_table = allocate_ple_host_table
    _cuda_streams()


def _after_gdn_backend(mod):
    """The MTP target verify calls the CPU ``causal_conv1d_update`` with the verify's keywords, which the CPU
    build's wrapper does not take: ``intermediate_conv_window`` [slots, draft tokens, dim, W-1] keeps the conv
    window after each draft step (at ``intermediate_state_indices``) for the commit of the accepted step. Those
    calls get :func:`causal_conv1d_verify`; every other call stays on the CPU wrapper. (sglang's own Triton
    ``causal_conv1d_update`` under the Triton interpreter returned NaN here, so it is not used.)"""
    cpu_update = mod.causal_conv1d_update

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kw):
        if kw.get("intermediate_conv_window") is None:
            return cpu_update(x, conv_state, weight, bias, activation, **kw)
        return causal_conv1d_verify(x, conv_state, weight, bias, activation, **kw)

    mod.causal_conv1d_update = causal_conv1d_update


def causal_conv1d_verify(x, conv_state, weight, bias, activation, *, conv_state_indices, intermediate_conv_window,
                         intermediate_state_indices, retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None, pad_slot_id=-1, **unsupported):
    """``kernels/ops/mamba/causal_conv1d_triton.py:causal_conv1d_update`` for a chain verify (topk 1):
    x [B, dim, steps]; per request the steps run in order from ``conv_state[slot]`` (left updated by all of
    them, as the kernel does; the commit then writes back the accepted step's window) and the window after
    step t is kept at ``intermediate_conv_window[intermediate_state_indices[i], t]``."""
    import torch

    if retrieve_parent_token is not None or unsupported.get("num_accept_tokens") is not None:
        raise NotImplementedError("CPU stand-in: tree verify (topk > 1) / num_accept_tokens is not stood in")
    if unsupported.get("cache_seqlens") is not None:
        raise NotImplementedError("CPU stand-in: a circular conv state (cache_seqlens) is not stood in")
    ran("causal_conv1d_update target verify (intermediate conv windows)")
    silu = activation in ("silu", "swish", True)
    batch, dim, steps = x.shape
    width = weight.shape[-1]
    w = weight.reshape(dim, width)
    out = torch.empty_like(x)
    for i in range(batch):
        slot = int(conv_state_indices[i])
        if slot == pad_slot_id or slot < 0:
            out[i].zero_()
            continue
        keep = int(intermediate_state_indices[i])
        state = conv_state[slot].to(x.dtype)
        for t in range(steps):
            window = torch.cat([state, x[i, :, t: t + 1]], dim=1)
            out[i, :, t] = _conv_window(window, w, bias, silu).to(x.dtype)
            state = window[:, 1:]
            if keep >= 0:
                intermediate_conv_window[keep, t].copy_(state.to(intermediate_conv_window.dtype))
        conv_state[slot].copy_(state.to(conv_state.dtype))
    return out



def _after_mamba_state_scatter(mod):
    """The verify's commit of the accepted step (``scatter_mamba_states_after_mtp_verify``) refuses CPU tensors
    in its two Triton scatters. Stood in with their documented math: for each request ``i`` whose step is >= 0,
    ``dst[:, dst_indices[i]] = src[:, src_rows[i], step[i]]`` (SSM states, and the conv windows through their
    overlapping strided view); the multi-type conv launch is routed to the per-type one."""

    def scatter(name):
        def fn(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
            ran(f"{name} (torch)")
            steps = step_indices_raw.tolist()
            rows = src_indices_raw.tolist() if src_indices_raw is not None else list(range(len(steps)))
            for d, st, r in zip(dst_indices_raw.tolist(), steps, rows, strict=False):
                if st >= 0 and 0 <= d < dst.shape[1] and r < src.shape[1] and st < src.shape[2]:
                    dst[:, int(d)] = src[:, int(r), int(st)]
        return fn

    mod.fused_mamba_state_scatter_with_mask = scatter("fused_mamba_state_scatter_with_mask")
    mod.fused_conv_window_scatter_with_mask = scatter("fused_conv_window_scatter_with_mask")
    mod._conv_multi_eligible = lambda pairs: False



_AFTER = {
    "sglang.srt.utils.common": _after_utils_common,
    "sglang.kernels.ops.attention.fla.layernorm_gated": _after_layernorm_gated,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _after_layernorm_gated,
    "sglang.srt.layers.attention.qsa.qsa_indexer": _after_qsa_indexer,
    "sglang.srt.models.qwen4_exp_ple_table": _after_ple_table,
    "sglang.srt.layers.attention.linear.gdn_backend": _after_gdn_backend,
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton": _after_mamba_state_scatter,
}


def arm() -> None:
    from tests.e2e.standin_common import arm_import_hooks

    arm_import_hooks(_BEFORE, _AFTER, install_ops)


# ----------------------------------------------------------------------------- CUDA streams on a CPU


def _cuda_streams() -> None:
    """``torch.cuda`` streams and events on a CPU: one module for both engines' stand-ins."""
    from tests.e2e.standin_common import install_cuda_streams

    install_cuda_streams(ran, marker="_ssd_stream_cpu_standin")


# ----------------------------------------------------------------------------- sgl_kernel CPU ops


def _softplus(x, beta=1.0, threshold=20.0):
    import torch

    return torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)


def _l2(x):
    import torch

    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def fused_sigmoid_mul_cpu(x, gate):
    ran("fused_sigmoid_mul_cpu")
    x.mul_(gate.float().sigmoid().to(x.dtype))


def _gemma_rms(x, w, eps):
    import torch

    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim):
    ran("fused_qk_gemma_rmsnorm_cpu")
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps).reshape(q.shape),
            _gemma_rms(k.reshape(-1, head_dim), k_weight, eps).reshape(k.shape))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_head):
    ran("fused_qk_gemma_rmsnorm_with_gate_cpu")
    t = q_gate.shape[0]
    qg = q_gate.reshape(t, num_head, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps).contiguous(),
            _gemma_rms(k.reshape(-1, head_dim), k_weight, eps).contiguous(),
            gate.reshape(-1, head_dim).contiguous())


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """[q | k | v | z] and [b | a] -> mixed_qkv [q | k | v], z [T, HV, V], b, a [T, HV]."""
    ran("fused_qkvzba_split_reshape_cat_contiguous_cpu")
    t = mixed_qkvz.shape[0]
    qk, vv = num_heads_qk * head_qk, num_heads_v * head_v
    mixed_qkv = mixed_qkvz[:, : 2 * qk + vv].contiguous()
    z = mixed_qkvz[:, 2 * qk + vv: 2 * qk + 2 * vv].reshape(t, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v: 2 * num_heads_v].contiguous()
    return mixed_qkv, z, b, a


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b); both [1, T, HV]."""
    ran("fused_gdn_gating_cpu")
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid().to(b.dtype)
    return g.unsqueeze(0).contiguous(), beta.unsqueeze(0).contiguous()


def fused_rmsnorm_gated_cpu(x, weight, gate, eps):
    """rmsnorm(x) * weight * silu(gate), norm before gate, one group."""
    import torch

    ran("fused_rmsnorm_gated_cpu")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.nn.functional.silu(gate.float())).to(x.dtype)


def _conv_window(window, weight, bias, silu):
    """window [dim, W] -> [dim]: sum_w weight[:, w] * window[:, w] (+ bias, silu)."""
    import torch

    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return torch.nn.functional.silu(y) if silu else y


def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, silu,
                          pad_slot_id, is_vnni):
    """Varlen causal depthwise conv: x [dim, T]; conv_states [slots, dim, W-1] updated in place."""
    import torch

    ran("causal_conv1d_fwd_cpu")
    dim, total = x.shape
    width = weight.shape[-1]
    w = weight.reshape(dim, width)
    out = torch.empty_like(x)
    starts = query_start_loc.tolist() if query_start_loc is not None else [0, total]
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == pad_slot_id:
            continue
        init = has_initial_state is not None and bool(has_initial_state[i]) and conv_states is not None
        prev = conv_states[slot].to(x.dtype) if init else x.new_zeros(dim, width - 1)
        seq = torch.cat([prev, x[:, lo:hi]], dim=1)
        for t in range(hi - lo):
            out[:, lo + t] = _conv_window(seq[:, t: t + width], w, bias, silu).to(x.dtype)
        if conv_states is not None:
            conv_states[slot].copy_(seq[:, -(width - 1):])
    return out


def causal_conv1d_update_cpu(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, pad_slot_id,
                             is_vnni):
    """Decode step(s): x [B, dim] or [B, dim, L]; conv_state [slots, dim, W-1] updated in place."""
    import torch

    ran("causal_conv1d_update_cpu")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    batch, dim, steps = xs.shape
    width = weight.shape[-1]
    w = weight.reshape(dim, width)
    out = torch.empty_like(xs)
    for i in range(batch):
        slot = int(conv_state_indices[i]) if conv_state_indices is not None else i
        if slot == pad_slot_id:
            out[i].zero_()
            continue
        state = conv_state[slot].to(x.dtype)
        for t in range(steps):
            window = torch.cat([state, xs[i, :, t: t + 1]], dim=1)
            out[i, :, t] = _conv_window(window, w, bias, silu).to(x.dtype)
            state = window[:, 1:]
        conv_state[slot].copy_(state)
    return out.squeeze(-1) if squeeze else out


def _gated_delta_step(h, q, k, v, g, beta, scale):
    """One token of the gated delta rule for one value head. h [V, K] fp32 (the pool's layout)."""
    h = h * g.exp()
    v = (v - h @ k) * beta
    h = h + v[:, None] * k[None, :]
    return h, h @ (q * scale)


def _recurrence(q, k, v, g, beta, h0, *, l2norm, scale, intermediate=None):
    """q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] fp32; h0 [HV, V, K]. Returns o [T, HV, V] fp32, h."""
    import torch

    steps, heads = q.shape[0], q.shape[1]
    hv_heads = v.shape[1]
    group = hv_heads // heads
    q, k, v = q.float(), k.float(), v.float()
    if l2norm:
        q, k = _l2(q), _l2(k)
    h = h0.float().clone()
    out = torch.empty(steps, hv_heads, v.shape[-1], dtype=torch.float32)
    for t in range(steps):
        for hv in range(hv_heads):
            h[hv], out[t, hv] = _gated_delta_step(h[hv], q[t, hv // group], k[t, hv // group], v[t, hv], g[t, hv],
                                                  beta[t, hv], scale)
        if intermediate is not None:
            intermediate(t, h)
    return out, h


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                               use_qk_l2norm_in_kernel, initial_state_indices):
    """Prefill GDN, one token at a time (the chunked form computes the same recurrence).

    q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV]; initial_state = the pool [slots, HV, V, K],
    read and written back in place at ``initial_state_indices``."""
    import torch

    ran("chunk_gated_delta_rule_cpu")
    assert not head_first
    starts = cu_seqlens.tolist()
    out = torch.empty_like(v)
    finals = []
    scale = q.shape[-1] ** -0.5
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        slot = int(initial_state_indices[i])
        o, h = _recurrence(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi].float(), beta[0, lo:hi].float(),
                           initial_state[slot], l2norm=use_qk_l2norm_in_kernel, scale=scale)
        out[0, lo:hi] = o.to(v.dtype)
        initial_state[slot].copy_(h.to(initial_state.dtype))
        finals.append(h)
    return out, torch.stack(finals) if finals else initial_state.new_empty(0, dtype=torch.float32)


def _state_recorder(buffer, cache_idx: int):
    """Keeps the state after each verify step at ``buffer[cache_idx, step]`` (nothing for a padded row)."""

    def record(t, h):
        if cache_idx >= 0:
            buffer[cache_idx, t].copy_(h.to(buffer.dtype))

    return record


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
                                               disable_state_update=False, intermediate_states_buffer=None,
                                               intermediate_state_indices=None, cache_steps=None,
                                               retrieve_parent_token=None):
    """Decode (and MTP target-verify) GDN with the gates fused in.

    q, k [1, T, H, K]; v [1, T, HV, V]; a, b [T, HV]; sequences from ``cu_seqlens``; state pool
    [slots, HV, V, K] at ``initial_state_indices`` (written back unless ``disable_state_update``); with
    ``intermediate_states_buffer`` the state after each step is kept there for the verify's commit."""
    import torch

    ran("fused_sigmoid_gating_delta_rule_update_cpu")
    if is_kda:
        raise NotImplementedError("CPU stand-in: KDA gating is not stood in")
    if retrieve_parent_token is not None:
        raise NotImplementedError("CPU stand-in: EAGLE tree verify (topk > 1) is not stood in")
    starts = cu_seqlens.tolist()
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold)
    beta = b.float().sigmoid()
    out = torch.empty(v.shape, dtype=q.dtype)
    scale = k.shape[-1] ** -0.5
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        slot = int(initial_state_indices[i])
        h0 = initial_state_source[slot] if slot >= 0 else torch.zeros_like(initial_state_source[0])
        record = None
        if intermediate_states_buffer is not None:
            record = _state_recorder(intermediate_states_buffer, int(intermediate_state_indices[i]))
        o, h = _recurrence(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[lo:hi], beta[lo:hi], h0,
                           l2norm=use_qk_l2norm_in_kernel, scale=scale, intermediate=record)
        out[0, lo:hi] = o.to(out.dtype)
        if slot >= 0 and not disable_state_update:
            initial_state_source[slot].copy_(h.to(initial_state_source.dtype))
    return out


# ----------------------------------------------------------------------------- NEXTN / MTP (speculative decoding)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """``kernels/ops/kvcache/cache_move.py:copy_all_layer_kv_cache_tiled`` on CPU: for every layer buffer (a raw
    base address in ``data_ptrs``, ``strides`` bytes per token slot) copy slot ``src_loc[i]`` to ``tgt_loc[i]``.
    All sources are read before any target is written, as the tiled kernel loads before it stores (so an
    overlapping move stays right). Used by the KV pool's warm-up and by speculative decoding's KV moves."""
    import ctypes

    ran("copy_all_layer_kv_cache_cpu")
    srcs, tgts = [int(i) for i in src_loc.tolist()], [int(i) for i in tgt_loc.tolist()]
    if len(srcs) != len(tgts):
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {len(srcs)} sources for {len(tgts)} targets")
    for base, stride in zip((int(b) for b in data_ptrs.tolist()), (int(s) for s in strides.tolist()), strict=False):
        rows = [ctypes.string_at(base + s * stride, stride) for s in srcs]
        for t, row in zip(tgts, rows, strict=False):
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``mem_cache/allocation.py:assign_req_to_token_pool`` (Triton) on CPU: request ``i`` gets
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` from the next ``end - start`` entries
    of ``out_cache_loc`` (the requests' slices lie back to back, in batch order)."""
    ran("assign_req_to_token_pool_cpu")
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len} != row length {req_to_token.shape[1]}")
    at = 0
    for row, lo, hi in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=False):
        n = int(hi) - int(lo)
        if n > 0:
            req_to_token[int(row), int(lo):int(hi)] = out_cache_loc[at:at + n].to(req_to_token.dtype)
            at += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                           num_steps):
    """``kernels/ops/speculative/cache_locs.py:assign_draft_cache_locs_contiguous`` (Triton) on CPU, without
    positions (the CPU path writes none): request ``i``'s ``topk * num_steps`` slots of ``req_to_token`` from
    ``seq_lens[i]`` on go to ``out_cache_loc[i * topk * num_steps:]``."""
    ran("assign_draft_cache_locs_contiguous_cpu")
    n = topk * num_steps
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=False)):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[int(row), int(start):int(start) + n].to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``kernels/ops/speculative/cache_locs.py:assign_extend_cache_locs`` (Triton) on CPU: the inverse of
    :func:`assign_req_to_token_pool_cpu`, ``req_to_token[row_i, start_i:end_i]`` back to back into ``out_cache_loc``."""
    ran("assign_extend_cache_locs_cpu")
    at = 0
    for row, lo, hi in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=False):
        n = int(hi) - int(lo)
        if n > 0:
            out_cache_loc[at:at + n] = req_to_token[int(row), int(lo):int(hi)].to(out_cache_loc.dtype)
            at += n


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``kernels/ops/speculative/eagle.py:fill_bonus_tokens``: the last accepted token of each request
    (``accept_lens`` counts the bonus token) into ``bonus_tokens``."""
    ran("fill_bonus_tokens_cpu")
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + int(n) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """``kernels/ops/speculative/eagle.py:fill_accept_out_cache_loc``: the slots of the accepted draft tokens
    (``accept_index`` entries != -1, in order) packed into ``accept_out_cache_loc``."""
    ran("fill_accept_out_cache_loc_cpu")
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[int(src)]
            dst += 1


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
    """The draft tree's mask, positions and links: sglang's own Triton form of the op
    (``kernels/ops/speculative/spec_tree.py:sgl_build_tree_kernel_triton``, its XPU path), run by the Triton
    interpreter on CPU tensors (``TRITON_INTERPRET=1``); it refuses the bit-packed mask mode itself."""
    from sglang.kernels.ops.speculative import spec_tree

    ran("build_tree_kernel_efficient_cpu (sglang's Triton form, interpreted)")
    spec_tree.sgl_build_tree_kernel_triton(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                           retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                           draft_token_num, spec_tree.TreeMaskMode(tree_mask_mode))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict):
    """Greedy verify of the draft tokens against the target's argmax: sglang's own Triton form
    (``spec_tree.py:verify_tree_greedy_triton``), interpreted on CPU tensors."""
    from sglang.kernels.ops.speculative import spec_tree

    ran("verify_tree_greedy_cpu (sglang's Triton form, interpreted)")
    spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                        retrive_next_token, retrive_next_sibling, target_predict)


_OPS = {
    "fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> ()": fused_sigmoid_mul_cpu,
    "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
    " -> (Tensor, Tensor)": fused_qk_gemma_rmsnorm_cpu,
    "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
    "int head_dim, int num_head) -> (Tensor, Tensor, Tensor)": fused_qk_gemma_rmsnorm_with_gate_cpu,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
    "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)":
        fused_qkvzba_split_reshape_cat_contiguous_cpu,
    "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)": fused_gdn_gating_cpu,
    "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor": fused_rmsnorm_gated_cpu,
    "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, Tensor? query_start_loc, "
    "Tensor? cache_indices, Tensor? has_initial_state, bool silu, int pad_slot_id, bool is_vnni) -> Tensor":
        causal_conv1d_fwd_cpu,
    "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, bool silu, "
    "Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, bool is_vnni) -> Tensor":
        causal_conv1d_update_cpu,
    "chunk_gated_delta_rule_cpu(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) initial_state, "
    "bool output_final_state, Tensor cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel, "
    "Tensor initial_state_indices) -> (Tensor, Tensor)": chunk_gated_delta_rule_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, "
    "Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
    "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0, bool is_kda=False, "
    "bool disable_state_update=False, Tensor(b!)? intermediate_states_buffer=None, "
    "Tensor? intermediate_state_indices=None, int? cache_steps=None, Tensor? retrieve_parent_token=None) -> Tensor":
        fused_sigmoid_gating_delta_rule_update_cpu,
    "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()":
        copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()": assign_req_to_token_pool_cpu,
    "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
    "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()": assign_draft_cache_locs_contiguous_cpu,
    "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()": assign_extend_cache_locs_cpu,
    "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride)"
    " -> ()": fill_bonus_tokens_cpu,
    "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc)"
    " -> ()": fill_accept_out_cache_loc_cpu,
    "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
    "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
    "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()":
        build_tree_kernel_efficient_cpu,
    "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
    "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
    "Tensor target_predict) -> ()": verify_tree_greedy_cpu,
}


def install_ops() -> None:
    """Register the ops under ``sgl_kernel`` (once per process), before a module looks them up."""
    global _lib
    with _lock:
        if _lib is not None:
            return
        import torch

        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        for schema, fn in _OPS.items():
            name = schema.split("(", 1)[0]
            if hasattr(torch.ops.sgl_kernel, name):
                raise RuntimeError(f"sgl_kernel already has {name}: this is not the CUDA build the stand-in expects")
            lib.define(schema)
            lib.impl(name, fn, "CPU")
        _lib = lib
        say(f"registered {len(_OPS)} sgl_kernel CPU op stand-ins")
