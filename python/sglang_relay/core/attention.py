"""Attention of a subset of query rows over a request's whole context, causal by position.

Relay recomputes non-contiguous token rows, so the mask is by absolute position, not by
row index. This pure-torch function is the semantics every backend path must match.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def positional_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``n`` query rows over ``T`` context positions.

    Args:
        q: ``[n, H_q, D]`` queries (post-RoPE) at absolute positions ``q_pos`` (``[n]``).
        k: ``[T, H_kv, D]`` keys of positions ``0..T-1``; ``v``: ``[T, H_kv, D_v]``.
        scale: softmax scale. ``H_q`` must be a multiple of ``H_kv`` (GQA).

    Returns:
        ``[n, H_q, D_v]``; row ``i`` attends to positions ``<= q_pos[i]``.
    """
    t = k.shape[0]
    mask = torch.arange(t, device=q.device)[None, :] <= q_pos[:, None].to(q.device)
    out = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax weights ``[n, H_kv, group, T]`` of queries ``q`` (``[n, H_q, D]``) over keys
    ``k`` (``[T, H_kv, D]``); ``visible`` (``[n, T]`` bool) says which positions each row
    sees. Query head ``h`` reads KV head ``h // group``, as in
    :func:`positional_causal_attention`."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    scores = torch.einsum("ngrd,tgd->ngrt", q.reshape(n, hkv, hq // hkv, d), k) * scale
    return scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
