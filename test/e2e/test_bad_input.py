"""Bad and odd input on the real server: each gets a clear error or a clean fallback, and
nothing served to other requests changes."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import random

import pytest
import requests
from relay_helpers import ALL_SELECTED, chat, generate, relay_info

from sglang_relay.client import healthy

pytestmark = pytest.mark.e2e
_unique = itertools.count(5000)
EXACT = {"method": "relay", "config": ALL_SELECTED}


@pytest.fixture()
def upstream_text(server, tok):
    k = next(_unique)
    out = generate(server.url, chat(tok, f"Writer {k}.", f"Describe machine {k} in detail."), n=120)
    return out["text"]


def _pool_balanced(url):
    pool = relay_info(url)["pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"], pool


def test_prompt_that_is_only_a_span(server, upstream_text):
    exact = generate(server.url, upstream_text, relay=EXACT)
    assert exact["meta_info"]["relay"]["spans_matched"] >= 1
    default = generate(server.url, upstream_text)
    assert default["meta_info"]["relay"]["fallback"] is None
    std = generate(server.url, upstream_text, relay="standard")
    assert exact["output_ids"] == std["output_ids"]


def test_empty_and_one_token_outputs(server, tok):
    k = next(_unique)
    tiny = generate(server.url, chat(tok, f"Terse {k}.", "Say nothing."), n=1)
    for text in ("", tiny["text"]):
        out = generate(server.url, chat(tok, f"Reader {k}.", f"Input:[{text}] Go."))
        relay = out["meta_info"]["relay"]
        assert relay["spans_matched"] == 0 and relay["fallback"] is None


def test_span_longer_than_the_context_is_refused_cleanly(server, tok, upstream_text):
    reps = 8192 // len(tok(upstream_text).input_ids) + 2
    prompt = chat(tok, "Reader.", "\n".join([upstream_text] * reps))
    probe = chat(tok, "Helper.", "Count to five.")
    before = generate(server.url, probe, relay="standard")
    resp = requests.post(
        server.url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 4}},
        timeout=300,
    )
    assert resp.status_code == 400, resp.text[:300]
    assert "context length" in resp.text or "longer than" in resp.text
    after = generate(server.url, probe, relay="standard")
    assert after["output_ids"] == before["output_ids"]
    _pool_balanced(server.url)


def test_unicode_around_span_boundaries(server, upstream_text):
    """Characters glued to both ends change the tokens at the span's edges; the matched
    interior must still be served exactly (all-selected oracle) and nothing breaks."""
    body = upstream_text[1:-1]
    prompt = f"«{body}é\u0301🙂» — 漢字テスト\n\nSummarize."
    exact = generate(server.url, prompt, relay=EXACT)
    assert exact["meta_info"]["relay"]["spans_matched"] >= 1
    default = generate(server.url, prompt)
    assert default["meta_info"]["relay"]["fallback"] is None
    std = generate(server.url, prompt, relay="standard")
    assert exact["output_ids"] == std["output_ids"]


def _random_options(rng: random.Random):
    leaves = [None, True, -1, 0, 10**9, 1e308, -0.5, 2**70, 2**63, "", "relay", "κ", [1], {}]
    fields = ["method", "config", "l_start", "tau_dev", "top_ratio", "first_k", "zzz"]
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(leaves + ["naive", "epic", "cacheblend", "standard", "warp"])
    if kind == 1:
        return {rng.choice(fields): rng.choice(leaves) for _ in range(rng.randint(0, 3))}
    config = {rng.choice(fields[2:]): rng.choice(leaves) for _ in range(rng.randint(1, 3))}
    return {"method": rng.choice(["relay", "epic", 3]), "config": config}


def test_fuzzed_options_never_disturb_other_requests(server, tok, upstream_text):
    rng = random.Random(1234)
    prompt = chat(tok, "Editor.", f"Draft:\n\n{upstream_text}\n\nShorten it.")
    probe = chat(tok, "Helper.", "Name three colours.")
    alone = generate(server.url, probe, relay="standard")
    errors_before = relay_info(server.url).get("fallback_error", 0)
    options = [_random_options(rng) for _ in range(16)]

    def send(opt):
        params = {"max_new_tokens": 16, "temperature": 0, "custom_params": {"relay": opt}}
        body = {"text": prompt, "sampling_params": params}
        return requests.post(server.url + "/generate", json=body, timeout=300)

    with cf.ThreadPoolExecutor(4) as pool:
        probes = [pool.submit(generate, server.url, probe, relay="standard") for _ in range(4)]
        outs = list(pool.map(send, options))
    for opt, resp in zip(options, outs, strict=True):
        if resp.status_code == 400:  # refused at the door, naming the field
            assert "custom_params.relay" in resp.json()["error"]["message"], (opt, resp.text)
            continue
        assert resp.status_code == 200, (opt, resp.text[:300])
        assert resp.json()["meta_info"]["relay"]["fallback"] is None, opt
    for p in probes:
        assert p.result()["output_ids"] == alone["output_ids"]
    assert healthy(server.url)
    assert relay_info(server.url).get("fallback_error", 0) == errors_before  # no crash inside
    _pool_balanced(server.url)
