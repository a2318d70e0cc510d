"""GLM-4.5 to 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``): partial rotary
(``partial_rotary_factor`` 0.5: RoPE on the first half of each head's dims, the rest never
rotates), GQA with q/k/v in one projection and no native prepare (its ``forward_prepare``
takes the forward batch), per-head q/k RMSNorms before RoPE where ``use_qk_norm`` is set
(GLM-4.5 to 4.7; not the Air), a sigmoid-routed MoE block with a shared expert (folded into
the fused experts where SGLang fuses it: the block is called whole either way), its first
``first_k_dense_replace`` layers dense."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, DENSE_MLP, SPARSE_MLP, Anatomy

# router (with its score-correction bias), SGLang's top-k, fused experts, a shared expert
GLM_MOE_MLP = SPARSE_MLP | {"shared_experts"}

ADAPTERS = (
    Anatomy(
        "Glm4MoeForCausalLM",
        "sglang.srt.models.glm4_moe.Glm4MoeModel.forward",
        attention_modules=BASE_ATTENTION,
        prepare="split",
        mlp_blocks=(GLM_MOE_MLP, SPARSE_MLP, DENSE_MLP),
        optional_attention=frozenset({"q_norm", "k_norm"}),
    ),
)
