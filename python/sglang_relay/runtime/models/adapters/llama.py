"""Llama (``LlamaForCausalLM``, incl. Llama 3.x with its ``llama3`` RoPE scaling): SGLang's
``forward_prepare_native`` gives post-RoPE q, k, v; a dense gated MLP."""

from sglang_relay.runtime.models.anatomy import LLAMA_FORWARD, Anatomy

ADAPTERS = (Anatomy("LlamaForCausalLM", LLAMA_FORWARD),)
