"""Tensor parallel and graph-mode decode on the CPU, in one server: ``--tp 2`` (two ranks over
gloo, one core each) with decode forwards captured by SGLang's CPU graph runner
(``--enable-torch-compile``: torch.compile per batch size, captured at model-runner init
like CUDA graphs, before the relay runtime exists).

* The upstream is decoded by graph replays: its greedy output equals the Hugging Face
  reference executor's, and its span carries valid stamps, hidden states (captured at
  layer 2 inside the graph) and context masses: it relays whole, and the relay computes
  what the reference computes from its own decode, with the server's rule (the context
  rule at layer 2 with the last-row probe: masses and probe attention averaged over the
  ranks' heads) and with the deviation rule (a per-request config: detection at layer 3
  from the stored stream, deviations averaged over the ranks).
* A batch larger than the captured size decodes eagerly through the same capture and
  agrees with the reference too.
* The all-selected oracle equals standard prefill; both ranks checked each plan and
  selection against each other.

The embedded model has 9 attention heads (not divisible by 2), so this serves a small
random Llama (8 heads, 4 KV heads, 8 layers: ``sglang_relay.bench.models.random_llama``)
whose greedy outputs are diverse enough for exact span matching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from relay_helpers import (
    CONTEXT_RULE_AT_2,
    DEVIATION_AT_3,
    GRAPH_ARGS,
    assert_all_selected_equals_standard,
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
)

from sglang_relay.core import reference as R
from sglang_relay.core.config import RelayConfig
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

RELAY_CONFIG = CONTEXT_RULE_AT_2  # the stream is captured under TP and inside the graphs
DEVIATION = DEVIATION_AT_3


@pytest.fixture(scope="module")
def tp_model(model_dir, tmp_path_factory) -> Path:
    from sglang_relay.bench.models import random_llama

    return random_llama(tmp_path_factory.mktemp("tp") / "RandomLlama-tp", model_dir)


def test_tp2_with_graph_decode_relays_what_the_reference_computes(tp_model):
    # no SGLANG_CPU_OMP_THREADS_BIND: `serve` binds the two ranks itself (cpu_setup.serve_defaults)
    env = {"SGLANG_RELAY_CONFIG": json.dumps(RELAY_CONFIG)}
    settings = settings_from_env(str(tp_model), env)
    args = ["--model-path", str(tp_model), "--tp", "2", "--max-total-tokens", "8192"]
    with running_server([*args, *GRAPH_ARGS], env=env) as server:
        info = relay_info(server.url)
        assert info["tp_size"] == 2 and info["capture_layer"] == 2
        assert info["cuda_graphs"]["decode"] is True and info["capture_in_graph"] is True

        ref = R.load_model(str(tp_model))
        point = settings.point(settings.reuse_target, ref.num_layers)
        assert point.config.probes and point.config.context_layer(ref.num_layers) == 2
        served, result, span = relay_one_upstream(server.url, ref, point.config)
        assert served["meta_info"]["relay"]["probe"] == "last_row"
        assert_matches_reference(served, result)
        assert R.greedy_continue(ref, result, 4) == served["output_ids"]
        graphs = relay_info(server.url)
        assert graphs["graph_forwards_decode"] >= 95  # the upstream's 96 tokens, bs 1
        assert graphs.get("forwards_decode", 0) == 0  # nothing decoded eagerly so far

        # two upstreams in one batch: above the captured size, so eager decode
        ups = [list(range(1100 + 7 * i, 1140 + 7 * i)) for i in range(2)]
        outs = generate_ids(server.url, ups, 40)  # 39-token spans (>= min_span 32)
        records = R.generate(ref, ups, 40)
        assert [r.output for r in records] == [o["output_ids"] for o in outs]
        head, tail = list(range(2100, 2117)), list(range(3000, 3011))
        prompt = head + records[1].span_tokens + tail
        option = {"method": "relay", "config": DEVIATION}
        down = generate_ids(server.url, prompt, 2, option, return_logprob=True, top_logprobs_num=5)
        assert down["meta_info"]["relay"]["reused_tokens"] == len(records[1].span_tokens)
        occ = R.SpanOccurrence(len(head), records[1], 0, len(records[1].span_tokens))
        deviation = RelayConfig.from_dict({**point.config.to_dict(), **DEVIATION})
        assert deviation.detects and "probe" not in down["meta_info"]["relay"]
        assert_matches_reference(down, R.relay_prefill(ref, prompt, [occ], deviation))
        assert relay_info(server.url)["forwards_decode"] >= 36

        # all-selected oracle == standard prefill, under TP too
        assert_all_selected_equals_standard(server.url, span)

        info = relay_info(server.url)
        # every relay extend compared its plan, and every detected group its selection,
        # across the two ranks; they never differed
        assert info["tp_plan_checks"] >= 3 and info.get("tp_plan_mismatches", 0) == 0
        assert info["tp_selection_checks"] >= 2 and info.get("tp_selection_mismatches", 0) == 0
        assert info.get("fallback_tp_mismatch", 0) == 0 and info.get("fallbacks", 0) == 0
        pool = info["pool"]  # no leaked slots: SGLang's conservation law when idle
        assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"]
