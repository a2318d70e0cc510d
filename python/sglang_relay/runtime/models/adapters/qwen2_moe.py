"""Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases),
routed experts plus a sigmoid-gated shared expert, summed inside SGLang's block."""

from sglang_relay.runtime.models.anatomy import DENSE_MLP, SHARED_EXPERT_MLP, Anatomy

ADAPTERS = (
    Anatomy(
        "Qwen2MoeForCausalLM",
        "sglang.srt.models.qwen2_moe.Qwen2MoeModel.forward",
        prepare="split",
        mlp_blocks=(SHARED_EXPERT_MLP, DENSE_MLP),
    ),
)
