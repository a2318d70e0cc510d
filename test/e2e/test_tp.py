"""Tensor parallel on the CPU: ``--tp 2`` (two ranks over gloo, one core each) relays what
the Hugging Face reference executor computes, its all-selected oracle equals standard
prefill, and both ranks checked each plan and selection against each other.

The embedded model has 9 attention heads (not divisible by 2), so this builds a small
random Llama (8 heads, 4 KV heads, 8 layers) with untied embeddings and a wide init, whose
greedy outputs are diverse enough for exact span matching."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from relay_helpers import (
    ALL_SELECTED,
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

# a stored hidden state at layer 2 (so the capture path runs under TP too), detection at 3
RELAY_CONFIG = {"l_start": 2, "l_det": 3, "first_k": 4, "tau_dev": 1.0, "l_suf": 0}


@pytest.fixture(scope="module")
def tp_model(model_dir, tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tp") / "RandomLlama-tp"
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
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in Path(model_dir).iterdir():  # the embedded model's tokenizer
        if "token" in f.name:
            shutil.copy(f, out / f.name)
    return out


def test_tp2_relay_equals_the_reference(tp_model):
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_RELAY_CONFIG": json.dumps(RELAY_CONFIG)}
    settings = settings_from_env(str(tp_model), env)
    args = ["--model-path", str(tp_model), "--tp", "2", "--max-total-tokens", "8192"]
    with running_server(args, env=env) as server:
        ref = R.load_model(str(tp_model))
        point = settings.point(settings.reuse_target, ref.num_layers)
        assert point.config.l_start == 2 and point.config.l_det == 3
        served, result, span = relay_one_upstream(server.url, ref, point.config)
        assert_matches_reference(served, result)
        assert R.greedy_continue(ref, result, 4) == served["output_ids"]

        # all-selected oracle == standard prefill, under TP too
        prompt2 = list(range(4000, 4017)) + span + list(range(3000, 3011))
        oracle = generate_ids(
            server.url, prompt2, 8, {"method": "relay", "config": ALL_SELECTED}, return_logprob=True
        )
        std = generate_ids(server.url, prompt2, 8, "standard", return_logprob=True)
        assert oracle["meta_info"]["relay"]["reused_tokens"] == len(span)
        assert oracle["output_ids"] == std["output_ids"]
        got = [x[0] for x in oracle["meta_info"]["output_token_logprobs"]]
        want = [x[0] for x in std["meta_info"]["output_token_logprobs"]]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, want, strict=True))

        info = relay_info(server.url)
        assert info["tp_size"] == 2
        # every relay extend compared its plan, and every detected group its selection,
        # across the two ranks; they never differed
        assert info["tp_plan_checks"] >= 2 and info.get("tp_plan_mismatches", 0) == 0
        assert info["tp_selection_checks"] >= 1 and info.get("tp_selection_mismatches", 0) == 0
        assert info.get("fallback_tp_mismatch", 0) == 0
        pool = info["pool"]  # no leaked slots: SGLang's conservation law when idle
        assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"]
