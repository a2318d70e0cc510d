"""Reasoning outputs (``<think> ... </think> answer``) pasted downstream without their
reasoning: with ``--reasoning-parser``, relay judges relatedness on the answer (the part
after the model's reasoning end marker, whose token ids SGLang's parser gives), so an
answer much shorter than its reasoning still relays; without a marker the same text is
judged against the whole output and is not relayed.

The embedded model does not reason; the upstream outputs are forced token by token by a
custom logit processor (SGLang's ``--enable-custom-logit-processor``), so their KV is
decoded as a reasoning model's would be: the answer's with the reasoning in context. The
answer is capped for the reasoning reuse target (0.60 by default) apart from other runs,
as the reference executor caps an occurrence marked as an answer."""

from __future__ import annotations

import pytest
import requests
from relay_helpers import assert_matches_reference, generate_ids, relay_info, running_server

from sglang_relay.core import reference as R
from sglang_relay.core.operating import answer_cap
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def _forced(url: str, prompt: list[int], output: list[int]) -> dict:
    from sglang_relay.bench.forcing import forced_request

    resp = requests.post(url + "/generate", json=forced_request(prompt, output), timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["output_ids"] == output
    return out


def _relay(url: str, prompt: list[int]) -> dict:
    params = {"max_new_tokens": 2, "temperature": 0}
    resp = requests.post(
        url + "/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=300
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]["relay"]


def test_an_answer_pasted_without_its_reasoning_relays(model_dir, tok):
    end = tok.encode("</think>", add_special_tokens=False)
    reasoning = tok.encode(" Let me work through the bridge loads one span at a time," * 10)
    answer = tok.encode(" The answer: use a steel truss with a 40 metre main span and two piers.")
    answer *= 2  # 40 tokens (>= min_span 32)
    assert len(reasoning) > 3 * len(answer)  # the answer alone is far below half the output
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192"]
    args += ["--reasoning-parser", "deepseek-r1", "--enable-custom-logit-processor"]
    with running_server(args) as s:
        head, tail = list(range(2000, 2023)), list(range(3000, 3011))
        # the same text without the marker: a plain output whose answer is a small part
        # (+1 token: the last sampled token has no KV)
        _forced(s.url, list(range(1100, 1140)), [*reasoning, 11, *answer, 13])
        info = _relay(s.url, head + answer + tail)
        assert info["reused_tokens"] == 0 and info["fallback"] == "unrelated_match", info
        # a reasoning output: reasoning, </think>, the answer; it relates by its answer
        up = list(range(1000, 1040))
        _forced(s.url, up, [*reasoning, *end, *answer, 13])
        assert relay_info(s.url)["reasoning_spans"] == 1
        prompt = list(range(2100, 2123)) + answer + tail
        served = generate_ids(s.url, prompt, 4, None, return_logprob=True, top_logprobs_num=5)
        info = served["meta_info"]["relay"]
        assert info["fallback"] is None and info["reused_tokens"] == len(answer), info
        # what the reference computes when the answer's context masses count the question
        # and the reasoning as the context a paste replaces (the answer decoded after them)
        ref = R.load_model(str(model_dir))
        (record,) = R.generate(ref, [up + reasoning + end], len(answer) + 1, force=[[*answer, 13]])
        assert record.span_tokens == answer
        # the shipped profile as served, the answer capped for reuse 0.60 (its own pool)
        settings = settings_from_env(str(model_dir), {})
        cfg = answer_cap(settings.config, ref.num_layers, settings.reasoning_reuse)
        assert cfg.answer_max_ratio > cfg.max_ratio and info["answer_tokens"] == len(answer)
        occ = R.SpanOccurrence(23, record, 0, len(answer), answer=True)
        result = R.relay_prefill(ref, prompt, [occ], cfg)
        assert_matches_reference(served, result)
        # the answer pool's cap, not the request's (0.199 * 40 would select 7)
        assert info["selected_tokens"] == int(cfg.answer_max_ratio * len(answer)) - int(cfg.probes)
        assert info["reuse_rate"] < 0.80
