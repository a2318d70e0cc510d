"""The server's relay extend computes what the Hugging Face reference executor computes."""

from __future__ import annotations

import math

import pytest
import requests

from sglang_relay.core import reference as R
from sglang_relay.runtime.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def _post(url: str, ids: list[int], n: int, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    resp = requests.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


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
    upstream = _post(server.url, up_ids, 120)
    out_ids = upstream["output_ids"]

    ref = R.load_model(str(model_dir))
    record = R.generate(ref, [up_ids], len(out_ids))[0]
    assert record.output == out_ids  # greedy decode agrees, so the spans are the same

    span = record.span_tokens
    head = tok(
        "<|im_start|>system\nYou are a strict reviewer.<|im_end|>\n<|im_start|>user\n"
        "Review this answer:\n\n"
    ).input_ids
    tail = tok("\n\nList its mistakes.<|im_end|>\n<|im_start|>assistant\n").input_ids
    prompt = head + span + tail

    served = _post(server.url, prompt, 8, return_logprob=True, top_logprobs_num=5)
    relay = served["meta_info"]["relay"]
    assert relay["spans_matched"] == 1 and relay["reused_tokens"] == len(span)

    occ = R.SpanOccurrence(prompt_start=len(head), record=record, span_start=0, length=len(span))
    result = R.relay_prefill(ref, prompt, [occ], cfg)
    assert sum(result.selected) == pytest.approx(relay["selected_tokens"], abs=1)
    assert result.reuse_rate == pytest.approx(relay["reuse_rate"], abs=0.01)

    ref_lp = result.logits[-1].double().log_softmax(-1)
    for lp, tid, _ in served["meta_info"]["output_top_logprobs"][0]:
        assert math.isclose(lp, float(ref_lp[tid]), abs_tol=2e-3), (tid, lp, float(ref_lp[tid]))
    assert R.greedy_continue(ref, result, 8) == served["output_ids"]
