"""Qwen3 dense (``Qwen3ForCausalLM``): per-head q/k RMSNorm before RoPE, inside SGLang's
``forward_prepare_native``; a head dim that may differ from hidden / heads."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, Anatomy

ADAPTERS = (
    Anatomy(
        "Qwen3ForCausalLM",
        "sglang.srt.models.qwen3.Qwen3Model.forward",
        attention_modules=BASE_ATTENTION | {"q_norm", "k_norm"},
    ),
)
