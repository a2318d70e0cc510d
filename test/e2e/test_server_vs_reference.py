"""The server's relay extend computes what the Hugging Face reference executor computes."""

from __future__ import annotations

import math

import pytest
from relay_helpers import (
    assert_matches_reference,
    decoded_upstream,
    generate_ids,
    relay_one_upstream,
    review_prompt,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def upstreams() -> dict:
    """Upstream decodes of this module by prompt: each decoded (and checked against the
    reference executor) once, its span relayed by every test that quotes it."""
    return {}


def test_relay_through_the_server_equals_the_reference(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = settings_from_env(str(model_dir), {}).config  # the shipped profile, as the server
    chat = tok.apply_chat_template
    up_ids = chat(
        [{"role": "user", "content": "Explain how a hash map handles collisions, step by step."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    up_ids = list(getattr(up_ids, "input_ids", up_ids))
    upstream = generate_ids(server.url, up_ids, 120)
    out_ids = upstream["output_ids"]

    ref = R.load_model(str(model_dir))
    record = R.generate(ref, [up_ids], len(out_ids))[0]
    assert record.output == out_ids  # greedy decode agrees, so the spans are the same

    span = record.span_tokens
    prompt, start = review_prompt(tok, span)

    served = generate_ids(server.url, prompt, 8, return_logprob=True, top_logprobs_num=5)
    relay = served["meta_info"]["relay"]
    assert relay["spans_matched"] == 1 and relay["reused_tokens"] == len(span)

    occ = R.SpanOccurrence(prompt_start=start, record=record, span_start=0, length=len(span))
    result = R.relay_prefill(ref, prompt, [occ], cfg)
    assert sum(result.selected) == pytest.approx(relay["selected_tokens"], abs=1)
    assert result.reuse_rate == pytest.approx(relay["reuse_rate"], abs=0.01)

    ref_lp = result.logits[-1].double().log_softmax(-1)
    for lp, tid, _ in served["meta_info"]["output_top_logprobs"][0]:
        assert math.isclose(lp, float(ref_lp[tid]), abs_tol=2e-3), (tid, lp, float(ref_lp[tid]))
    assert R.greedy_continue(ref, result, 8) == served["output_ids"]


@pytest.mark.parametrize("reuse", ["speed", 0.85])
def test_operating_point_through_the_server_equals_the_reference(
    server, model_dir, upstreams, reuse
):
    """A per-request reuse target runs the profile's operating point for it (on the shipped
    profile the context rule at layer 12, whose masses the server records when the upstream
    finishes), reports it, keeps the reuse it promises, and computes what the reference
    executor computes with it."""
    from sglang_relay.core.operating import parse_target

    settings = settings_from_env(str(model_dir), {})
    ref = R.load_model(str(model_dir))
    target = parse_target(reuse)
    point = settings.point(target, ref.num_layers)
    profiled = [t for t, _ in settings.frontier.points]
    assert point.profiled == min(t for t in profiled if t >= target)  # brute force

    option = {"reuse": reuse}
    served, result, _ = relay_one_upstream(server.url, ref, point.config, option, upstreams)
    relay = served["meta_info"]["relay"]
    assert relay["operating_point"] == point.to_dict() and relay["reuse_rate"] >= target
    assert_matches_reference(served, result)


def two_quoted_outputs(url, ref, upstreams, head_from: int = 2000):
    """Two upstream agents (other prompts, other outputs, equal to the reference's greedy
    decode), then a prompt quoting both: ``head + span 1 + mid + span 2 + tail`` (``head``:
    23 ids from ``head_from``). Returns the prompt and its two span occurrences."""
    records = [
        decoded_upstream(url, ref, list(range(first, first + 40)), 96, upstreams)
        for first in (1000, 1200)
    ]
    head = list(range(head_from, head_from + 23))
    mid, tail = list(range(2500, 2509)), list(range(3000, 3011))
    spans = [r.span_tokens for r in records]
    prompt = head + spans[0] + mid + spans[1] + tail
    occs = [
        R.SpanOccurrence(len(head), records[0], 0, len(spans[0])),
        R.SpanOccurrence(len(head) + len(spans[0]) + len(mid), records[1], 0, len(spans[1])),
    ]
    return prompt, occs


def test_one_budget_for_two_quoted_outputs_through_the_server_equals_the_reference(
    server, model_dir, upstreams
):
    """A prompt quoting two upstream outputs at the shipped 0.90 point's context rule
    without its probe (one cap per request): the server spends the request's budget over
    both spans as the reference executor does (same selected count, same first-token
    logprobs), and that budget is split unlike two per-span caps (so the check can tell
    them apart)."""
    from dataclasses import replace

    settings = settings_from_env(str(model_dir), {})
    ref = R.load_model(str(model_dir))
    point = settings.point(0.90, ref.num_layers)
    assert point.config.budget == "request" and point.config.ranks_context
    cfg = replace(point.config, probe=None)

    prompt, occs = two_quoted_outputs(server.url, ref, upstreams)
    spans = [o.record.span_tokens for o in occs]
    option = {"reuse": 0.90, "config": {"probe": None}}
    served = generate_ids(server.url, prompt, 4, option, return_logprob=True, top_logprobs_num=5)
    info = served["meta_info"]["relay"]
    assert info["fallback"] is None and info["spans_matched"] == 2, info
    assert info["reused_tokens"] == len(spans[0]) + len(spans[1])

    pooled = R.relay_prefill(ref, prompt, occs, cfg)
    per_span = R.relay_prefill(ref, prompt, occs, replace(cfg, budget="span"))
    assert sum(pooled.selected) == int(cfg.max_ratio * sum(map(len, spans)))
    assert pooled.selected != per_span.selected  # the split differs from two caps
    assert_matches_reference(served, pooled)


def test_last_row_probe_through_the_server_equals_the_reference(server, model_dir, upstreams):
    """The shipped 0.90 point, the context rule with the last-row probe (``probe``), on a
    prompt quoting two outputs: the server runs the probe (the rows before the first span
    for good, the last row over the spans and that context only, not ``mid`` nor
    ``tail``), charges its row, and computes what the reference executor computes with the
    probe: the same selected count and reuse, the same first-token logprobs, which the
    context rule without the probe does not give on this prompt (so the check can tell
    them apart)."""
    from dataclasses import replace

    settings = settings_from_env(str(model_dir), {})
    ref = R.load_model(str(model_dir))
    point = settings.point(0.90, ref.num_layers)
    assert point.config.probes and point.rule == "context+probe"
    # a head no other request used: its rows are computed by the probe, not a prefix hit
    prompt, occs = two_quoted_outputs(server.url, ref, upstreams, head_from=5000)
    served = generate_ids(
        server.url, prompt, 4, {"reuse": "balanced"}, return_logprob=True, top_logprobs_num=5
    )
    info = served["meta_info"]["relay"]
    assert info["fallback"] is None and info["spans_matched"] == 2, info
    assert info["probe"] == "last_row" and info["operating_point"] == point.to_dict(), info
    probed = R.relay_prefill(ref, prompt, occs, point.config)
    n = sum(o.length for o in occs)
    assert sum(probed.selected) == int(point.config.max_ratio * n) - 1  # the probe's row
    assert info["selected_tokens"] == sum(probed.selected)
    assert info["recomputed_token_layers"] == (sum(probed.selected) + 1) * ref.num_layers
    assert_matches_reference(served, probed)
    # the context rule without the probe gives other logprobs on the served top tokens
    plain = R.relay_prefill(ref, prompt, occs, replace(point.config, probe=None))
    ids = [tid for _, tid, _ in served["meta_info"]["output_top_logprobs"][0]]
    lp = [x.logits[-1].double().log_softmax(-1)[ids] for x in (plain, probed)]
    assert float((lp[0] - lp[1]).abs().max()) > 4e-3, (lp[0] - lp[1]).tolist()
