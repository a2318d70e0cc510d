"""Relay under chunked prefill, mixed batches, aborts and eviction (its own small server)."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import time

import pytest
import requests
from relay_helpers import ALL_SELECTED, chat, generate, relay_info, server_fixture

from sglang_relay.client import healthy

pytestmark = pytest.mark.e2e
_unique = itertools.count(1000)
CHUNK = 32


# chunks of 32 tokens (min_span) and a 3000-token KV pool: spans cross chunk boundaries
# and get evicted under load
small_server = server_fixture(
    "--chunked-prefill-size", str(CHUNK), "--relay-span-tokens", "1200", kv_tokens=3000
)


def _pool_balanced(url: str) -> dict:
    time.sleep(1.0)
    pool = relay_info(url)["pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"], pool
    return pool


@pytest.mark.full  # relay and cacheblend over chunks in CI (below)
def test_span_across_chunk_boundaries_matches_standard_when_fully_recomputed(small_server, tok):
    """A 150-token span over 32-token chunks: the all-selected oracle equals standard, and
    EPIC and naive relay it in every chunk."""
    k = next(_unique)
    a = generate(small_server.url, chat(tok, f"Writer {k}.", "Describe a lighthouse."), n=150)
    prompt = chat(tok, f"Editor {k}.", f"Draft:\n\n{a['text']}\n\nEdit it.")
    # before standard: its exact KV would make the prompt a full prefix hit
    for method in ("epic", "naive"):  # relay and cacheblend: the test below
        info = generate(small_server.url, prompt, relay=method)["meta_info"]["relay"]
        assert info["fallback"] is None and info["spans_matched"] >= 2, (method, info)
        assert info["reused_tokens"] >= 100, (method, info)
    full = generate(
        small_server.url,
        prompt,
        relay={"method": "relay", "config": ALL_SELECTED},
    )
    relay = full["meta_info"]["relay"]
    assert relay["spans_matched"] >= 2  # one span, cut by the chunks
    assert relay["reused_tokens"] >= 100
    std = generate(small_server.url, prompt, relay="standard")
    assert full["output_ids"] == std["output_ids"]
    _pool_balanced(small_server.url)


def test_spans_over_many_chunks_relay_in_every_chunk_for_every_method(small_server, tok):
    """A 200-token span under 32-token chunks (min_span): middle chunks are span rows only
    (the relay profile starts at layer 3, so no row runs layers 0-2 there), every chunk
    relays (with the last-row probe too: the chunks without the last row say so and run
    the context rule), and recomputing everything still equals standard prefill exactly.
    EPIC and naive: the full-tier test above."""
    url, k = small_server.url, next(_unique)
    a = generate(url, chat(tok, f"Historian {k}.", "Write a long history of bridges."), n=200)
    prompt = chat(tok, f"Editor {k}.", f"Draft:\n\n{a['text']}\n\nShorten it.")
    for method in ("relay", "cacheblend"):
        info = generate(url, prompt, relay=method)["meta_info"]["relay"]
        assert info["fallback"] is None, (method, info)
        assert info["spans_matched"] >= 160 // CHUNK, (method, info)
        assert info["reused_tokens"] >= 160, (method, info)
    # the last-row probe: chunks without the prompt's last row run the context rule
    before = relay_info(url).get("probe_no_last_row", 0)
    probe = generate(url, prompt, relay={"method": "relay", "config": {"probe": 0.25}})
    info = probe["meta_info"]["relay"]
    assert info["fallback"] is None and info["reused_tokens"] >= 160, info
    assert relay_info(url)["probe_no_last_row"] - before >= 160 // CHUNK - 1
    oracle = generate(url, prompt, relay={"method": "relay", "config": ALL_SELECTED})
    assert oracle["meta_info"]["relay"]["reused_tokens"] >= 160
    std = generate(url, prompt, relay="standard")
    assert oracle["output_ids"] == std["output_ids"]
    assert relay_info(url).get("fallback_error", 0) == 0
    _pool_balanced(url)


def test_streamed_relay_reports_one_relay_object_in_every_chunk(small_server, tok):
    """A streamed, relayed, chunked prefill: every chunk's ``meta_info.relay`` is one
    object (SGLang completes later chunks from its accumulated list; the plug-in unwraps
    it), and the last one says what the request reused."""
    import json

    k = next(_unique)
    a = generate(small_server.url, chat(tok, f"Writer {k}.", "Describe a harbour."), n=120)
    prompt = chat(tok, f"Editor {k}.", f"Draft:\n\n{a['text']}\n\nEdit it.")
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 6}}
    infos = []
    with requests.post(small_server.url + "/generate", json=body, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                infos.append(json.loads(line[len(b"data:") :])["meta_info"].get("relay"))
    assert len(infos) >= 2
    assert all(isinstance(info, dict) for info in infos), infos
    assert infos[-1]["spans_matched"] >= 1 and infos[-1]["reused_tokens"] >= 80


def test_relay_and_plain_requests_in_one_batch(small_server, tok):
    k = next(_unique)
    a = generate(small_server.url, chat(tok, f"Poet {k}.", "Write about rivers."), n=120)
    relayed = chat(tok, f"Critic {k}.", f"Poem:\n\n{a['text']}\n\nCritique it.")
    plains = [chat(tok, f"Helper {k}-{i}.", f"Count to {i + 5}.") for i in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, small_server.url, relayed)]
        futures += [pool.submit(generate, small_server.url, p) for p in plains]
        outs = [f.result() for f in futures]
    assert outs[0]["meta_info"]["relay"]["spans_matched"] >= 1
    for p, out in zip(plains, outs[1:], strict=True):
        again = generate(small_server.url, p, relay="standard")
        assert out["output_ids"] == again["output_ids"]
    _pool_balanced(small_server.url)


def test_aborted_relay_requests_leak_nothing(small_server, tok):
    k = next(_unique)
    a = generate(small_server.url, chat(tok, f"Chef {k}.", "Write a recipe."), n=120)
    prompt = chat(tok, f"Taster {k}.", f"Recipe:\n\n{a['text']}\n\nRate it.")
    for _ in range(3):
        with requests.post(
            small_server.url + "/generate",
            json={
                "text": prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            },
            stream=True,
            timeout=120,
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    break  # disconnect mid-generation
    time.sleep(2.0)
    _pool_balanced(small_server.url)
    assert healthy(small_server.url)


@pytest.mark.full  # load with faults: the trust fuzz and the abort test in CI
def test_soak_ci_variant(small_server, tok):
    """``bench load``'s soak, short: 6 concurrent chains for 30 s (salted, keyed and
    opted-out chains, aborts, disconnects, malformed options) in a pool too small for
    them, so spans are evicted mid-chain. Nothing fails that the client did not cause,
    nothing is relayed into a namespace that stored nothing, every fallback has a known
    reason, relays happen, side memory stays flat, no slot leaks."""
    from sglang_relay.bench.load import run_load

    out = run_load(
        small_server.url, tok, 6, 30.0, seed=3, window=15.0, pid=small_server.proc.pid,
        sample_every=5.0,
    )  # fmt: skip
    assert out["errors"] == 0, out["error_samples"]
    assert out["wrong_namespace_relays"] == 0
    assert out["leaked_slots"] == 0 and out["healthy_after"], out["pool_after"]
    known = {"bad_options", "span_evicted", "trimmed", "unrelated_match"}
    assert set(out["fallbacks"]) <= known, out["fallbacks"]
    # few chains finish in 30 s on a slow machine: that relays happen is what is checked
    # here; that the hit rate does not decay is the 30-minute soak's (docs/results.md)
    assert out["requests_relayed"] >= 1, out["windows"]
    side = {m["side_mb"] for m in out["memory_samples"]}
    assert len(side) == 1, side  # the side ledger is sized once, never grows
    assert max(m["span_tokens"] for m in out["memory_samples"]) <= 1200  # --relay-span-tokens


def test_a_prompt_pasting_an_evicted_span_is_told_so(small_server, tok):
    """An output whose span the budget dropped for room relays nothing; its prompt says
    why (``span_evicted``, counted), unlike a prompt that pastes nothing."""
    url, k = small_server.url, next(_unique)
    a = generate(url, chat(tok, f"Writer {k}.", "Describe a lighthouse in detail."), n=150)
    fillers = [chat(tok, f"Writer {k}-{i}.", f"Describe harbour number {i}.") for i in range(10)]
    with cf.ThreadPoolExecutor(10) as pool:  # 1,500 more tokens recorded, decoded as a batch:
        list(pool.map(lambda p: generate(url, p, n=150), fillers))  # the first span is dropped
    prompt = chat(tok, f"Editor {k}.", f"Draft:\n\n{a['text']}\n\nEdit it.")
    info = generate(url, prompt)["meta_info"]["relay"]
    assert info["reused_tokens"] == 0 and info["fallback"].startswith("span_evicted"), info
    assert relay_info(url)["fallback_span_evicted"] >= 1
    plain = generate(url, chat(tok, f"Poet {k}.", "Write a haiku about rain."))
    assert plain["meta_info"]["relay"]["fallback"] is None  # pastes nothing: nothing to say
