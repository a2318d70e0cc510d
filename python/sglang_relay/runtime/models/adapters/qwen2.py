"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): q/k/v biases; no ``forward_prepare_native``, so
the loop runs SGLang's ``qkv_proj`` -> split -> ``rotary_emb``."""

from sglang_relay.runtime.models.anatomy import Anatomy

ADAPTERS = (
    Anatomy("Qwen2ForCausalLM", "sglang.srt.models.qwen2.Qwen2Model.forward", prepare="split"),
)
