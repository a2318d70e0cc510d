"""Mistral (``MistralForCausalLM``): SGLang serves it with its Llama classes (full
attention: a sliding window, if the checkpoint sets one, is refused by the start-up
check)."""

from sglang_relay.runtime.models.anatomy import LLAMA_FORWARD, Anatomy

ADAPTERS = (Anatomy("MistralForCausalLM", LLAMA_FORWARD),)
