"""One real SGLang server (relay backend, embedded model, bounded KV pool) per session."""

from __future__ import annotations

import pytest
from relay_helpers import E2E_KV_TOKENS, server_fixture

server = server_fixture("--enable-metrics", kv_tokens=E2E_KV_TOKENS, scope="session")


@pytest.fixture(scope="session")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
