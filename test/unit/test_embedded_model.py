"""The embedded model's conversion: weights, rotary row order, tokenizer, cache hygiene."""

from __future__ import annotations

import errno
import math

import numpy as np
import pytest
import torch

from sglang_relay import embedded_model as em
from sglang_relay.errors import RelayError

PROSE = (
    "The history of the city begins in the early middle ages, when a small market grew up "
    "beside the river crossing. Merchants from the surrounding villages brought grain, wool "
    "and timber, and within a century the town had a church, a wall and a charter granted "
    "by the king. Over the following centuries the population grew steadily, and the old "
    "wooden houses were replaced by buildings of brick and stone."
)


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes (rotary pairs interleaved)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("n_heads", [3, 9])
def test_unpermute_inverts_llama_cpp_permutation(n_heads):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_heads * 64, 40)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(em._unpermute_rotary(permuted, n_heads), w)


def test_tokenizer_splits_digits_and_knows_specials(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # One token per digit; transformers' own GGUF conversion merges "45" into one token.
    ids = tok("\n 3 45", add_special_tokens=False).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-2:] == ["4", "5"], pieces
    assert tok.decode(ids) == "\n 3 45"
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_weights_give_fluent_english(model_dir):
    """A wrong q/k row order or dequantization shows up as a perplexity in the thousands."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(PROSE, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.exp(loss) < 40, math.exp(loss)


def test_ready_marker_and_idempotence(model_dir):
    assert em.is_ready(model_dir)
    assert em.ensure_model(model_dir, quiet=True) == model_dir


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "model"

    def boom(*args, **kwargs):
        raise RelayError("conversion check failed")

    monkeypatch.setattr(em, "_check", boom)
    with pytest.raises(RelayError, match="check failed"):
        em.ensure_model(target, quiet=True)
    assert not target.exists()
    assert list((tmp_path / "cache").iterdir()) == []


def test_disk_full_is_one_clear_error(tmp_path, monkeypatch):
    target = tmp_path / "model"

    def full(source, out):
        (out / "partial.bin").write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(em, "_convert", full)
    with pytest.raises(RelayError, match="no space left"):
        em.ensure_model(target, quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SGLANG_RELAY_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert em.default_model_dir() == tmp_path / "sglang-relay" / "models" / em.MODEL_NAME
    monkeypatch.setenv("SGLANG_RELAY_MODEL_DIR", str(tmp_path / "x"))
    assert em.default_model_dir() == tmp_path / "x"
