"""GPU-HARNESS STAND-IN for ``flash_attn.flash_attn_varlen_func`` (never shipped; imports nothing of the kit or
sglang).

Why: sglang 0.5.23's QSA backend decodes on SM90 (H100/H200) through a packed varlen attention it takes from
``flash_attn`` (FA2) or ``flash_attn.cute`` (flash-attn-4); ``qwen_sparse_attn_backend._resolve_flash_attn_varlen_func``
raises ``ImportError`` when neither imports (its trtllm route is SM100/SM120 only, its Triton
``sparse_gqa_packed_decode_triton`` route HIP only). Neither can be carried to the GPU machine: FA2 is a compiled
extension built against one torch (no build for the machine's torch 2.11 is at hand), and flash-attn-4 needs
nvidia-cutlass-dsl (486 MB installed), past a call's 64 MiB. ``scripts/gpu/sglang_server_gpu.py`` puts this file at
``flash_attn/__init__.py`` of the carried site only when the machine has no importable ``flash_attn_varlen_func``.

What it does: FA2's ``flash_attn_varlen_func`` contract (``q`` ``[total_q, Hq, D]``, ``k``/``v``
``[total_k, Hkv, D]``, GQA by ``Hq // Hkv``, ``cu_seqlens_*`` int32 prefix sums, causal masks aligned to the
bottom right, a sequence with no key gives zeros) in plain torch, float32 math, cast to ``q``'s dtype. No host
sync (capturable in a CUDA graph): every row reads ``max_seqlen_k`` keys from its sequence's start and masks.
Dropout, sliding windows, softcap and ALiBi are refused. It says once per process, on stderr, that it ran.
No ``flash_attn_func``: sglang's transformers patch then keeps ``is_flash_attn_2_available()`` false.
"""

from __future__ import annotations

import os
import sys

import torch

PREFIX = "flash_attn-standin"
_ran = False


def _say(msg: str) -> None:
    print(f"{PREFIX}: pid {os.getpid()}: {msg}", file=sys.stderr, flush=True)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, **kwargs):
    global _ran
    if not _ran:
        _ran = True
        _say("ran stand-in op flash_attn.flash_attn_varlen_func")
    if dropout_p or softcap or alibi_slopes is not None or block_table is not None or return_attn_probs:
        raise NotImplementedError("flash_attn stand-in: dropout, softcap, alibi, block_table, attn probs")
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"flash_attn stand-in: window_size {window_size}")
    unknown = {key: val for key, val in kwargs.items() if val not in (None, False, 0, 0.0)}
    if unknown:
        raise NotImplementedError(f"flash_attn stand-in: {sorted(unknown)}")
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    dev = q.device
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    nseq = cu_q.numel() - 1
    rows = torch.arange(total_q, device=dev)
    seq = torch.searchsorted(cu_q[1:].contiguous(), rows, right=True).clamp(max=nseq - 1)
    qpos = rows - cu_q[seq]
    len_q = cu_q[seq + 1] - cu_q[seq]
    len_k = cu_k[seq + 1] - cu_k[seq]
    j = torch.arange(max(int(max_seqlen_k), 1), device=dev)
    valid = (j[None, :] < len_k[:, None]) & (rows < cu_q[-1])[:, None]
    if causal:
        valid &= j[None, :] <= (len_k - len_q + qpos)[:, None]
    kidx = (cu_k[seq][:, None] + j[None, :]).clamp(0, max(k.shape[0] - 1, 0))
    kg, vg = k[kidx].float(), v[kidx].float()  # [T, Lk, Hkv, D]
    qf = q.float().reshape(total_q, hkv, hq // hkv, d)
    s = torch.einsum("thgd,tjhd->thgj", qf, kg) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("thgj,tjhd->thgd", p, vg).reshape(total_q, hq, d)
    return out.to(q.dtype)


_say("loaded in place of flash_attn (FA2): flash_attn_varlen_func only")
