"""Stand-in models for shapes and architectures the embedded model cannot take.

The embedded SmolLM2-135M is a Llama with 9 attention heads and 3 KV heads, which do not
split over 2 tensor-parallel ranks, and there is no model hub here. :func:`random_model`
writes a small model of another architecture (Llama, Mistral, Qwen2, Qwen3, Phi-3 and
the MoE models Qwen3-MoE, Qwen2-MoE, Mixtral) with random
weights from its ``transformers`` config class, with the embedded model's tokenizer,
untied embeddings and a wide init, so that its greedy outputs are diverse enough for exact
span matching on token ids. Its outputs mean nothing: it serves oracles that compare
against a reference executor and Hugging Face forwards, and timings, never fidelity.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# 8 heads, 4 KV heads, 8 layers: splits over 2 tensor-parallel ranks
COMMON: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}
# what each architecture adds: a head dim other than hidden / heads and the per-head q/k
# norms (Qwen3), q/k/v biases (Qwen2), Mistral's own config class
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "qwen2": ("Qwen2", {"use_sliding_window": False}),
    "qwen3": ("Qwen3", {"head_dim": 48, "use_sliding_window": False}),
    # fused qkv_proj / gate_up_proj in the checkpoint
    "phi3": ("Phi3", {"sliding_window": None, "pad_token_id": 0}),
    # Qwen3's attention and a sparse MoE block (8 experts, top 2) in every layer
    "qwen3_moe": (
        "Qwen3Moe",
        {
            "head_dim": 48,
            "use_sliding_window": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    # Qwen2's attention (q/k/v biases), 8 routed experts (top 2) and a gated shared expert
    "qwen2_moe": (
        "Qwen2Moe",
        {
            "use_sliding_window": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    # Mistral's attention, 8 experts (top 2) in block_sparse_moe
    "mixtral": (
        "Mixtral",
        {
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 128,
        },
    ),  # fmt: skip
}


def random_hf_model(arch: str, *, seed: int = 0, **overrides: Any):
    """An in-memory random ``<Arch>ForCausalLM`` (fp32) of :data:`ARCHITECTURES`."""
    import torch
    import transformers

    name, extra = ARCHITECTURES[arch]
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    cfg = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    return model_cls(cfg).float()


def random_model(arch: str, out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """Write the random ``arch`` model to ``out`` with the tokenizer files of
    ``tokenizer_from`` (skipped if already there)."""
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = random_hf_model(arch, seed=seed)
    model.config.torch_dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(tokenizer_from).iterdir():
        if "token" in f.name:
            shutil.copy(f, out / f.name)
    return out


def random_llama(out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """The random tp-splittable Llama (the tensor-parallel test and ``bench decode``)."""
    return random_model("llama", out, tokenizer_from, seed=seed)
