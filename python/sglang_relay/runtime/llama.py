"""The anatomy of SGLang's Llama-family decoder the relay loops run (Llama, Qwen2).

Pre-norm decoder layers: ``input_layernorm`` -> ``self_attn.{qkv_proj, rotary_emb, attn,
o_proj}`` -> ``post_attention_layernorm`` -> ``mlp``; norms take and return the residual
stream separately (``norm(h, r) -> (x, h + r)``); ``model.{embed_tokens, layers, norm}``.
These names are part of the SGLang contract (:mod:`sglang_relay.runtime.compat` checks them
on the served model at start-up).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_relay.runtime import compat

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def qkv(attn_mod, positions: torch.Tensor, x: torch.Tensor):
    """q, k, v of an attention block (post-RoPE q and k), flat ``[n, heads*dim]``."""
    out, _ = attn_mod.qkv_proj(x)
    q, k, v = out.split([attn_mod.q_size, attn_mod.kv_size, attn_mod.kv_size], dim=-1)
    q, k = attn_mod.rotary_emb(positions, q, k)
    return q, k, v


def write_kv(pool, radix_attn, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write flat ``k``/``v`` rows into the pool slots ``loc`` of ``radix_attn``'s layer."""
    k = k.reshape(-1, radix_attn.tp_k_head_num, radix_attn.qk_head_dim)
    v = v.reshape(-1, radix_attn.tp_v_head_num, radix_attn.v_head_dim)
    pool.set_kv_buffer(radix_attn, compat.kv_write_loc(loc), k, v)


def run_layer(layer, positions, h, r, fb, attend: Attend):
    """One decoder layer on the given rows (``r`` None: the first layer, no residual yet);
    ``attend(q, k, v)`` does the attention. Returns ``(h, r)``."""
    if r is None:
        r = h
        x = layer.input_layernorm(h)
    else:
        x, r = layer.input_layernorm(h, r)
    q, k, v = qkv(layer.self_attn, positions, x)
    o = attend(q, k, v)
    h, _ = layer.self_attn.o_proj(o)
    h = compat.finish_row_parallel(layer.self_attn.o_proj, h)
    x, r = layer.post_attention_layernorm(h, r)
    out = layer.mlp(x, forward_batch=fb)
    return compat.finish_row_parallel(layer.mlp.down_proj, out), r


def stream(h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """The residual stream entering a layer, from its ``(h, r)`` pair."""
    return h if r is None else h + r
