"""RED/GREEN check for patch 0002 (per-layer FP8 KV descales in QSA, sglang 0.5.23).

Runs inside the sglang venv against whichever sglang is first on sys.path, on the CPU: the
Triton kernels under the interpreter (small shapes), the backend through its own code with a
real ``MHATokenToKVPool`` (FP8, CPU) and a real ``RadixAttention`` layer whose checkpoint scales
are set as the loader sets them (``k_scale_float``/``v_scale_float``).

An FP8 pool holds ``x / scale`` (sglang's convention); every read must multiply it back.
Pristine sglang writes unscaled and has no way to take the scales: RED. Regression guards
(pass on both): BF16 pools and layers without scales behave as before, and the caller's K/V
are not modified by the write. Unit-scale and BF16 outputs are saved to ``$QSA_CHECK_OUT`` for
the outer test, which compares the pristine and the patched run bit for bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import qsa_interpreter  # sibling module: shared interpreter fixes
import torch
from sglang.srt.layers.attention import qwen_sparse_attn_backend as backend_mod
from sglang.srt.layers.attention.qsa import sparse_attn as sa
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

H_Q, H_KV, D = 16, 2, 64
SCALE = D ** -0.5
FP8 = torch.float8_e4m3fn
KS, VS = 4.0, 0.25  # checkpoint descales used throughout
OUT = qsa_interpreter.output_dir("qsa-0002-")
qsa_interpreter.install()


def _save(name, *tensors):
    qsa_interpreter.save(OUT, name, *tensors)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _attention(q, k, v, sel):
    return qsa_interpreter.reference_attention(q, k, v, sel, SCALE, H_KV)


_rel = qsa_interpreter.rel_err


def _stored(x, scale):
    """What an FP8 pool holds for x under a descale (sglang: x / scale, then the cast)."""
    return (x / scale).to(FP8)


# --------------------------------------------------------------------------- kernels

def _problem(seed, rows=8, topk=64, ctx=384):
    g = _gen(seed)
    q = torch.randn(rows, H_Q, D, generator=g).bfloat16()
    k = torch.randn(ctx, H_KV, D, generator=g) * 600  # beyond E4M3's +-448 until descaled
    v = torch.randn(ctx, H_KV, D, generator=g) * 0.02  # E4M3 subnormals until descaled
    idx = torch.stack([torch.randperm(ctx - rows, generator=g)[:topk].sort().values
                       for _ in range(rows * H_KV)]).reshape(rows, H_KV, topk).int()
    return q * 0.05, k, v, idx


def _chunk(q, k, v, idx, **scales):
    rows, ctx = q.shape[0], k.shape[0]
    return sa.sparse_gqa_fwd_interface_triton_ck(
        q, k, v, idx, torch.tensor([0, rows], dtype=torch.int32), torch.tensor([0, ctx], dtype=torch.int32),
        torch.tensor([ctx], dtype=torch.int32), SCALE, max_q=rows, **scales)


def _paged(q, k, v, idx, **scales):
    rows, ctx = q.shape[0], k.shape[0]
    perm = torch.randperm(ctx, generator=_gen(7)).int()
    pool_k, pool_v = torch.empty_like(k), torch.empty_like(v)
    pool_k[perm.long()], pool_v[perm.long()] = k, v
    ind = idx[:, 0].contiguous()
    out = sa.sparse_gqa_paged_prefill_triton(
        q, pool_k, pool_v, perm[None], ind, torch.tensor([0, rows], dtype=torch.int32),
        torch.tensor([ctx], dtype=torch.int32), SCALE, max_q=rows, **scales)
    return out, k, v, torch.stack([ind, ind], 1)


def _decode(q, k, v, idx, **scales):
    rows, topk = q.shape[0], idx.shape[-1]
    ind = idx[:, 0].long()
    kp, vp = k[ind].reshape(rows * topk, H_KV, D), v[ind].reshape(rows * topk, H_KV, D)
    rel = torch.arange(topk, dtype=torch.int32).expand(rows, -1).contiguous()
    cu_q = torch.arange(rows + 1, dtype=torch.int32)
    out = sa.sparse_gqa_packed_decode_triton(q, kp, vp, rel, cu_q, cu_q * topk,
                                             torch.full((rows,), topk, dtype=torch.int32), SCALE, **scales)
    flat = (torch.arange(rows)[:, None] * topk + torch.arange(topk)[None, :]).int()
    return out, kp, vp, torch.stack([flat, flat], 1)


def _launch(path, q, k, v, idx, **scales):
    if path == "chunk":
        return _chunk(q, k, v, idx, **scales), k, v, idx
    return {"paged": _paged, "decode": _decode}[path](q, k, v, idx, **scales)


@pytest.mark.parametrize("path", ["chunk", "paged", "decode"])
def test_chunk_kernel_launchers_apply_descales(path):
    q, k, v, idx = _problem(1)
    out, k8, v8, sel = _launch(path, q, _stored(k, KS), _stored(v, VS), idx, k_scale=KS, v_scale=VS)
    ref = _attention(q, k8.double() * KS, v8.double() * VS, sel)
    assert _rel(out, ref) < 1e-2


def _gather_problem(seed, ctx=96, batch=3, topk=24):
    g = _gen(seed)
    k = torch.randn(ctx, H_KV, D, generator=g) * 600
    v = torch.randn(ctx, H_KV, D, generator=g) * 0.02
    r2t = torch.stack([torch.randperm(ctx, generator=g) for _ in range(batch)]).int()
    return _stored(k, KS), _stored(v, VS), r2t


def test_pack_descales_exactly():
    k8, v8, r2t = _gather_problem(2)
    lens = [40, 96, 17]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    pk, pv = sa.pack_qsa_prefill_kv(k=k8, v=v8, req_to_token=r2t,
                                    req_indices=torch.tensor([2, 0, 1], dtype=torch.int32),
                                    cu_k=cu, total_k=sum(lens), max_k=max(lens), output_dtype=torch.bfloat16,
                                    k_scale=KS, v_scale=VS)
    slots = torch.cat([r2t[r, :n].long() for r, n in zip((2, 0, 1), lens, strict=False)])
    assert torch.equal(pk, (k8.float()[slots] * KS).bfloat16())
    assert torch.equal(pv, (v8.float()[slots] * VS).bfloat16())


def _compact(k8, v8, r2t, out_dtype, **scales):
    batch, topk = r2t.shape[0], 24
    ind = torch.stack([torch.randperm(40, generator=_gen(b))[:topk] for b in range(batch)]).int()
    seq = torch.full((batch,), 40, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32) * topk
    ok = torch.zeros(batch * topk, H_KV, D, dtype=out_dtype)
    ov = torch.zeros_like(ok)
    sa.qwen_sparse_kv_extraction_compact_triton(k8, v8, r2t, torch.arange(batch, dtype=torch.int32), ind, seq,
                                                cu, ok, ov, batch, topk, **scales)
    slots = torch.stack([r2t[b].long()[ind[b].long()] for b in range(batch)]).reshape(-1)
    return ok, ov, slots


def test_compact_descales_exactly():
    k8, v8, r2t = _gather_problem(3)
    ok, ov, slots = _compact(k8, v8, r2t, torch.bfloat16, k_scale=KS, v_scale=VS)
    assert torch.equal(ok, (k8.float()[slots] * KS).bfloat16())
    assert torch.equal(ov, (v8.float()[slots] * VS).bfloat16())


def test_same_dtype_copy_refuses_a_descale():
    """FP8 -> FP8 scratch (the TRT-LLM path) cannot carry a scale: refused, not dropped."""
    k8, v8, r2t = _gather_problem(4)
    ok, ov, slots = _compact(k8, v8, r2t, FP8, k_scale=1.0, v_scale=1.0)
    assert torch.equal(ok.view(torch.uint8), k8.view(torch.uint8)[slots])
    with pytest.raises(ValueError, match="k_scale"):
        _compact(k8, v8, r2t, FP8, k_scale=KS, v_scale=1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_invalid_descales_are_refused(bad):
    q, k, v, idx = _problem(5)
    with pytest.raises(ValueError, match="k_scale"):
        _chunk(q, _stored(k, KS), _stored(v, VS), idx, k_scale=bad, v_scale=1.0)


def test_unit_scale_and_bf16_outputs_for_comparison():
    """Saved for the outer test: bit-identical to pristine's for BF16 K/V, and for the FP8
    gathers at unit scale (0003 changes the FP8 chunk-kernel numerics, not the gathers)."""
    q, k, v, idx = _problem(6)
    k, v = k / 600, v * 50  # in E4M3 range unscaled
    kb, vb = k.bfloat16(), v.bfloat16()
    for path in ("chunk", "paged", "decode"):
        out, kr, vr, sel = _launch(path, q, kb, vb, idx)
        _save(f"{path}-bf16", out)
        assert _rel(out, _attention(q, kr, vr, sel)) < 1e-2
    k8, v8, r2t = _gather_problem(8)
    for dt, (kk, vv) in {"bf16": (k8.bfloat16(), v8.bfloat16()), "fp8": (k8, v8)}.items():
        ok, ov, _ = _compact(kk, vv, r2t, torch.bfloat16)
        _save(f"compact-{dt}", ok, ov)
        pk, pv = sa.pack_qsa_prefill_kv(k=kk, v=vv, req_to_token=r2t, req_indices=torch.tensor([1], dtype=torch.int32),
                                        cu_k=torch.tensor([0, 96], dtype=torch.int32), total_k=96, max_k=96,
                                        output_dtype=torch.bfloat16)
        _save(f"pack-{dt}", pk, pv)
        assert torch.equal(pk, kk.float()[r2t[1].long()].bfloat16())


# --------------------------------------------------------------------------- backend

CTX = 40  # prefill tokens, then one decode token


class _Run:
    """The real QwenSparseAttnBackend over a real MHATokenToKVPool on the CPU (the backend's
    non-CUDA read path), with only its per-batch metadata filled in by hand."""

    def __init__(self, pool_dtype, k_scale, v_scale, seed=11, k_mag=300.0, v_mag=0.02):
        g = _gen(seed)
        self.layer = RadixAttention(H_Q, D, SCALE, H_KV, layer_id=0)
        self.layer.k_scale_float, self.layer.v_scale_float = k_scale, v_scale
        self.pool = MHATokenToKVPool(size=64, page_size=1, dtype=pool_dtype, head_num=H_KV, head_dim=D,
                                     layer_num=1, device="cpu", enable_memory_saver=False,
                                     enable_alt_stream=False)
        self.slots = torch.randperm(63, generator=g)[: CTX + 1] + 1  # slot 0 is the padding slot
        be = object.__new__(backend_mod.QwenSparseAttnBackend)
        be.token_to_kv_pool = self.pool
        be.req_to_token_pool = SimpleNamespace(req_to_token=self.slots[None].int())
        be._fused_kv_pool_eligible = False
        be.qsa_profile, be.compress_ratio, be._cp_kv_pending = None, 1, None
        self.be = be
        self.q = torch.randn(CTX + 1, H_Q, D, generator=g).bfloat16() * 0.05
        self.k = (torch.randn(CTX + 1, H_KV, D, generator=g) * k_mag).bfloat16()
        self.v = (torch.randn(CTX + 1, H_KV, D, generator=g) * v_mag).bfloat16()
        topk = 16
        self.idx = torch.full((CTX + 1, topk), -1, dtype=torch.int32)
        for i in range(CTX + 1):  # row i sees logical positions 0..i
            pick = torch.randperm(i + 1, generator=g)[:topk].sort().values
            self.idx[i, : pick.numel()] = pick.int()

    def pool_dequantized(self, k_scale, v_scale):
        """The pool's contents for this request's positions, times the descales (float64)."""
        return (self.pool.get_key_buffer(0)[self.slots].double() * k_scale,
                self.pool.get_value_buffer(0)[self.slots].double() * v_scale)

    def _metadata(self, rows, seq_len):
        self.be.forward_metadata = SimpleNamespace(
            token_to_batch_idx=torch.zeros(rows, dtype=torch.int32),
            sequence_lengths=torch.tensor([seq_len], dtype=torch.int32),
            token_slot_table=self.slots[None].int(), is_cuda_graph=False, row_req_pool_indices=None)

    def extend(self):
        self._metadata(CTX, CTX)
        fb = SimpleNamespace(attn_cp_metadata=None, out_cache_loc=self.slots[:CTX], forward_mode=ForwardMode.EXTEND)
        return self.be.forward_extend(self.q[:CTX], self.k[:CTX], self.v[:CTX], self.layer, fb,
                                      topk_indices=self.idx[:CTX])

    def decode(self):
        self._metadata(1, CTX + 1)
        fb = SimpleNamespace(attn_cp_metadata=None, out_cache_loc=self.slots[CTX:], forward_mode=ForwardMode.DECODE)
        return self.be.forward_decode(self.q[CTX:], self.k[CTX:], self.v[CTX:], self.layer, fb,
                                      topk_indices=self.idx[CTX:])

    def reference(self, rows, k=None, v=None):
        """float64 attention over the true K/V, or over given (e.g. dequantized pool) K/V."""
        r = slice(0, CTX) if rows == "extend" else slice(CTX, CTX + 1)
        k = self.k if k is None else k
        v = self.v if v is None else v
        sel = self.idx[r].clone()
        q = self.q[r]
        out = torch.empty(q.shape, dtype=torch.float64)
        g = H_Q // H_KV
        for row in range(q.shape[0]):
            s = sel[row][sel[row] >= 0].long()
            for h in range(H_KV):
                w = (q[row, h * g:(h + 1) * g].double() @ k[s, h].double().T) * SCALE
                out[row, h * g:(h + 1) * g] = torch.softmax(w, -1) @ v[s, h].double()
        return out


def test_backend_prefill_and_decode_apply_checkpoint_scales():
    """K up to ~1,500 and V ~0.02 fit E4M3 only through the layer's scales: pristine stores NaN
    (|K| > 480) and subnormals, patched stores x / scale and reads it back scaled."""
    run = _Run(FP8, KS, 1 / 64)
    out_e = run.extend().reshape(CTX, H_Q, D)
    out_d = run.decode().reshape(1, H_Q, D)
    kd, vd = run.pool_dequantized(KS, 1 / 64)
    assert torch.isfinite(kd).all(), "the pool holds NaN: K was not divided by k_scale"
    # write: E4M3 keeps 3 mantissa bits (2^-4 relative), subnormals below 2^-6 step 2^-9
    torch.testing.assert_close(kd, run.k.double(), rtol=0.07, atol=KS * 2 ** -9)
    torch.testing.assert_close(vd, run.v.double(), rtol=0.07, atol=2 ** -9 / 64)
    # read: the attention that the stored values, descaled, define
    assert _rel(out_e, run.reference("extend", kd, vd)) < 1e-2
    assert _rel(out_d, run.reference("decode", kd, vd)) < 1e-2


def test_backend_write_leaves_the_callers_kv_untouched():
    """set_kv_buffer divides in place; the prefill after the write reads the same k/v."""
    run = _Run(FP8, KS, 1 / 64, k_mag=100.0)
    k0, v0 = run.k.clone(), run.v.clone()
    run.extend()
    run.decode()
    assert torch.equal(run.k, k0) and torch.equal(run.v, v0)


def test_backend_bf16_pool_ignores_checkpoint_scales():
    run = _Run(torch.bfloat16, KS, VS, k_mag=3.0, v_mag=1.0)
    out = run.extend().reshape(CTX, H_Q, D)
    assert torch.equal(run.pool.get_key_buffer(0)[run.slots[:CTX]], run.k[:CTX])
    assert _rel(out, run.reference("extend")) < 1e-2


@pytest.mark.parametrize("absent", [None, -1.0])
def test_backend_layer_without_scales_means_one(absent):
    """None (no scales in the checkpoint) or -1 (the loader's placeholder): stored as x."""
    run = _Run(FP8, absent, absent, k_mag=3.0, v_mag=1.0)
    out = run.extend().reshape(CTX, H_Q, D)
    stored = run.pool.get_key_buffer(0)[run.slots[:CTX]]
    assert torch.equal(stored.view(torch.uint8), run.k[:CTX].to(FP8).view(torch.uint8))
    assert _rel(out, run.reference("extend")) < 0.05


def test_trtllm_decode_gets_the_bmm_descales():
    """TRT-LLM decode: scratch holds the pool's values; the descales go to the BMM scales.
    FlashInfer's kernel is stood in by a float64 paged decode that honours both scales."""
    run = _Run(FP8, KS, 1 / 64)
    run.extend()
    seen = {}

    def trtllm_decode(*, query, kv_cache, block_tables, seq_lens, bmm1_scale, bmm2_scale, **_):
        seen.update(bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)
        kc, vc = kv_cache  # [pages, H_KV, page, D]
        out = torch.empty(query.shape, dtype=torch.float64)
        g = H_Q // H_KV
        for b in range(query.shape[0]):
            n = int(seq_lens[b])
            keys = kc[block_tables[b].long()].permute(1, 0, 2, 3).reshape(H_KV, -1, D)[:, :n].double()
            vals = vc[block_tables[b].long()].permute(1, 0, 2, 3).reshape(H_KV, -1, D)[:, :n].double()
            for h in range(H_KV):
                w = query[b, h * g:(h + 1) * g].double() @ keys[h].T * bmm1_scale
                out[b, h * g:(h + 1) * g] = torch.softmax(w, -1) @ vals[h] * bmm2_scale
        return out.to(query.dtype)

    run._metadata(1, CTX + 1)
    run.pool.set_kv_buffer(run.layer, run.slots[CTX:], *(  # the decode token, written as the backend writes it
        backend_mod._kv_for_store(run.k[CTX:], run.v[CTX:], KS, 1 / 64)
        if hasattr(backend_mod, "_kv_for_store") else (run.k[CTX:], run.v[CTX:])))
    run.be._fa2_scratch, run.be._trtllm_sparse_tables, run.be._trtllm_counters = {}, {}, {}
    run.be._trtllm_workspace = torch.zeros(1, dtype=torch.uint8)
    run.be._trtllm_counters[(1, H_Q, torch.device("cpu"))] = torch.zeros(1, dtype=torch.uint8)
    fb = SimpleNamespace(req_pool_indices=torch.zeros(1, dtype=torch.int32), forward_mode=ForwardMode.DECODE)
    out = run.be._forward_trtllm_sparse(
        run.q[CTX:], run.pool.get_key_buffer(0), run.pool.get_value_buffer(0), run.layer, fb,
        run.be.forward_metadata, run.idx[CTX:], trtllm_decode)
    assert seen == {"bmm1_scale": SCALE * KS, "bmm2_scale": 1 / 64}
    kd, vd = run.pool_dequantized(KS, 1 / 64)
    assert _rel(out.reshape(1, H_Q, D), run.reference("decode", kd, vd)) < 1e-2
