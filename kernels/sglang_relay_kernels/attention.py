"""Relay-extend attention in Triton: active query rows (any positions) over their request's
context in the paged KV pool, causal by absolute position.

Row ``i`` (absolute position ``q_pos[i]``) attends to the positions ``0..q_pos[i]`` of its
request, whose slots are ``kv_indices[kv_start[i] : kv_start[i] + q_pos[i] + 1]``. The
specification is :func:`sglang_relay.core.attention.positional_causal_attention`.

Rows are cut into tiles of up to ``BLOCK_M`` consecutive rows of one request
(:func:`make_tiles`, once per active-row set). One program per (tile, query head) loads
the tile's queries once and streams the request's keys up to the tile's last position in
blocks of ``BLOCK_N`` shared by all its rows (two ``tl.dot`` per block, online softmax,
fp32 accumulators, per-row causal mask by position). Dense layers (every span row active)
get full tiles; the selective layers' sparse rows still share each key block of a tile.

A sliding window (``window`` keys, the row itself included) masks keys at or before
``q_pos - window`` and starts the key loop at the block of the tile's first visible key;
sinks (one logit per query head, unscaled, no value) join the final softmax denominator.
"""

from __future__ import annotations

import os

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
        tile_row_ptr,
        tile_len_ptr,
        tile_kv_ptr,
        kv_indices_ptr,
        sink_ptr,
        scale,
        window,
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
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        HAS_SINK: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // GROUP
        row0 = tl.load(tile_row_ptr + t).to(tl.int64)
        n_rows = tl.load(tile_len_ptr + t)
        start = tl.load(tile_kv_ptr + t).to(tl.int64)
        mi = tl.arange(0, BLOCK_M)
        live = mi < n_rows
        rows = row0 + mi
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        pos = tl.load(q_pos_ptr + rows, mask=live, other=-1).to(tl.int64)  # -1: no keys
        last = tl.max(pos, axis=0)
        lo = last * 0  # int64 like the window's start (a branch may not change its type)
        if window > 0:  # the first key any row of the tile sees, floored to a block
            first = tl.min(tl.where(live, pos, last), axis=0) - window + 1
            lo = (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N
        q = tl.load(
            q_ptr + rows[:, None] * stride_qn + h * stride_qh + d[None, :],
            mask=live[:, None] & (d[None, :] < D),
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
        acc = tl.full((BLOCK_M, BLOCK_DV), 0.0, tl.float32)
        for j0 in range(lo, last + 1, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j <= last
            slot = tl.load(kv_indices_ptr + start + j, mask=valid, other=0).to(tl.int64)
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + hk * stride_kh + d[None, :],
                mask=valid[:, None] & (d[None, :] < D),
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] fp32
            seen = j[None, :] <= pos[:, None]
            if window > 0:
                seen = seen & (j[None, :] > pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + hk * stride_vh + dv[None, :],
                mask=valid[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        if HAS_SINK:  # exp(sink) joins each row's denominator, rescaled to a common max
            sink = tl.load(sink_ptr + h).to(tl.float32)
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_fin)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_fin)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_on + h * stride_oh + dv[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=live[:, None] & (dv[None, :] < DV),
        )


def make_tiles(
    kv_start: torch.Tensor, block_m: int = 32, device: torch.device | None = None
) -> tuple[torch.Tensor, ...]:
    """Cut rows into tiles of at most ``block_m`` consecutive rows with the same
    ``kv_start`` (one request). Returns int64 ``(first_row, n_rows, kv_start)`` per tile,
    on ``device`` (default: ``kv_start``'s). Computed on the host: pass a host
    ``kv_start`` to avoid a sync, and call once per active-row set."""
    device = kv_start.device if device is None else device
    starts = kv_start.cpu().to(torch.int64)
    n = starts.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, empty
    cut = torch.ones(n, dtype=torch.bool)
    cut[1:] = starts[1:] != starts[:-1]
    run_lo = cut.nonzero().flatten()
    run_hi = torch.cat([run_lo[1:], torch.tensor([n])])
    first = torch.cat(
        [torch.arange(int(lo), int(hi), block_m) for lo, hi in zip(run_lo, run_hi, strict=True)]
    )
    ends = torch.minimum(first + block_m, run_hi[torch.bucketize(first, run_lo, right=True) - 1])
    return tuple(x.to(device) for x in (first, ends - first, starts[first]))


def positional_attention_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    q_pos: torch.Tensor,
    kv_start: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    tiles: tuple[torch.Tensor, ...] | None = None,
    block_m: int = 32,
    block_n: int = 64,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q``: ``[n, Hq, D]``; buffers ``[slots, Hkv, D]``; ``q_pos``/``kv_start``: ``[n]``
    (rows of a request consecutive); ``kv_indices``: the slots of every request's context,
    by position; ``tiles``: :func:`make_tiles` of ``kv_start`` with the same ``block_m``
    (computed here if not given); ``window``: keys a row sees, itself included (0: all);
    ``sinks``: ``[Hq]`` sink logits. Returns ``[n, Hq, DV]`` in ``q``'s dtype."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, hq, dim = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if q.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q and the KV buffers must be contiguous in the head dimension")
    if k_buffer.dtype != v_buffer.dtype:
        raise ValueError(f"the K buffer is {k_buffer.dtype} but the V buffer {v_buffer.dtype}")
    out = torch.empty((n, hq, dv), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    first, count, start = make_tiles(kv_start, block_m) if tiles is None else tiles
    # Triton's interpreter (3.8) computes tl.dot of bf16/fp16 operands wrongly: it gets fp32
    # operands instead (the compiled kernel keeps 16-bit operands with fp32 accumulation).
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    # a KV cache in another dtype than q (FP8, bf16 under fp32): fp32 operands, exact
    # products, the path the interpreter runs too (so the one the tests check)
    upcast = interpreted or k_buffer.dtype != q.dtype
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {hq} query heads")
    sink_arg = kv_indices if sinks is None else sinks.float().contiguous()  # unread if none
    _positional_attention_kernel[(first.numel(), hq)](
        q, k_buffer, v_buffer, out, q_pos, first, count, start, kv_indices, sink_arg,
        float(scale), int(window),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=dim, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        # fp32 (and the interpreter's upcast operands): exact products, not TF32; 16-bit
        # operands: the backend's default (precision names differ between NVIDIA and AMD)
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else None,
        UPCAST=upcast, HAS_SINK=sinks is not None,
    )  # fmt: skip
    return out
