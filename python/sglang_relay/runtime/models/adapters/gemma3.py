"""Gemma 3 text models (``Gemma3ForCausalLM``): four norms a layer (Gemma's ``x * (1 + w)``
RMSNorm; the attention output normed before the residual is added in
``pre_feedforward_layernorm``, the MLP output normed by ``post_feedforward_layernorm``),
per-head q/k norms, sliding-window layers (5 of every 6 in the released models) beside
global ones, and two RoPE tables kept on the model (a local base and a global one, which
may be linear-scaled), applied in its forward by layer type: relay's q/k/v preparation and
splice use the same model-level tables (never the layer's own ``rotary_emb``, which
SGLang's non-AMX path does not apply). The query scale comes from
``query_pre_attn_scalar``; the embedding is scaled inside ``embed_tokens``. The decoder
layer takes its residual as an argument (no SGLang layer boundary), so the decode capture
reads the stream from the layer's arguments. SGLang keeps every layer's KV in one pool for
Gemma 3 (it turns the hybrid SWA pool off itself)."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, DENSE_MLP, Anatomy

ADAPTERS = (
    Anatomy(
        "Gemma3ForCausalLM",
        "sglang.srt.models.gemma3_causal.Gemma3TextModel.forward",
        attention_modules=BASE_ATTENTION | {"q_norm", "k_norm"},
        prepare="gemma3",
        mlp_blocks=(DENSE_MLP,),
        windows=True,
        norms="sandwich",
        residual="arguments",
    ),
)
