"""Gather / scatter of token rows (hidden states, residuals, K/V of selected tokens).

The relay extend moves rows between the batch (``[tokens, width]``) and per-layer active
sets: ``gather_rows(x, idx)`` is ``x[idx]``; ``scatter_rows(out, idx, rows)`` is
``out[idx] = rows`` (``idx`` without duplicates). Both accept any 2-D strided view whose
last dimension is contiguous; K/V buffers ``[slots, H, D]`` go in as ``[slots, H * D]``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

BLOCK_W = 1024


def gather_rows_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x[idx]


def scatter_rows_ref(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    out[idx] = rows


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        stride_src,
        stride_dst,
        W,
        HAS_SRC_IDX: tl.constexpr,
        HAS_DST_IDX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = off < W
        s = tl.load(src_idx_ptr + i).to(tl.int64) if HAS_SRC_IDX else i.to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64) if HAS_DST_IDX else i.to(tl.int64)
        vals = tl.load(src_ptr + s * stride_src + off, mask=m)
        tl.store(dst_ptr + d * stride_dst + off, vals.to(dst_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with a contiguous last dimension")


def gather_rows_triton(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    _check(x, "x")
    out = torch.empty((idx.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    if idx.numel():
        grid = (idx.numel(), triton.cdiv(x.shape[1], BLOCK_W))
        _copy_rows_kernel[grid](
            x, out, idx, idx, x.stride(0), out.stride(0), x.shape[1],
            HAS_SRC_IDX=True, HAS_DST_IDX=False, BLOCK=BLOCK_W,
        )  # fmt: skip
    return out


def scatter_rows_triton(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    _check(out, "out")
    _check(rows, "rows")
    if rows.shape != (idx.numel(), out.shape[1]):
        raise ValueError(f"rows must be [{idx.numel()}, {out.shape[1]}]; got {tuple(rows.shape)}")
    if idx.numel():
        grid = (idx.numel(), triton.cdiv(out.shape[1], BLOCK_W))
        _copy_rows_kernel[grid](
            rows, out, idx, idx, rows.stride(0), out.stride(0), out.shape[1],
            HAS_SRC_IDX=False, HAS_DST_IDX=True, BLOCK=BLOCK_W,
        )  # fmt: skip
