"""GPU-HARNESS STAND-IN for sgl_kernel's compiled ``common_ops`` (never shipped; imports nothing of the kit or sglang).

Why: sglang-kernel 0.4.10's ``sm90/common_ops.abi3.so`` links torch's C++ ABI, and three of its 97 symbols are
absent from the GPU machine's torch 2.11.0 (``undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev``), so it
cannot load there. ``scripts/gpu/sglang_server_gpu.py`` puts this file at ``sgl_kernel/sm90/common_ops.py`` (and
``sm100/``) of the carried sgl_kernel tree, whose own loader (``load_utils._load_architecture_specific_ops``) then
loads it where it would have loaded the ``.so``. sgl_kernel's Python wrappers stay real: they call
``torch.ops.sgl_kernel.<op>`` as they would call the compiled op.

What it registers (namespace ``sgl_kernel``, CUDA and CPU), each in plain torch (float32 math, cast on store), no
host sync, so CUDA-graph capturable. Each op says once per process, on stderr, that it ran:

================================  ===============================================================================
op                                 stands in for (what sglang calls it from on CUDA)
================================  ===============================================================================
rmsnorm, fused_add_rmsnorm         the RMSNorm kernels (``layers/layernorm.py`` RMSNorm.forward_cuda, when
                                   flashinfer is absent: sgl_kernel.elementwise falls back to these ops)
gemma_rmsnorm, gemma_fused_add_    GemmaRMSNorm (weight ``1 + w``), same route
rmsnorm
silu_and_mul, gelu_and_mul,        act-and-mul for widths the JIT kernel refuses (``layers/activation.py``)
gelu_tanh_and_mul
topk_softmax, topk_sigmoid         MoE routing (``layers/moe/topk.py``)
moe_sum_reduce, moe_sum            the fused-MoE output reduction (``moe_runner/triton_utils/fused_moe.py``)
moe_align_block_size               the fused-MoE token sort by expert (``triton_utils/moe_align_block_size.py``
                                   through ``sglang.kernels.ops.moe``, its AOT backend; found by GPU call 3)
rotary_embedding                   in-place RoPE with a cos/sin cache (``rotary_embedding/base.py``)
weak_ref_tensor                    the CUDA graph runner's output refs: here an alias (keeps the storage alive)
================================  ===============================================================================

Every other ``torch.ops.sgl_kernel.<name>`` stays absent (AttributeError naming it, as sglang's ``hasattr`` probes
expect: a catch-all stub that made them true broke ``register_fake_if_exists`` at import, first GPU call). The names
looked up and absent, and the stand-ins that ran, are printed at a clean exit (``GPU_STANDIN_REPORT`` names a file
to append the JSON to; sglang warns about any ``SGL_*`` variable).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
import torch.nn.functional as F

PREFIX = "sgl_kernel-standin"
_ran: set[str] = set()
_looked_up: set[str] = set()


def _say(msg: str) -> None:
    print(f"{PREFIX}: pid {os.getpid()}: {msg}", file=sys.stderr, flush=True)


def _mark(name: str) -> None:
    if name not in _ran:
        _ran.add(name)
        _say(f"ran stand-in op sgl_kernel.{name}")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(out, input, weight, eps, enable_pdl):
    _mark("rmsnorm")
    out.copy_((_rms(input, eps) * weight.float()).to(out.dtype))


def fused_add_rmsnorm(input, residual, weight, eps, enable_pdl):
    _mark("fused_add_rmsnorm")
    r = input.float() + residual.float()
    residual.copy_(r.to(residual.dtype))
    input.copy_((_rms(r, eps) * weight.float()).to(input.dtype))


def gemma_rmsnorm(out, input, weight, eps, enable_pdl):
    _mark("gemma_rmsnorm")
    out.copy_((_rms(input, eps) * (1.0 + weight.float())).to(out.dtype))


def gemma_fused_add_rmsnorm(input, residual, weight, eps, enable_pdl):
    _mark("gemma_fused_add_rmsnorm")
    r = input.float() + residual.float()
    residual.copy_(r.to(residual.dtype))
    input.copy_((_rms(r, eps) * (1.0 + weight.float())).to(input.dtype))


def _act_and_mul(name, act):
    def op(out, input):
        _mark(name)
        d = input.shape[-1] // 2
        x = input.float()
        out.copy_((act(x[..., :d]) * x[..., d:]).to(out.dtype))
    return op


def _topk(weights_out, ids_out, scores, renormalize, correction_bias):
    k = ids_out.shape[-1]
    choose = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choose, k, dim=-1).indices
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    weights_out.copy_(w.to(weights_out.dtype))
    ids_out.copy_(ids.to(ids_out.dtype))


def topk_softmax(topk_weights, topk_ids, gating_output, renormalize, moe_softcapping, correction_bias):
    _mark("topk_softmax")
    g = gating_output.float()
    if moe_softcapping:
        g = torch.tanh(g / moe_softcapping) * moe_softcapping
    _topk(topk_weights, topk_ids, torch.softmax(g, dim=-1), renormalize, correction_bias)


def topk_sigmoid(topk_weights, topk_ids, gating_output, renormalize, correction_bias):
    _mark("topk_sigmoid")
    _topk(topk_weights, topk_ids, torch.sigmoid(gating_output.float()), renormalize, correction_bias)


def moe_sum_reduce(input, output, routed_scaling_factor):
    _mark("moe_sum_reduce")
    s = input.float().sum(dim=1)
    if routed_scaling_factor:
        s = s * routed_scaling_factor
    output.copy_(s.to(output.dtype))


def moe_sum(input, output):
    _mark("moe_sum")
    output.copy_(input.float().sum(dim=1).to(output.dtype))


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    _mark("rotary_embedding")
    pos = positions.flatten().long()
    cs = cos_sin_cache.index_select(0, pos).float()  # [T, rot]
    rot = cs.shape[-1]
    cos, sin = cs[:, : rot // 2], cs[:, rot // 2:]

    def apply(t):
        if t is None:
            return
        n = pos.numel()
        v = t.view(n, -1, head_size)
        x = v[..., :rot].float()
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
            y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        v[..., :rot].copy_(y.to(t.dtype))
    apply(query)
    apply(key)


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         cumsum_buffer, pad_sorted_token_ids, ignore_invalid_expert):
    """sglang's "+1 offset" contract (``kernels/ops/moe/moe_align_small_numel.py`` spells it out): ``num_experts``
    buckets, expert id e in bucket e + 1 (-1, EP-filtered, in bucket 0), each bucket padded to a block multiple in
    bucket order, pad slots hold ``numel``, each block's expert id is its bucket - 1. Within a bucket the order is
    the pairs' own (stable); the CUDA kernel's is its atomics' (every pair writes its own output row)."""
    _mark("moe_align_block_size")
    flat = topk_ids.flatten().long()
    n, dev = flat.numel(), flat.device
    bucket = flat + 1
    if ignore_invalid_expert:
        bucket = torch.where((bucket >= 0) & (bucket < num_experts), bucket, torch.zeros_like(bucket))
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    num_tokens_post_pad[:1].copy_(ends[-1:].to(num_tokens_post_pad.dtype))
    cumsum_buffer.zero_()
    cumsum_buffer[1:num_experts + 1].copy_(ends.to(cumsum_buffer.dtype))
    order = torch.sort(bucket, stable=True).indices
    sb = bucket[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sb]
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(n)
    sorted_token_ids.scatter_(0, starts[sb] + rank, order.to(sorted_token_ids.dtype))
    blocks = torch.arange(experts_ids.numel(), device=dev) * block_size
    eid = torch.searchsorted(ends, blocks, right=True) - 1
    experts_ids.copy_(torch.where(blocks < ends[-1], eid, torch.full_like(eid, -1)).to(experts_ids.dtype))


