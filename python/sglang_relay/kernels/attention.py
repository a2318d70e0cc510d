"""Relay-extend attention in Triton: active query rows (any positions) over their request's
context in the paged KV pool, causal by absolute position.

Row ``i`` (absolute position ``q_pos[i]``) attends to the positions ``0..q_pos[i]`` of its
request, whose slots are ``kv_indices[kv_start[i] : kv_start[i] + q_pos[i] + 1]``. The
specification is :func:`sglang_relay.core.attention.positional_causal_attention`.

One program per (row, query head) streams the row's keys in blocks with an online softmax
(fp32 accumulators), so causal rows near the start of a context do little work. Rows do
not share key loads: this is the simple kernel, right for the selective layers (few rows).
A tiled version that shares key blocks across the rows of a request is the next step for
the dense layers ``[l_start, l_det)``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _positional_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        q_pos_ptr,
        kv_start_ptr,
        kv_indices_ptr,
        scale,
        stride_qn,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_on,
        stride_oh,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // GROUP
        pos = tl.load(q_pos_ptr + i).to(tl.int64)
        start = tl.load(kv_start_ptr + i).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + i * stride_qn + h * stride_qh + d, mask=d < D, other=0.0)
        q = q.to(tl.float32) * scale
        m = tl.full((), float("-inf"), tl.float32)
        denom = tl.full((), 0.0, tl.float32)
        acc = tl.full((BLOCK_DV,), 0.0, tl.float32)
        for j0 in range(0, pos + 1, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j <= pos
            slot = tl.load(kv_indices_ptr + start + j, mask=valid, other=0).to(tl.int64)
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + hk * stride_kh + d[None, :],
                mask=valid[:, None] & (d[None, :] < D),
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + hk * stride_vh + dv[None, :],
                mask=valid[:, None] & (dv[None, :] < DV),
                other=0.0,
            ).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            denom = denom * alpha + tl.sum(p, axis=0)
            m = m_new
        out = acc / denom
        tl.store(
            o_ptr + i * stride_on + h * stride_oh + dv,
            out.to(o_ptr.dtype.element_ty),
            mask=dv < DV,
        )


def positional_attention_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    q_pos: torch.Tensor,
    kv_start: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    block_n: int = 64,
) -> torch.Tensor:
    """``q``: ``[n, Hq, D]``; buffers ``[slots, Hkv, D]``; ``q_pos``/``kv_start``: ``[n]``;
    ``kv_indices``: the slots of every request's context, by position. Returns
    ``[n, Hq, DV]`` in ``q``'s dtype."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, hq, dim = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if q.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q and the KV buffers must be contiguous in the head dimension")
    out = torch.empty((n, hq, dv), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _positional_attention_kernel[(n, hq)](
        q, k_buffer, v_buffer, out, q_pos, kv_start, kv_indices, float(scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=dim, DV=dv, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_DV=triton.next_power_of_2(dv),
    )  # fmt: skip
    return out
