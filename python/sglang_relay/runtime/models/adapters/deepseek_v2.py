"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``; SGLang serves V3 with V2's
classes) and DeepSeek-V2 (``DeepseekV2ForCausalLM``): multi-head latent attention (MLA).
Each token's KV is one latent row, ``kv_lora_rank`` normed values and ``qk_rope_head_dim``
rotated ones shared by every head (SGLang's MLA pool: one key head of ``r + p``, the value
its first ``r``); the loop attends over it absorbed (``prepare="mla"``:
:func:`~sglang_relay.runtime.models.anatomy.mla_qkv`), so a splice re-rotates the row's last
``p`` values alone, GPT-J-style pairs, under DeepSeek's YaRN. q through a low-rank projection
(``q_lora_rank``: V3, Kimi-K2) or directly (V2-Lite). A sigmoid- or softmax-routed grouped
MoE block with shared experts after ``first_k_dense_replace`` dense layers."""

from sglang_relay.runtime.models.anatomy import DENSE_MLP, SPARSE_MLP, Anatomy

# the latent's norm and up-projection (split by SGLang into w_kc / w_vc after loading), the
# output projection, the RoPE of the shared key part, the absorbed (mqa) and up-projected
# (mha) RadixAttentions, which share the layer's KV
MLA_ATTENTION = frozenset(
    {"kv_b_proj", "kv_a_layernorm", "o_proj", "rotary_emb", "attn_mqa", "attn_mha"}
)
# q from the fused low-rank a-projection (SGLang fuses q_a_proj and kv_a_proj_with_mqa)
Q_LORA = frozenset({"fused_qkv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj"})
Q_DIRECT = frozenset({"q_proj", "kv_a_proj_with_mqa"})
DEEPSEEK_MOE_MLP = SPARSE_MLP | {"shared_experts"}

ADAPTERS = tuple(
    Anatomy(
        architecture,
        "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward",
        attention_modules=MLA_ATTENTION,
        attention_alternatives=(Q_LORA, Q_DIRECT),
        prepare="mla",
        mlp_blocks=(DEEPSEEK_MOE_MLP, SPARSE_MLP, DENSE_MLP),
    )
    for architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
)
