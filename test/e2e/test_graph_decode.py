"""Graph-mode decode: a relay server whose decode forwards are captured graphs (SGLang's CPU
graph runner, ``--enable-torch-compile``: torch.compile per batch size, captured at
model-runner init like CUDA graphs) decodes what the Hugging Face reference executor
decodes, and the spans it decoded under graphs carry valid stamps and hidden states: they
relay whole and the relay computes what the reference computes from its own decode. A batch
larger than the captured size decodes eagerly through the same capture, and agrees
with the reference too."""

from __future__ import annotations

import pytest
from relay_helpers import (
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

# one captured batch size keeps the compile short on 2 cores; batches of 2+ run eager
GRAPH_ARGS = [
    "--enable-torch-compile",
    "--cuda-graph-bs-decode",
    "1",
    "--torch-compile-max-bs",
    "1",
]


def test_graph_decode_stores_what_relay_needs(model_dir):
    settings = settings_from_env(str(model_dir), {})
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192", *GRAPH_ARGS]
    with running_server(args) as server:
        info = relay_info(server.url)
        assert info["cuda_graphs"]["decode"] is True and info["capture_in_graph"] is True
        assert info["capture_layer"] is not None and info["capture_layer"] > 0

        ref = R.load_model(str(model_dir))
        cfg = settings.config  # the shipped profile, as the server runs it by default
        # upstream (96 tokens, batch size 1) decoded by graph replays; its span relays whole
        served, result, _ = relay_one_upstream(server.url, ref, cfg)
        assert_matches_reference(served, result)
        assert R.greedy_continue(ref, result, 4) == served["output_ids"]
        graphs = relay_info(server.url)
        assert graphs["graph_forwards_decode"] >= 95
        assert graphs.get("forwards_decode", 0) == 0  # nothing decoded eagerly so far

        # two upstreams in one batch: above the captured size, so eager decode
        ups = [list(range(1100 + 7 * i, 1140 + 7 * i)) for i in range(2)]
        outs = generate_ids(server.url, ups, 64)
        records = R.generate(ref, ups, 64)
        assert [r.output for r in records] == [o["output_ids"] for o in outs]
        head, tail = list(range(2100, 2117)), list(range(3000, 3011))
        span = records[1].span_tokens
        prompt = head + span + tail
        down = generate_ids(server.url, prompt, 2, return_logprob=True, top_logprobs_num=5)
        assert down["meta_info"]["relay"]["reused_tokens"] == len(span)
        occ = R.SpanOccurrence(len(head), records[1], 0, len(span))
        assert_matches_reference(down, R.relay_prefill(ref, prompt, [occ], cfg))
        eager = relay_info(server.url)
        assert eager["forwards_decode"] >= 60
        assert eager.get("fallbacks", 0) == 0
        pool = eager["pool"]  # no leaked slots: SGLang's conservation law when idle
        assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"]
