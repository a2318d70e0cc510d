"""Splice + re-rotate: copy a span's KV from its slots into a request's slots, keys rotated
by per-token position deltas, in one kernel launch per layer group.

Contract (the torch reference :func:`splice_rerotate_ref` is the specification):

* ``k_buffers`` / ``v_buffers``: one ``[slots, H, D]`` tensor per layer (SGLang's
  ``MHATokenToKVPool`` layout) or a single ``[layers, slots, H, D]`` tensor;
* ``src`` / ``dst``: ``[N]`` slot indices; ``dst`` must not overlap ``src`` (destination
  slots are freshly allocated for the extend, sources belong to stored spans);
* ``cos`` / ``sin``: ``[N, rot_dim / 2]`` float32, the rotation by each token's delta
  (:func:`sglang_relay.core.rope.delta_cos_sin`), computed once for all layers;
* ``is_neox``: pair ``j`` with ``j + rot_dim/2`` (True) or ``2j`` with ``2j+1`` (False);
  dimensions past ``rot_dim`` are copied unchanged (partial rotary).

Rotation happens in float32 and rounds once to the buffer dtype, as the reference does. An
FP8 buffer (SGLang's FP8 KV pools) goes to the reference only, which saturates at the
format's largest finite value (the dispatcher in ``__init__``: no Triton FP8 store is
verified on a machine without a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_relay.core.rope import FP8_DTYPES, apply_rotation

try:  # Triton is an optional dependency (always present with CUDA builds of torch)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None


def splice_rerotate_ref(
    k_buffers: Sequence[torch.Tensor] | torch.Tensor,
    v_buffers: Sequence[torch.Tensor] | torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    is_neox: bool = True,
) -> None:
    """Pure-torch reference (and the CPU path)."""
    for kbuf, vbuf in zip(k_buffers, v_buffers, strict=True):
        _put(kbuf, dst, apply_rotation(_take(kbuf, src), cos, sin, is_neox=is_neox))
        _put(vbuf, dst, _take(vbuf, src))


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """An FP8 buffer as its bytes (torch's CPU index copy has no float8 kernel)."""
    return buf.view(torch.uint8) if buf.dtype in FP8_DTYPES else buf


def _take(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _bytes(buf).index_select(0, idx).view(buf.dtype)


def _put(buf: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    _bytes(buf).index_copy_(0, idx.long(), _bytes(rows))  # index_copy_ takes int64 only


if triton is not None:

    @triton.jit
    def _splice_rerotate_kernel(
        k_ptr,
        v_ptr,
        src_ptr,
        dst_ptr,
        cos_ptr,
        sin_ptr,
        stride_kl,
        stride_ks,
        stride_kh,
        stride_vl,
        stride_vs,
        stride_vh,
        stride_c,
        HALF: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        IS_NEOX: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # one program per (token, head, layer)
        i = tl.program_id(0)
        h = tl.program_id(1)
        layer = tl.program_id(2).to(tl.int64)  # layer * stride overflows int32 on big pools
        s = tl.load(src_ptr + i).to(tl.int64)
        d = tl.load(dst_ptr + i).to(tl.int64)
        k_src = k_ptr + layer * stride_kl + s * stride_ks + h * stride_kh
        k_dst = k_ptr + layer * stride_kl + d * stride_ks + h * stride_kh

        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        c = tl.load(cos_ptr + i * stride_c + j, mask=jm, other=1.0)
        sn = tl.load(sin_ptr + i * stride_c + j, mask=jm, other=0.0)
        if IS_NEOX:
            lo = j
            hi = j + HALF
        else:
            lo = 2 * j
            hi = 2 * j + 1
        x1 = tl.load(k_src + lo, mask=jm, other=0.0).to(tl.float32)
        x2 = tl.load(k_src + hi, mask=jm, other=0.0).to(tl.float32)
        o1 = x1 * c - x2 * sn
        o2 = x2 * c + x1 * sn
        tl.store(k_dst + lo, o1.to(k_ptr.dtype.element_ty), mask=jm)
        tl.store(k_dst + hi, o2.to(k_ptr.dtype.element_ty), mask=jm)

        # partial rotary: the dimensions past rot_dim move unrotated
        t = 2 * HALF + tl.arange(0, BLOCK_D)
        tm = t < D
        tl.store(k_dst + t, tl.load(k_src + t, mask=tm), mask=tm)

        e = tl.arange(0, BLOCK_DV)
        em = e < DV
        v_src = v_ptr + layer * stride_vl + s * stride_vs + h * stride_vh
        v_dst = v_ptr + layer * stride_vl + d * stride_vs + h * stride_vh
        tl.store(v_dst + e, tl.load(v_src + e, mask=em), mask=em)


def _launch(k: torch.Tensor, v: torch.Tensor, src, dst, cos, sin, is_neox: bool) -> None:
    """``k``/``v``: ``[layers, slots, H, D]`` (a per-layer buffer gets a leading 1)."""
    layers, _, heads, dim = k.shape
    half = cos.shape[1]
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("KV buffers must be contiguous in the head dimension")
    n = src.numel()
    if n == 0:
        return
    grid = (n, heads, layers)
    _splice_rerotate_kernel[grid](
        k,
        v,
        src,
        dst,
        cos,
        sin,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        HALF=half,
        D=dim,
        DV=v.shape[3],
        IS_NEOX=is_neox,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(max(dim - 2 * half, 1)),
        BLOCK_DV=triton.next_power_of_2(v.shape[3]),
    )


def splice_rerotate_triton(
    k_buffers: Sequence[torch.Tensor] | torch.Tensor,
    v_buffers: Sequence[torch.Tensor] | torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    is_neox: bool = True,
) -> None:
    """The Triton kernel: one launch for a stacked ``[layers, slots, H, D]`` pool, one per
    layer for a list of buffers."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    if isinstance(k_buffers, torch.Tensor) and k_buffers.dim() == 4:
        _launch(k_buffers, v_buffers, src, dst, cos, sin, is_neox)
        return
    for kbuf, vbuf in zip(k_buffers, v_buffers, strict=True):
        _launch(kbuf.unsqueeze(0), vbuf.unsqueeze(0), src, dst, cos, sin, is_neox)
