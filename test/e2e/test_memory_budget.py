"""Relay's side memory comes out of SGLang's KV budget (runtime/budget.py), on a real server
whose pool is sized by the memory budget (not by --max-total-tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from relay_helpers import relay_info, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_pool_plus_side_data_fit_the_budget(model_dir):
    hf = json.loads(Path(model_dir, "config.json").read_text())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    # K and V per layer per token, fp32 on the CPU: computed here, not read from SGLang
    cell = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4
    args = [
        "--model-path",
        str(model_dir),
        "--mem-fraction-static",
        "0.1",
        "--max-total-tokens",
        str(10**8),  # above the budget: SGLang sizes the pool from the budget
    ]
    with running_server(args) as server:
        info = relay_info(server.url)
        budget = info["kv_budget"]
        assert budget is not None, info
        pool = info["pool"]["total"]
        side = info["side_bytes"]
        # what SGLang would have sized for this budget without relay fills it ...
        assert budget["tokens_without_relay"] * cell <= budget["budget_bytes"]
        assert budget["tokens_without_relay"] * cell > budget["budget_bytes"] - cell
        # ... and relay's pool plus its side data stay inside it
        assert pool == budget["tokens"] < budget["tokens_without_relay"]
        assert pool * cell + side <= budget["budget_bytes"]
        assert side <= budget["reserved_bytes"]
        # hidden states at l_start (fp32, hidden_size) + an 8-byte stamp per slot
        assert budget["side_bytes_per_slot"] == hf["hidden_size"] * 4 + 8
        # the shrink is the side data's share, not more: within one slot's worth per cell
        lost = budget["tokens_without_relay"] - pool
        assert lost * cell <= 1.1 * side + 2 * cell
        # and the server still serves
        r = requests.post(
            server.url + "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
