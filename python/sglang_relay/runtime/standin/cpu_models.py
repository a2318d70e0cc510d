"""GPU-only pieces inside SGLang's model classes, in torch, for the CPU stand-in: what a
model class launches itself (not through an attention backend or ``sgl_kernel``) and only
on CUDA.

* MiniMax-M2's q/k RMSNorm (``MiniMaxM2QKRMSNorm``): one RMS over all heads of q and one
  over all heads of k, its sums of squares reduced across the attention-TP ranks (each holds
  a shard of the heads). SGLang's path off CUDA and AMX launches two Triton kernels
  (``rms_sumsq_serial``, ``rms_apply_serial``) whose wrappers assert CUDA tensors; this is
  the same two steps, checked against those kernels under the Triton interpreter
  (``test/unit/test_cpu_models.py``).
"""

from __future__ import annotations

import torch


def qk_sums_of_squares(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[2n]`` float32: each row's sum of squares of ``q [n, Dq]``, then of ``k [n, Dk]``
    (the layout of SGLang's ``rms_sumsq_serial``, without its padding)."""
    return torch.cat((q.float().square().sum(-1), k.float().square().sum(-1)))


def qk_rms_apply(q, k, q_weight, k_weight, sums, tp_world: int, eps: float):
    """``q`` and ``k`` normalized by the (all-rank) ``sums`` of :func:`qk_sums_of_squares`
    over the full width ``D * tp_world``, times their weight shards, in float32, cast back."""
    n = q.shape[0]
    inv_q = torch.rsqrt(sums[:n] / q.shape[1] / tp_world + eps).unsqueeze(-1)
    inv_k = torch.rsqrt(sums[n : 2 * n] / k.shape[1] / tp_world + eps).unsqueeze(-1)
    out_q = (q.float() * inv_q * q_weight.float()).to(q.dtype)
    out_k = (k.float() * inv_k * k_weight.float()).to(k.dtype)
    return out_q, out_k


def minimax_qk_norm(original, norm, q: torch.Tensor, k: torch.Tensor):
    """Around-hook of ``MiniMaxM2QKRMSNorm._forward_naive`` on the CPU stand-in: SGLang's
    two steps in torch (the sums all-reduced over the attention-TP group, as SGLang does)."""
    sums = qk_sums_of_squares(q, k)
    if norm._world_size > 1:
        from sglang.srt.layers.dp_attention import attn_tp_all_reduce

        sums = attn_tp_all_reduce(sums)
    return qk_rms_apply(
        q, k, norm._q_norm.weight, norm._k_norm.weight, sums, norm._world_size, norm._eps
    )