def weak_ref_tensor(tensor):
    _mark("weak_ref_tensor")
    return tensor.view(tensor.shape)


OPS = {
    "rmsnorm": ("rmsnorm(Tensor(a!) out, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()", rmsnorm),
    "fused_add_rmsnorm": ("fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, "
                          "bool enable_pdl) -> ()", fused_add_rmsnorm),
    "gemma_rmsnorm": ("gemma_rmsnorm(Tensor(a!) out, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
                      gemma_rmsnorm),
    "gemma_fused_add_rmsnorm": ("gemma_fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
                                "float eps, bool enable_pdl) -> ()", gemma_fused_add_rmsnorm),
    "silu_and_mul": ("silu_and_mul(Tensor(a!) out, Tensor input) -> ()", _act_and_mul("silu_and_mul", F.silu)),
    "gelu_and_mul": ("gelu_and_mul(Tensor(a!) out, Tensor input) -> ()", _act_and_mul("gelu_and_mul", F.gelu)),
    "gelu_tanh_and_mul": ("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()",
                          _act_and_mul("gelu_tanh_and_mul", lambda x: F.gelu(x, approximate="tanh"))),
    "topk_softmax": ("topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor gating_output, "
                     "bool renormalize, float moe_softcapping, Tensor? correction_bias) -> ()", topk_softmax),
    "topk_sigmoid": ("topk_sigmoid(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor gating_output, "
                     "bool renormalize, Tensor? correction_bias) -> ()", topk_sigmoid),
    "moe_sum_reduce": ("moe_sum_reduce(Tensor input, Tensor(a!) output, float routed_scaling_factor) -> ()",
                       moe_sum_reduce),
    "moe_sum": ("moe_sum(Tensor input, Tensor(a!) output) -> ()", moe_sum),
    "rotary_embedding": ("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
                         "Tensor cos_sin_cache, bool is_neox) -> ()", rotary_embedding),
    "moe_align_block_size": ("moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
                             "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, "
                             "Tensor(d!) cumsum_buffer, bool pad_sorted_token_ids, bool ignore_invalid_expert) -> ()",
                             moe_align_block_size),
    "weak_ref_tensor": ("weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)", weak_ref_tensor),
}

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
for _name, (_schema, _fn) in OPS.items():
    _lib.define(_schema)
    for _key in ("CUDA", "CPU"):
        _lib.impl(_name, _fn, _key)


class _Namespace(type(torch.ops.sgl_kernel)):
    """``torch.ops.sgl_kernel`` as before (an op nobody stood in raises AttributeError, so sglang's ``hasattr``
    probes still see it absent), recording each such name for the report."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not name.startswith("__"):
                _looked_up.add(name)
            raise


torch.ops.sgl_kernel.__class__ = _Namespace


def _report() -> None:
    rep = {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "", "ran": sorted(_ran),
           "absent_looked_up": sorted(_looked_up)}
    _say("report " + json.dumps(rep))
    path = os.environ.get("GPU_STANDIN_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rep) + "\n")


atexit.register(_report)
_say(f"loaded in place of sgl_kernel's compiled common_ops: {len(OPS)} ops stood in ({', '.join(OPS)})")
