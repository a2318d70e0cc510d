"""Relay on quantized weights, end to end: a bitsandbytes 8-bit (LLM.int8) checkpoint of
the embedded model, built here on the CPU through Hugging Face transformers and served with
``--load-format bitsandbytes`` (the one SGLang 0.5.23 weight-quantization path that runs on
this CPU; docs/limitations.md names the others and why they do not). Served on Llama only:
the method turns last-bit differences into whole int8 steps (a 1e-7 relative nudge of each
layer's input moves logprobs by up to 1.6, research/studies/bnb8_sensitivity.py), so only
a real-weight checkpoint whose oracle is exact verifies a family, and the one here is a
Llama.

The checkpoint is quantized with ``llm_int8_threshold=0``: every activation row is
quantized on its own, so a row's result does not depend on the other rows of its matmul and
the exactness oracle is exact. With the library's default threshold (6.0) the method
computes the columns where any row of the matmul exceeds it apart in fp16, so SGLang's own
result for a request depends on its batch companions (a prefix-cache hit that runs only
the last row already gives other logprobs than a cold prefill); relay's row subsets are one
more such batch (docs/limitations.md).

What is checked: the served linears are SGLang's bitsandbytes method (the server says which
method its layers run); a pasted upstream output is relayed through them (relay's layer
driver calls the same quantized modules on row subsets); the all-selected oracle (every
span token recomputed in every layer) equals the same server's standard prefill, tokens
and logprobs."""

from __future__ import annotations

import pytest
from relay_helpers import (
    assert_all_selected_equals_standard,
    generate_ids,
    relay_info,
    running_server,
)

from sglang_relay.bench.models import bnb_8bit_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_relay_on_a_bitsandbytes_8bit_checkpoint(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bnb8") / "SmolLM2-bnb8"
    ckpt = bnb_8bit_checkpoint(model_dir, out, threshold=0.0)
    args = ["--model-path", str(ckpt), "--load-format", "bitsandbytes"]
    with running_server([*args, "--max-total-tokens", "8192"]) as s:
        info = relay_info(s.url)
        assert info["linear_method"] == "BitsAndBytesLinearMethod", info["linear_method"]
        assert info["disabled"] is None
        upstream = generate_ids(s.url, list(range(1048, 1088)), 64)
        span = upstream["output_ids"][:-1]  # the last sampled token has no KV
        prompt = [2100, *range(2101, 2117), *span, *range(3000, 3011)]
        relayed = generate_ids(s.url, prompt, 6)
        got = relayed["meta_info"]["relay"]
        assert got["fallback"] is None and got["reused_tokens"] >= 0.9 * len(span), got
        assert 0 < got["reuse_rate"] < 1
        assert_all_selected_equals_standard(s.url, span)
        assert relay_info(s.url).get("fallback_error", 0) == 0
