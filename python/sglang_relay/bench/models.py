"""Stand-in models for shapes and architectures the embedded model cannot take.

The embedded SmolLM2-135M is a Llama with 9 attention heads and 3 KV heads, which do not
split over 2 tensor-parallel ranks, and there is no model hub here. :func:`random_model`
writes a small model of another architecture (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3,
the MoE models Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, MiniMax-M2, gpt-oss, and the MLA
models DeepSeek-V3 and Kimi-K2) with random weights from its ``transformers`` config class,
with the embedded model's tokenizer, untied embeddings and a wide init, so that its greedy
outputs are diverse enough for exact span matching on token ids. Its outputs mean nothing:
it serves oracles that compare against a reference executor and Hugging Face forwards, and
timings, never fidelity.
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
    # GLM-4.5: partial rotary (half of a 64-dim head), YaRN, per-head q/k norms, 8
    # sigmoid-routed experts (top 2) and a shared expert, the first layer dense
    "glm4_moe": (
        "Glm4Moe",
        {
            "head_dim": 64,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 4096,
                "partial_rotary_factor": 0.5,
            },
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "use_qk_norm": True,
        },
    ),  # fmt: skip
    # MiniMax-M2: partial rotary (64 of 128 dims, a larger RoPE base), one RMSNorm over all
    # heads of q and of k (SGLang reduces it across attention-TP ranks), 2 KV heads,
    # sigmoid-routed experts with a score-correction bias under block_sparse_moe
    "minimax_m2": (
        "MiniMaxM2",
        {
            "head_dim": 128,
            "rotary_dim": 64,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 128,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "initializer_range": 0.2,  # at 0.1 its greedy output repeats one token
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),  # fmt: skip
    # gpt-oss: sliding-window (16 keys) and full layers alternating, a learned sink per
    # query head, q/k/v/o biases, YaRN (factor 8), 8 experts (top 2) with biases behind a
    # ``router``; head dim 64 with 8 heads != hidden / heads
    "gpt_oss": (
        "GptOss",
        {
            "head_dim": 64,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 4,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 1024,
            },
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),  # fmt: skip
    # Gemma 3: four norms a layer, per-head q/k norms, 12-key windows on 2 of every 3 layers
    # (its 5-of-6 pattern, shortened), local RoPE base 1e4 and a linear-scaled global one,
    # query scale from query_pre_attn_scalar, GeGLU, tied embeddings scaled by sqrt(hidden)
    "gemma3": (
        "Gemma3",
        {
            "head_dim": 64,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 48,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "linear",
                    "rope_theta": 1000000.0,
                    "factor": 4.0,
                },
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": True,  # SGLang's Gemma 3 loads no lm_head of its own
        },
    ),  # fmt: skip
    # DeepSeek-V3 / R1 (MLA): one latent row a token (kv_lora_rank 256 + a 32-dim rotary
    # part, the r + p = 288 SGLang's Triton MLA kernels take), q through a low-rank
    # projection (q_lora_rank), YaRN with mscale != mscale_all_dim (the rotary table and
    # the softmax scale both scaled), sigmoid-routed grouped experts with a score-correction
    # bias (randomized) and a shared expert, the first layer dense
    "deepseek_v3": (
        "DeepseekV3",
        {
            "num_key_value_heads": 4,
            "num_attention_heads": 4,
            "q_lora_rank": 96,
            "kv_lora_rank": 256,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 48,
            "rope_interleave": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 128,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",  # read by SGLang, not a DeepseekV3Config field
            "scoring_func": "sigmoid",
            "moe_layer_freq": 1,
            "attention_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),  # fmt: skip
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


# Kimi-K2 (DeepSeek-V3's classes): 8 heads, a 64-dim rotary part beside a 224-dim latent
# (r + p = 288), a longer YaRN (factor 32, theta 50000, mscale == mscale_all_dim: the
# softmax scale unscaled), ungrouped routing over 16 experts (top 4)
ARCHITECTURES["kimi_k2"] = (
    "DeepseekV3",
    {
        **ARCHITECTURES["deepseek_v3"][1],
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128,
        "kv_lora_rank": 224, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
            "original_max_position_embeddings": 256, "beta_fast": 1.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
        "moe_intermediate_size": 64, "routed_scaling_factor": 2.827,
    },
)  # fmt: skip

TEXT_CONFIGS = {"Gemma3": "Gemma3TextConfig"}


def random_hf_model(arch: str, *, seed: int = 0, **overrides: Any):
    """An in-memory random ``<Arch>ForCausalLM`` (fp32) of :data:`ARCHITECTURES`."""
    import torch
    import transformers

    name, extra = ARCHITECTURES[arch]
    # Gemma 3's text model has its own config class (Gemma3Config is the multimodal one)
    config_cls = getattr(transformers, TEXT_CONFIGS.get(name, f"{name}Config"))
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    fields = {**COMMON, **extra, **overrides}
    if "layer_types" in fields:  # the pattern repeated over the layers asked for
        types, n = fields["layer_types"], fields["num_hidden_layers"]
        fields["layer_types"] = [types[i % len(types)] for i in range(n)]
    cfg = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share,
                p.copy_(p.normal_(0.0, 1.0).bfloat16())  # bf16 values: SGLang keeps bf16
        for name, b in model.named_buffers():  # DeepSeek's router bias: zeros by default
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model


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


def bnb_8bit_checkpoint(model_dir: Path, out: Path, *, threshold: float = 6.0) -> Path:
    """``model_dir`` quantized to 8-bit weights by bitsandbytes (LLM.int8, through
    Hugging Face transformers, on the CPU) and saved with its tokenizer at ``out``: a
    pre-quantized checkpoint SGLang serves with ``--load-format bitsandbytes``.
    ``threshold``: the activation magnitude above which a column is computed apart in
    fp16 (``llm_int8_threshold``; 6.0 is the library's default, 0 turns it off). Reused
    when ``out`` already holds one."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quant, torch_dtype=torch.bfloat16
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def standin_int8_checkpoint(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with ``quantization_config`` naming relay's CPU stand-in method
    (per-tensor dynamic int8, :mod:`sglang_relay.runtime.standin.quant_standin`; served only with
    its opt-in): the weights are linked, not copied, and quantized when SGLang loads them."""
    import json

    from sglang_relay.runtime.config.modes import STANDIN_QUANTIZATION

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": STANDIN_QUANTIZATION}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


# ---- LoRA adapters (test/e2e/test_lora.py, research/studies/lora_shared_cost.py) -----------------
LORA_TARGETS = {  # PEFT target name -> the module under each decoder layer
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}  # fmt: skip


def random_lora_adapter(
    model_dir: Path, out: Path, *, seed: int, rank: int = 8, alpha: int = 16, std: float = 0.03
) -> dict[str, tuple]:
    """Write a random PEFT LoRA adapter for every linear of every decoder layer of the
    Llama-shaped model in ``model_dir`` (A and B both random, so it changes outputs from
    the start); returns its ``(A, B)`` pairs by the base weight's checkpoint name."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    shapes = {  # (in, out) of each target
        "q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h), "gate_proj": (h, cfg.intermediate_size),
        "up_proj": (h, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, h),
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for i in range(cfg.num_hidden_layers):
        for target, (d_in, d_out) in shapes.items():
            a = torch.randn(rank, d_in, generator=g) * std
            b = torch.randn(d_out, rank, generator=g) * std
            module = f"model.layers.{i}.{LORA_TARGETS[target]}"
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            pairs[f"{module}.weight"] = (a, b, alpha / rank)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "r": rank, "lora_alpha": alpha, "target_modules": list(shapes), "peft_type": "LORA",
        "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": str(model_dir),
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return pairs


def merged_lora_model(model_dir: Path, out: Path, pairs: dict[str, tuple]) -> Path:
    """A copy of the model in ``model_dir`` with the adapter ``pairs`` merged into its
    weights (``W + s B A``, in float64 then the checkpoint's dtype): what a server with the
    adapter must compute, for the reference executor."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    files = [f for f in Path(model_dir).iterdir() if f.suffix == ".safetensors"]
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in files:
        weights = load_file(str(f))
        for name, (a, b, scale) in pairs.items():
            if name in weights:
                w = weights[name]
                weights[name] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out
