"""One pre-norm decoder layer as the relay loops run it, on SGLang's own modules.

``input_layernorm`` -> the attention block's q/k/v preparation (per architecture:
:mod:`sglang_relay.runtime.anatomy`) -> attention (the caller's) -> ``o_proj`` ->
``post_attention_layernorm`` -> the MLP block (dense or sparse, SGLang's, whole); norms
take and return the residual stream separately (``norm(h, r) -> (x, h + r)``);
``model.{embed_tokens, layers, norm}``. Which modules a served model may have is checked
at start-up (``anatomy.anatomy_problems``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_relay.runtime.anatomy import mlp_block, mlp_output, qkv, run_mlp
from sglang_relay.runtime.sglang.model import finish_row_parallel, kv_write_loc

__all__ = ["qkv", "run_layer", "stream", "write_kv"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def write_kv(pool, radix_attn, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write flat ``k``/``v`` rows into the pool slots ``loc`` of ``radix_attn``'s layer."""
    k = k.reshape(-1, radix_attn.tp_k_head_num, radix_attn.qk_head_dim)
    v = v.reshape(-1, radix_attn.tp_v_head_num, radix_attn.v_head_dim)
    pool.set_kv_buffer(radix_attn, kv_write_loc(loc), k, v)


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
    h = finish_row_parallel(layer.self_attn.o_proj, h)
    x, r = layer.post_attention_layernorm(h, r)
    block = mlp_block(layer)
    out = run_mlp(block, x, fb)
    return finish_row_parallel(mlp_output(block), out), r


def stream(h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """The residual stream entering a layer, from its ``(h, r)`` pair."""
    return h if r is None else h + r
