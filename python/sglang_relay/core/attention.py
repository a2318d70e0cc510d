"""Attention of a subset of query rows over a request's whole context, causal by position.

Relay recomputes non-contiguous token rows, so the mask is by absolute position, not by
row index. This pure-torch function is the semantics every backend path must match.

Two per-layer variants (gpt-oss, Gemma 3): a sliding **window** of ``W`` keys (row ``i``
sees positions ``q_pos[i] - W + 1 .. q_pos[i]``, itself included: Hugging Face's
``kv_idx > q_idx - W``; SGLang's ``RadixAttention.sliding_window_size`` holds ``W - 1``),
and attention **sinks** (gpt-oss: a learned logit per query head that joins each row's
softmax, unscaled and with no value: it adds ``exp(sink[h])`` to the denominator, so the
output is the sink-free one times ``sigmoid(lse - sink[h])``).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def visible(q_pos: torch.Tensor, t: int, window: int = 0) -> torch.Tensor:
    """``[n, t]`` bool: which of positions ``0..t-1`` row ``i`` (at ``q_pos[i]``) sees:
    ``<= q_pos[i]`` and, with a ``window`` (> 0), ``> q_pos[i] - window``."""
    j = torch.arange(t, device=q_pos.device)[None, :]
    p = q_pos[:, None]
    seen = j <= p
    return seen & (j > p - window) if window > 0 else seen


def positional_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``n`` query rows over ``T`` context positions.

    Args:
        q: ``[n, H_q, D]`` queries (post-RoPE) at absolute positions ``q_pos`` (``[n]``).
        k: ``[T, H_kv, D]`` keys of positions ``0..T-1``; ``v``: ``[T, H_kv, D_v]``.
        scale: softmax scale. ``H_q`` must be a multiple of ``H_kv`` (GQA).
        window: keys each row sees, itself included (0: all earlier ones).
        sinks: ``[H_q]`` sink logits (None: no sinks).

    Returns:
        ``[n, H_q, D_v]``; row ``i`` attends to the positions :func:`visible` gives it (a
        row that sees none gives zeros).
    """
    return masked_attention(q, k, v, visible(q_pos.to(q.device), k.shape[0], window), scale, sinks)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`positional_causal_attention` with its ``[n, T]`` bool mask given (row ``i``
    reads key ``t`` where ``mask[i, t]``): what a caller that runs the same rows in many
    layers plans once."""
    if sinks is not None:
        return _with_sinks(q, k, v, mask, scale, sinks)
    out = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _with_sinks(q, k, v, mask, scale, sinks):
    """Explicit softmax in float32 (float64 stays float64) with one sink column per head."""
    n, hq, _ = q.shape
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = attention_probs(q.to(dt), k.to(dt), mask, scale, sinks)  # [n, Hkv, group, T]
    out = torch.einsum("ngrt,tgd->ngrd", probs, v.to(dt))
    return out.reshape(n, hq, v.shape[-1]).to(q.dtype)


def attention_lse(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float):
    """``[n, H_q]`` natural-log log-sum-exp of the scaled logits of ``q`` (``[n, H_q, D]``)
    over the ``visible`` (``[n, T]``) keys ``k`` (``[T, H_kv, D]``), in float32 (-inf: none)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(n, hkv, hq // hkv, d)
    scores = torch.einsum("ngrd,tgd->ngrt", qg, k.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return scores.logsumexp(-1).reshape(n, hq)


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Sink-free attention ``out`` ``[n, Hq, Dv]`` with its natural-log log-sum-exp ``lse``
    ``[n, Hq]`` of the scaled logits, turned into attention with ``sinks`` ``[Hq]``: each
    row's denominator gains ``exp(sink[h])``, so the output shrinks by
    ``sigmoid(lse - sink[h])`` (a row with no visible key: ``lse`` -inf, output 0)."""
    share = torch.sigmoid(lse.float() - sinks.float()[None, :])
    return (out.float() * share[..., None]).to(out.dtype)


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax weights ``[n, H_kv, group, T]`` of queries ``q`` (``[n, H_q, D]``) over keys
    ``k`` (``[T, H_kv, D]``); ``visible`` (``[n, T]`` bool) says which positions each row
    sees. Query head ``h`` reads KV head ``h // group``, as in
    :func:`positional_causal_attention`. ``sinks`` (``[H_q]``): each head's sink logit joins
    the softmax and takes its share, which the returned key weights leave out (they then
    sum to less than 1)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    scores = torch.einsum("ngrd,tgd->ngrt", q.reshape(n, hkv, hq // hkv, d), k) * scale
    return softmax_with_sinks(scores.masked_fill(~visible[:, None, None, :], float("-inf")), sinks)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of masked ``scores`` ``[B, H_kv, group, T]`` (query head
    ``h`` at ``[h // group, h % group]``); ``sinks`` (``[H_q]``, None: none) join each
    row's softmax as one more column, dropped after it (they carry no value)."""
    if sinks is None:
        return scores.softmax(-1)
    b, hkv, group, _ = scores.shape
    sink = sinks.to(scores.dtype).reshape(1, hkv, group, 1).expand(b, -1, -1, 1)
    return torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
