"""One real SGLang server (relay backend, embedded model, bounded KV pool) per session."""

from __future__ import annotations

import pytest
from relay_helpers import running_server

E2E_KV_TOKENS = 16384


@pytest.fixture(scope="session")
def server(model_dir):
    args = ["--model-path", str(model_dir), "--max-total-tokens", str(E2E_KV_TOKENS)]
    with running_server([*args, "--enable-metrics"]) as proc:
        yield proc


@pytest.fixture(scope="session")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
