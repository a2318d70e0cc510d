"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, whose prepare takes the forward
batch and may store K/V itself (a fused q/k-norm + RoPE + KV-store kernel on CUDA), so the
loop runs SGLang's unfused sequence; a sparse MoE block (router, top-k, fused experts) in
every layer, dense layers allowed (``mlp_only_layers``). ``Qwen3MoeModel`` inherits
``Qwen2MoeModel``'s forward."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, DENSE_MLP, SPARSE_MLP, Anatomy

ADAPTERS = (
    Anatomy(
        "Qwen3MoeForCausalLM",
        "sglang.srt.models.qwen2_moe.Qwen2MoeModel.forward",
        attention_modules=BASE_ATTENTION | {"q_norm", "k_norm"},
        prepare="split",
        mlp_blocks=(SPARSE_MLP, DENSE_MLP),
    ),
)
