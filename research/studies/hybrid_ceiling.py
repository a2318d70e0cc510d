"""The ceiling of what relay could save on a hybrid linear-attention model (issue 66 item 5):
the share of a pasted token's multiply-adds in the layers that hold KV, from the defaults
of transformers' ``Qwen3NextConfig`` (Qwen3-Next-80B-A3B). Arithmetic on the config, not a
run. Writes ``data/hybrid_ceiling/qwen3_next.json``; docs/limitations.md quotes it.

Per token and layer: a full-attention layer's projections (q with its output gate: 2 x heads
x head_dim, k, v: kv_heads x head_dim each, o), a linear layer's projections (q/k of the key
heads, v/z of the value heads, b/a: one per value head each, out) and its state update
(value heads x key dim x value dim, about 3 multiply-adds an element: decay, update, read),
every layer's MoE block (top-k routed experts and the shared one: 3 matrices of hidden x
moe_intermediate each, the router and the shared expert's gate); plus the attention kernel
of a full layer over a context of T tokens (q.k and p.v: 2 x heads x head_dim x T)."""

from __future__ import annotations

import json
from pathlib import Path


def ceiling(context: int = 4096) -> dict:
    import transformers

    c = transformers.Qwen3NextConfig()
    h, hd = c.hidden_size, c.head_dim
    full_proj = h * (2 * c.num_attention_heads * hd) + 2 * h * c.num_key_value_heads * hd
    full_proj += c.num_attention_heads * hd * h
    kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    linear_proj = h * (2 * nk * kd + 2 * nv * vd + 2 * nv) + nv * vd * h
    linear_state = 3 * nv * kd * vd
    expert = 3 * h * c.moe_intermediate_size
    moe = c.num_experts_per_tok * expert + 3 * h * c.shared_expert_intermediate_size
    moe += h * c.num_experts + h
    types = c.layer_types
    n_full = sum(t == "full_attention" for t in types)
    n_lin = len(types) - n_full
    in_full = n_full * (full_proj + moe)
    total = in_full + n_lin * (linear_proj + linear_state + moe)
    kernel = n_full * 2 * c.num_attention_heads * hd * context
    return {
        "config": "transformers.Qwen3NextConfig() defaults",
        "layers": len(types), "full_layers": n_full,
        "full_layer_projections": full_proj, "linear_layer_projections": linear_proj,
        "linear_layer_state_update": linear_state, "moe_block": moe,
        "per_token_total": total, "per_token_in_full_layers": in_full,
        "share_in_full_layers": in_full / total,
        "context": context, "attention_kernel_full_layers": kernel,
        "attention_kernel_share_of_layers": kernel / total,
    }  # fmt: skip


if __name__ == "__main__":
    out = Path(__file__).parent / "data" / "hybrid_ceiling" / "qwen3_next.json"
    out.write_text(json.dumps(ceiling(), indent=1) + "\n")
    print(out.read_text())
