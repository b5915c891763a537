"""Triton kernel: staged raw PLE rows (fp8 e4m3 or bf16) → bf16 output rows.

The source pointer is passed as an integer, so the same kernel reads pinned host memory through
UVA (zero-copy, like sglang's ``_gather_ple_embedding_from_pinned_kernel``) or a device buffer
filled by an H2D copy. Rows arrive in lookup order (the reader already gathered them and zeroed
other ranks' rows), so there is no id indirection: row i of the staging buffer is output row i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 4  # rows per program: 4 × 160 elements keeps a program's loads coalesced


@triton.jit
def _convert_staged_rows_kernel(
    src_ptr,
    out_ptr,
    n_rows,
    n_cols,
    is_fp8: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if is_fp8:
        src = src_ptr.to(tl.int64).to(tl.pointer_type(tl.float8e4nv))
    else:
        src = src_ptr.to(tl.int64).to(tl.pointer_type(tl.bfloat16))
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    values = tl.load(src + offs, mask=mask, other=0.0).to(tl.bfloat16)
    tl.store(out_ptr + offs, values, mask=mask)


def convert_staged_rows(src: torch.Tensor, out: torch.Tensor, *, is_fp8: bool) -> None:
    """``out[i] = bf16(src[i])`` for a uint8 ``[n, row_bytes]`` staging view ``src`` (pinned host
    or device) and a contiguous bf16 ``[n, columns]`` ``out``; launched on the current stream."""
    n, cols = out.shape
    if src.shape[0] != n or src.shape[1] != cols * (1 if is_fp8 else 2) or src.dtype != torch.uint8:
        raise ValueError(f"staging {tuple(src.shape)} {src.dtype} does not match output {tuple(out.shape)} "
                         f"(fp8={is_fp8})")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or not src.is_contiguous():
        raise ValueError("PLE conversion needs a contiguous uint8 staging view and a contiguous bf16 output")
    if n == 0:
        return
    _convert_staged_rows_kernel[(triton.cdiv(n, BLOCK_R),)](
        src.data_ptr(), out, n, cols, is_fp8=is_fp8, BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(cols),
    )


def reference_rows(src: torch.Tensor, *, is_fp8: bool) -> torch.Tensor:
    """Torch reference of the conversion (for tests)."""
    typed = src.view(torch.float8_e4m3fn if is_fp8 else torch.bfloat16)
    return typed.to(torch.bfloat16)
