"""Run by tests/sglang/test_triton_interpreter.py in the sglang venv, once per interpreter (not a check module).

``python interpreter_kernels.py OUT.npz`` with ``TRITON_INTERPRET=1``; ``SSD_TESTS_TRITON_INTERPRETER=upstream``
selects triton's interpreter as shipped, else tests/triton_interpreter.py's is installed first. Runs sglang's own
per-token kernels (the two that took most of a CPU server's time) and a kernel of nested ``@jit`` calls, reductions
and a scan, and saves every output, which ``triton.language`` attributes differ from their import-time values
after the launches, and what happens after a launch that raises.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from sglang.kernels.ops.elementwise.elementwise import _fused_gate_sigmoid_mul_add_kernel  # noqa: E402
from sglang.srt.models.qwen4_exp import _gather_ple_embedding_from_pinned_kernel  # noqa: E402

import tests.triton_interpreter as fast  # noqa: E402 - arms itself unless the off switch is set


@triton.jit
def _helper(x, scale: tl.constexpr):
    return tl.sigmoid(x) * scale


@triton.jit
def _pair_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _nested_kernel(x_ptr, out_ptr, red_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + pid * n + offs, mask=mask, other=0.0)
    y = _helper(x, 2.0)
    y = tl.where(x > 0, y, tl.exp(x))
    tl.store(out_ptr + pid * n + offs, tl.cumsum(y, axis=0), mask=mask)
    tl.store(red_ptr + pid * 3, tl.sum(y, axis=0))
    tl.store(red_ptr + pid * 3 + 1, tl.max(tl.where(mask, x, -1e30), axis=0))
    tl.store(red_ptr + pid * 3 + 2, tl.reduce(tl.where(mask, y, -1e30), 0, _pair_max))


@triton.jit
def _raising_kernel(x_ptr, N: tl.constexpr):
    tl.static_assert(N > 100, "raised on purpose")
    tl.store(x_ptr, 1.0)


def _lang_state(originals):
    return sorted(f"{owner}.{name}" for (owner, name), value in originals.items()
                  if getattr(_OWNERS[owner], name, None) is not value)


_OWNERS = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tensor": tl.core.tensor}


def main(out_path: str) -> None:
    originals = {(owner, name): getattr(obj, name) for owner, obj in _OWNERS.items() for name in dir(obj)
                 if not name.startswith("__")}
    g = torch.Generator().manual_seed(0)
    res = {"installed": np.array(fast._state["installed"])}
    for n in (1, 7):
        h = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        w = torch.randn(64, generator=g).to(torch.bfloat16)
        s = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        o = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        _fused_gate_sigmoid_mul_add_kernel[(n,)](h, w, s, o, hidden_dim=64, DO_ADD=True, USE_PDL=False,
                                                 GATE_ONLY=False, BLOCK_SIZE=64, num_warps=4)
        gate = torch.empty(n, dtype=torch.float32)
        _fused_gate_sigmoid_mul_add_kernel[(n,)](h, w, None, gate, hidden_dim=64, DO_ADD=False, USE_PDL=False,
                                                 GATE_ONLY=True, BLOCK_SIZE=64, num_warps=4)
        res[f"gate_add_{n}"] = o.float().numpy()
        res[f"gate_only_{n}"] = gate.numpy()
    for fp8 in (False, True):
        table = torch.randn(50, 40, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        ids = torch.tensor([0, 49, 7, 60, 7, -1, 23], dtype=torch.long)  # 60 and -1: outside the shard
        out = torch.empty(ids.numel(), 40, dtype=torch.bfloat16)
        _gather_ple_embedding_from_pinned_kernel[(ids.numel(),)](table.data_ptr(), ids, out, embedding_dim=40,
                                                                 tp_vocab_start=0, tp_vocab_end=50, is_fp8=fp8,
                                                                 BLOCK_D=64)
        res[f"ple_gather_fp8_{fp8}"] = out.float().numpy()
    x = torch.randn(5, 37, generator=g)
    out, red = torch.empty_like(x), torch.empty(5, 3)
    _nested_kernel[(5,)](x, out, red, 37, BLOCK=64)
    res["nested_out"], res["nested_red"] = out.numpy(), red.numpy()
    res["lang_state_after"] = np.array(_lang_state(originals))
    try:
        _raising_kernel[(2,)](torch.zeros(1), N=1)
        res["raised"] = np.array("no")
    except Exception as exc:  # noqa: BLE001 - the kind is compared between the two interpreters
        res["raised"] = np.array(type(exc).__name__)
    res["launch_state_after_raise"] = np.array(repr(getattr(fast._tls, "done", None)))
    y = torch.zeros(5, 37)
    _nested_kernel[(5,)](x, y, torch.empty(5, 3), 37, BLOCK=64)  # still runs, and alike, after the raise
    res["nested_after_raise"] = y.numpy()
    np.savez(out_path, **res)


if __name__ == "__main__":
    main(sys.argv[1])
