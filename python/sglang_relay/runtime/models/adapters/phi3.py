"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): SGLang's Llama classes loading fused ``qkv_proj`` /
``gate_up_proj`` checkpoint weights (partial-rotary variants are refused by the start-up
check)."""

from sglang_relay.runtime.models.anatomy import LLAMA_FORWARD, Anatomy

ADAPTERS = (Anatomy("Phi3ForCausalLM", LLAMA_FORWARD),)
