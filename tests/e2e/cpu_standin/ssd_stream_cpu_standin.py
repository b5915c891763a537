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

Every number these produce proves nothing about kernels or speed: they make the engine's control flow,
the kit's hooks and patches, and the HTTP contract run on a CPU. Each stand-in logs once per process when
it first runs (``ssd_stream_cpu_standin: ran <name>``), so a test can tell a stand-in from the real thing.

Probes (test evidence, no behaviour change): the QSA prefill row-chunk function logs the budget it read.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
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
    "sglang.srt.layers.attention.linear.kernels.gdn_triton", "sgl_kernel.mamba",
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


_AFTER = {
    "sglang.srt.utils.common": _after_utils_common,
    "sglang.kernels.ops.attention.fla.layernorm_gated": _after_layernorm_gated,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _after_layernorm_gated,
    "sglang.srt.layers.attention.qsa.qsa_indexer": _after_qsa_indexer,
    "sglang.srt.models.qwen4_exp_ple_table": _after_ple_table,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.after(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in _BEFORE:
            install_ops()
        after = _AFTER.get(name)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


def arm() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# ----------------------------------------------------------------------------- CUDA streams on a CPU


class _Stream:
    """A CUDA stream stand-in: CPU work runs in program order, so every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        ran("torch.cuda.Stream")

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        return None

    def query(self):
        return True


class _Event:
    def __init__(self, *args, **kwargs):
        ran("torch.cuda.Event")

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


_current = threading.local()


def _current_stream(device=None):
    s = getattr(_current, "stream", None)
    if s is None:
        s = _current.stream = _Stream()
    return s


@contextlib.contextmanager
def _stream(s):
    prev = getattr(_current, "stream", None)
    _current.stream = s if s is not None else prev
    try:
        yield s
    finally:
        _current.stream = prev


def _cuda_streams() -> None:
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda, "_ssd_stream_cpu_standin", False):
        return
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream, torch.cuda.stream = _current_stream, _stream
    torch.cuda._ssd_stream_cpu_standin = True
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _Stream):
            return None
        return original(self, stream)

    torch.Tensor.record_stream = record_stream


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
