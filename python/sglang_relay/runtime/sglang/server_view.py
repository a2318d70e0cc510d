"""The server options relay's mode checks read (``runtime/config/modes.py``), as one frozen view."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerView:
    """The server options relay depends on, read once from SGLang's ServerArgs as SGLang
    resolved them (:func:`sglang_relay.runtime.sglang.server.server_view`): e.g. a ``page_size``
    left unset is what the attention backend forced (64 under ``trtllm_mha``)."""

    model_path: str = ""
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    attn_dp_size: int = 1
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    bnb_8bit: bool = False  # a bitsandbytes checkpoint quantized to 8 bits (LLM.int8)
    load_format: str = "auto"
    speculative_algorithm: str | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_steps: int | None = None
    device: str = ""
    disable_overlap_schedule: bool = False
    enable_lora: bool = False
    lora_backend: str = "csgmv"
    enable_hierarchical_cache: bool = False
    disaggregation_mode: str = "null"
    enable_deterministic_inference: bool = False
    enable_torch_compile: bool = False
    disable_radix_cache: bool = False
    dllm_algorithm: str | None = None
    enable_hisparse: bool = False
    hybrid_model: bool = False  # Mamba / linear-attention or DSA layers
    hybrid_swa: bool = False  # SGLang's hybrid sliding-window KV pool (frees window layers' KV)
    enable_pdmux: bool = False
    attn_cp_size: int = 1
    enable_prefill_cp: bool = False
    dcp_size: int = 1
    enable_attn_tp_input_scattered: bool = False
    enable_layernorm_sp: bool = False
    prefill_only_disable_kv_cache: bool = False
