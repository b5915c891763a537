"""The GPU harness's stand-ins (``scripts/gpu/sgl_kernel_standin``, ``scripts/gpu/flash_attn_standin``) against
plain references, on CPU. Each check runs in a child process: the sgl_kernel stand-in registers
``torch.ops.sgl_kernel.*`` for the process, which must not meet a real sgl_kernel in this one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"

PRELUDE = """
import importlib.util, sys, torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
torch.manual_seed(0)
"""


def run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_moe_align_block_size_follows_the_plus_one_offset_contract():
    """sglang calls it with E + 1 buckets (expert e in bucket e + 1, -1 in bucket 0), pad_sorted_token_ids on:
    each bucket padded to a block multiple in bucket order, pad slots hold numel, each block's expert is its
    bucket - 1, and every (token, slot) pair sits once in its own bucket."""
    run(f"""
    load("common_ops", {str(GPU / "sgl_kernel_standin" / "common_ops.py")!r})
    import random
    rnd = random.Random(0)
    for case in range(200):
        experts, topk, tokens = rnd.randint(1, 9), rnd.randint(1, 3), rnd.randint(1, 40)
        block = rnd.choice([4, 16, 64])
        ids = torch.randint(-1 if case % 3 == 0 else 0, experts, (tokens, topk), dtype=torch.int32)
        n, buckets = ids.numel(), experts + 1
        cap = n + buckets * (block - 1)
        sorted_ids = torch.full((cap,), -7, dtype=torch.int32)
        blocks = (cap + block - 1) // block
        expert_ids = torch.full((blocks,), -7, dtype=torch.int32)
        post = torch.zeros(1, dtype=torch.int32)
        cumsum = torch.zeros(buckets + 1, dtype=torch.int32)
        torch.ops.sgl_kernel.moe_align_block_size(ids, buckets, block, sorted_ids, expert_ids, post, cumsum,
                                                  True, False)
        flat = (ids.flatten() + 1).tolist()
        start = 0
        for b in range(buckets):
            members = sorted(i for i, x in enumerate(flat) if x == b)
            padded = -(-len(members) // block) * block
            got = sorted_ids[start:start + padded].tolist()
            assert got[:len(members)] == members, (case, b, got, members)  # stable within the bucket
            assert got[len(members):] == [n] * (padded - len(members)), (case, b, got)
            assert expert_ids[start // block:(start + padded) // block].tolist() == [b - 1] * (padded // block)
            start += padded
        assert post.item() == start, (case, post, start)
        assert cumsum[1:].tolist() == [sum(-(-flat.count(b) // block) * block for b in range(k + 1))
                                       for k in range(buckets)]
    print("ok")
    """)


def test_elementwise_and_moe_reduction_standins():
    run(f"""
    load("common_ops", {str(GPU / "sgl_kernel_standin" / "common_ops.py")!r})
    ops = torch.ops.sgl_kernel
    x = torch.randn(5, 2 * 24, dtype=torch.bfloat16)
    out = torch.empty(5, 24, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    ref = torch.nn.functional.silu(x[:, :24].float()) * x[:, 24:].float()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    y = torch.randn(7, 3, 16, dtype=torch.bfloat16)
    o = torch.empty(7, 16, dtype=torch.bfloat16)
    ops.moe_sum_reduce(y, o, 2.5)
    torch.testing.assert_close(o.float(), y.float().sum(1) * 2.5, atol=5e-2, rtol=2e-2)
    g = torch.randn(6, 8)
    w, i = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32)
    ops.topk_softmax(w, i, g, True, 0.0, None)
    p = torch.softmax(g, -1)
    ref_w, ref_i = torch.topk(p, 2, -1)
    assert torch.equal(i.long(), ref_i)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True))
    assert ops.weak_ref_tensor(g).data_ptr() == g.data_ptr()
    assert not hasattr(ops, "fp8_scaled_mm")  # absent ops stay absent for sglang's hasattr probes
    print("ok")
    """)


def test_flash_attn_varlen_matches_per_sequence_attention():
    """Decode-shaped (one query per sequence, what sglang's QSA decode sends) and causal prefill-shaped calls,
    GQA, an empty sequence, against torch's SDPA per sequence (causal aligned to the bottom right)."""
    run(f"""
    fa = load("flash_attn", {str(GPU / "flash_attn_standin" / "__init__.py")!r})
    import torch.nn.functional as F
    def reference(q, k, v, cu_q, cu_k, scale, causal):
        out = torch.zeros_like(q, dtype=torch.float32)
        hq, hkv = q.shape[1], k.shape[1]
        for b in range(cu_q.numel() - 1):
            qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            if qe == qs or ke == ks:
                continue
            qq = q[qs:qe].float().transpose(0, 1)
            kk = k[ks:ke].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
            vv = v[ks:ke].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
            mask = None
            if causal:
                lq, lk = qe - qs, ke - ks
                mask = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
            out[qs:qe] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1)
        return out
    for lens_q, lens_k in (([1, 1, 1, 1], [5, 0, 17, 2051]), ([3, 6, 1], [3, 9, 4])):
        cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu_q[-1]), 4, 32, dtype=torch.bfloat16)
        k = torch.randn(int(cu_k[-1]) + 3, 1, 32, dtype=torch.bfloat16)  # spare rows, as sglang's scratch has
        v = torch.randn_like(k)
        out = fa.flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), softmax_scale=0.17,
                                        causal=True)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.float(), reference(q, k, v, cu_q, cu_k, 0.17, True), atol=2e-2, rtol=2e-2)
    print("ok")
    """)
