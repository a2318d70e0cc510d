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
    ALL_SELECTED,
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
        assert info["linear_rows"] == "independent"  # threshold 0: every row on its own
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


def test_relay_through_a_per_tensor_scaled_linear_method(model_dir, tmp_path_factory):
    """Relay's CPU stand-in method (int8 weights, one activation scale per matmul:
    runtime/standin/quant_standin.py), registered through SGLang's quantization registry and
    named by the checkpoint's ``quantization_config``, as a dynamic per-tensor FP8
    checkpoint names its method on a GPU. The server measures its linears as
    batch-coupled; SGLang's own standard prefill under it already depends on which rows
    run together (a prefix hit of the same prompt gives other logprobs); relay relays
    through it, and the all-selected oracle, whose layers run every row of the prompt in
    one matmul as a cold standard prefill does, equals that prefill."""
    import math

    from sglang_relay.bench.models import standin_int8_checkpoint
    from sglang_relay.runtime.standin.quant_standin import CPU_INT8_PT_ENV

    ckpt = standin_int8_checkpoint(model_dir, tmp_path_factory.mktemp("int8pt") / "SmolLM2-int8pt")
    args = ["--model-path", str(ckpt), "--max-total-tokens", "8192"]
    with running_server(args, env={CPU_INT8_PT_ENV: "1"}) as s:
        info = relay_info(s.url)
        assert info["linear_method"] == "PerTensorInt8LinearMethod", info["linear_method"]
        assert info["linear_rows"] == "batch-coupled" and info["disabled"] is None
        span = generate_ids(s.url, list(range(1048, 1088)), 64)["output_ids"][:-1]
        prompt = [*range(4000, 4017), *span, *range(3000, 3011)]

        def standard(salt: str, ids=prompt) -> dict:
            return generate_ids(s.url, ids, 6, "standard", return_logprob=True, cache_salt=salt)

        def logprobs(out: dict) -> list[float]:
            return [x[0] for x in out["meta_info"]["output_token_logprobs"]]

        # SGLang alone: the same prompt cold, and with its first 17 tokens a prefix hit
        cold = standard("cold")
        standard("hit", prompt[:17])
        hit = standard("hit")
        assert hit["meta_info"]["cached_tokens"] >= 17 and cold["meta_info"]["cached_tokens"] == 0
        gap = max(abs(a - b) for a, b in zip(logprobs(cold), logprobs(hit), strict=True))
        assert gap > 1e-4, gap  # batch-coupled in SGLang's own prefill
        # relay through the method: the span relays; every row recomputed == cold standard
        oracle = generate_ids(
            s.url, prompt, 6, {"method": "relay", "config": ALL_SELECTED}, return_logprob=True
        )
        assert oracle["meta_info"]["relay"]["reused_tokens"] == len(span)
        assert oracle["output_ids"] == cold["output_ids"]
        pairs = zip(logprobs(oracle), logprobs(cold), strict=True)
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in pairs)
        relayed = generate_ids(s.url, [2100, *range(2101, 2117), *span, *range(3000, 3011)], 6)
        got = relayed["meta_info"]["relay"]
        assert got["fallback"] is None and got["reused_tokens"] >= 0.9 * len(span), got
        assert relay_info(s.url).get("fallback_error", 0) == 0
