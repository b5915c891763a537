"""Shared by the QSA check modules, which run inside the sglang venv under TRITON_INTERPRET=1:
interpreter fixes, output files for byte comparison, and the float64 reference."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp


def install() -> None:
    """Make Triton's CPU interpreter compute what compiled kernels compute: a Python float
    argument is an fp32 scalar (not a weak constant that breaks bf16 arithmetic), and tl.dot
    multiplies bf16 values (the interpreter multiplies their uint16 bit patterns)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the engine harness (TRITON_INTERPRET=1)"
    cvt, dot = interp._implicit_cvt, interp.InterpreterBuilder.create_dot

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interp.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    def widen(h):
        if h.dtype == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    interp._implicit_cvt = implicit_cvt
    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, widen(a), widen(b), d, *rest)
    # The launchers pick BF16 tiles by the GPU's name; there is none on the CPU: an H200's.
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"


def output_dir(prefix: str) -> Path:
    return Path(os.environ.get("QSA_CHECK_OUT") or tempfile.mkdtemp(prefix=prefix))


def save(out: Path, name: str, *tensors) -> None:
    """Raw bytes of the outputs: the outer test compares the pristine and patched runs' files."""
    (out / f"{name}.bin").write_bytes(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors))


def reference_attention(q, k, v, sel, scale: float, h_kv: int):
    """float64 sparse GQA of q [rows, H_Q, D] over rows ``sel`` [rows, h_kv, topk] of k/v."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // h_kv
    for h in range(h_kv):
        s = sel[:, h].long()
        kk, vv = k[:, h].double()[s], v[:, h].double()[s]
        w = torch.einsum("rgd,rtd->rgt", q.double()[:, h * g:(h + 1) * g], kk) * scale
        out[:, h * g:(h + 1) * g] = torch.einsum("rgt,rtd->rgd", torch.softmax(w, -1), vv)
    return out


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())
