"""Stand-in models for shapes the embedded model cannot take.

The embedded SmolLM2-135M has 9 attention heads and 3 KV heads, which do not split over 2
tensor-parallel ranks. :func:`random_llama` writes a small Llama with random weights whose
heads do (8 heads, 4 KV heads, 8 layers), with the embedded model's tokenizer, untied
embeddings and a wide init, so that its greedy outputs are diverse enough for exact span
matching on token ids. Its outputs mean nothing: it serves oracles that compare against
a reference executor and timings, never fidelity.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def random_llama(out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """Write the random tp-splittable Llama to ``out`` (skipped if already there)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.1,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in Path(tokenizer_from).iterdir():
        if "token" in f.name:
            shutil.copy(f, out / f.name)
    return out
