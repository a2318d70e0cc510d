"""Relay end to end on the real server: hits, exactness oracles, safety, users' paths."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import requests
from relay_helpers import ALL_SELECTED, chat, first_logprobs, generate, generate_ids, relay_info

from sglang_relay.client import healthy

pytestmark = pytest.mark.e2e

_unique = itertools.count()
NOTHING_RECOMPUTED = {"l_start": 30, "l_det": 30, "l_end": 29}


def _downstream(tok, a) -> str:
    """A downstream prompt pasting upstream output ``a`` that no request sent before: its
    first line is new, so nothing of it is in the prefix cache."""
    k = next(_unique)
    return chat(tok, f"You are developer #{k}.", f"Spec:\n\n{a['text']}\n\nImplement it.")


@pytest.fixture(scope="module")
def shared_upstream(server, tok):
    """One upstream output (>= 100 tokens) for this module: its span stays stored for
    every test here (a 16K-token pool), each pasting it into a prompt of its own (a new
    upstream per test decoded 140 tokens each, ~13 s here)."""
    k = next(_unique)
    a = generate(
        server.url,
        chat(
            tok,
            f"You are architect #{k}.",
            f"Write a numbered design spec for tool {k}: "
            "a function that merges overlapping intervals.",
        ),
        n=140,
    )
    assert a["meta_info"]["completion_tokens"] >= 100
    return a


@pytest.fixture()
def upstream(shared_upstream, tok):
    """The module's upstream output and a fresh downstream prompt embedding it."""
    return shared_upstream, _downstream(tok, shared_upstream)


def test_every_response_reports_relay(server, tok):
    out = generate(server.url, chat(tok, "You are terse.", "Say hi."), n=4)
    relay = out["meta_info"]["relay"]
    assert relay["spans_matched"] == 0 and relay["fallback"] is None


def test_downstream_reuses_the_upstream_output(server, upstream):
    a, prompt = upstream
    out = generate(server.url, prompt)
    relay = out["meta_info"]["relay"]
    assert relay["spans_matched"] >= 1
    # the whole span but edges that re-tokenize differently (and text after an EOS)
    assert relay["reused_tokens"] >= 0.75 * a["meta_info"]["completion_tokens"]
    assert 0.5 < relay["reuse_rate"] < 1.0
    assert relay["fallback"] is None


def test_oracle_everything_recomputed_equals_standard(server, upstream):
    _, prompt = upstream
    full = generate(
        server.url, prompt, relay={"method": "relay", "config": ALL_SELECTED}, logprobs=True
    )
    assert full["meta_info"]["relay"]["reuse_rate"] == 0.0
    assert full["meta_info"]["relay"]["spans_matched"] >= 1
    std = generate(server.url, prompt, relay="standard", logprobs=True)
    a, b = first_logprobs(full), first_logprobs(std)
    assert a.keys() == b.keys()
    for tid in a:
        assert a[tid] == pytest.approx(b[tid], abs=2e-4)
    assert full["output_ids"] == std["output_ids"]


def test_oracle_no_recompute_equals_naive(server, upstream):
    _, prompt = upstream
    naive = generate(server.url, prompt, relay="naive", logprobs=True)
    none = generate(
        server.url, prompt, relay={"method": "relay", "config": NOTHING_RECOMPUTED}, logprobs=True
    )
    assert naive["meta_info"]["relay"]["reuse_rate"] == 1.0
    a, b = first_logprobs(naive), first_logprobs(none)
    assert a.keys() == b.keys()
    for tid in a:
        assert a[tid] == pytest.approx(b[tid], abs=1e-5)


def test_exact_prefix_hits_never_return_relayed_kv(server, tok, upstream):
    _, prompt = upstream
    relayed = generate(server.url, prompt)
    span_start = (
        relayed["meta_info"]["prompt_tokens"] - relayed["meta_info"]["relay"]["reused_tokens"]
    )
    again = generate(server.url, prompt, relay="standard")
    # the prefix cache may serve the prompt up to the span, never the relayed span itself
    assert again["meta_info"]["cached_tokens"] < span_start


def test_namespaces_never_share_spans(server, tok):
    k = next(_unique)
    a = generate(
        server.url,
        chat(tok, f"Planner {k}.", "List ten steps to bake bread."),
        n=120,
        cache_salt="tenant-a",
    )
    prompt = chat(tok, f"Critic {k}.", f"Steps:\n\n{a['text']}\n\nCritique them.")
    other = generate(server.url, prompt, cache_salt="tenant-b")
    assert other["meta_info"]["relay"]["spans_matched"] == 0
    same = generate(server.url, prompt, cache_salt="tenant-a")
    assert same["meta_info"]["relay"]["spans_matched"] >= 1


@pytest.mark.parametrize(
    "bad",
    [
        42,
        {"method": "warp"},
        {"config": {"l_start": 99}},
        {"config": {"tau_dev": -1}},
        {"weird": 1},
    ],
)
def test_malformed_options_are_refused_with_400(server, upstream, bad):
    _, prompt = upstream
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 4, "custom_params": {"relay": bad}},
    }
    resp = requests.post(server.url + "/generate", json=body, timeout=300)
    assert resp.status_code == 400, resp.text[:300]
    assert "custom_params.relay" in resp.json()["error"]["message"]
    assert healthy(server.url)


def test_chain_of_three_reuses_both_upstream_outputs(server, tok):
    k = next(_unique)
    a = generate(server.url, chat(tok, f"Architect {k}.", "Spec a stack class in Python."), n=120)
    b = generate(
        server.url, chat(tok, f"Developer {k}.", f"Spec:\n\n{a['text']}\n\nCode it."), n=120
    )
    assert b["meta_info"]["relay"]["spans_matched"] >= 1
    c = generate(
        server.url,
        chat(tok, f"Reviewer {k}.", f"Spec:\n\n{a['text']}\n\nCode:\n\n{b['text']}\n\nReview."),
    )
    assert c["meta_info"]["relay"]["spans_matched"] >= 2
    assert c["meta_info"]["relay"]["reused_tokens"] >= 200


def test_frontend_program_gets_relay_hits(server):
    import sglang as sgl

    k = next(_unique)

    @sgl.function
    def architect(s, task):
        s += sgl.system(f"You are architect {k}.")
        s += sgl.user(task)
        s += sgl.assistant(sgl.gen("spec", max_tokens=120, temperature=0))

    @sgl.function
    def developer(s, spec):
        s += sgl.system(f"You are developer {k}.")
        s += sgl.user("Here is the spec:\n\n" + spec + "\n\nImplement it in Python.")
        s += sgl.assistant(sgl.gen("code", max_tokens=8, temperature=0))

    backend = sgl.RuntimeEndpoint(server.url)
    spec = architect.run(task="Design a queue with two stacks.", backend=backend)["spec"]
    state = developer.run(spec=spec, backend=backend)
    relay = state.get_meta_info("code")["relay"]
    assert relay["spans_matched"] >= 1 and relay["reused_tokens"] >= 80

    # the method chosen on the client side, per program
    from sglang_relay.frontend import RelayEndpoint

    full = {"method": "relay", "config": ALL_SELECTED}
    exact = developer.run(spec=spec, backend=RelayEndpoint(server.url, relay=full))
    assert exact.get_meta_info("code")["relay"]["spans_matched"] >= 1
    # standard last: it inserts the whole prompt into the radix tree
    std = developer.run(spec=spec, backend=RelayEndpoint(server.url, relay="standard"))
    assert std.get_meta_info("code")["relay"]["method"] == "standard"
    assert std.get_meta_info("code")["relay"]["reused_tokens"] == 0
    assert exact["code"] == std["code"]


def test_openai_chain_gets_relay_hits(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    k = next(_unique)
    first = (
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"({k}) Explain binary search in detail."}],
            max_tokens=120,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    before = relay_info(server.url).get("relayed_tokens", 0)
    client.chat.completions.create(
        model="default",
        messages=[
            {"role": "system", "content": f"Reviewer {k}."},
            {"role": "user", "content": f"Check this explanation:\n\n{first}\n\nIs it right?"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert relay_info(server.url).get("relayed_tokens", 0) >= before + 80


def test_no_leaked_slots_when_idle(server):
    time.sleep(1.0)
    pool = relay_info(server.url)["pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"], pool


def test_prometheus_counters(server, upstream):
    _, prompt = upstream
    assert generate(server.url, prompt)["meta_info"]["relay"]["spans_matched"] >= 1
    text = requests.get(server.url + "/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("sglang_relay:events_total")]
    counts = {line.split('event="')[1].split('"')[0]: float(line.split()[-1]) for line in lines}
    assert counts.get("relay_extends", 0) >= 1 and counts.get("relayed_tokens", 0) >= 80, lines


def test_a_short_run_of_an_output_is_not_relayed_but_the_whole_output_is(server):
    """Relatedness: a 40-token run from the middle of a 160-token output (25 % of it, a
    shared idiom or boilerplate) is not relayed: standard prefill, said and counted, the
    same tokens and logprobs as a standard request. The whole output pasted is relayed."""
    k = next(_unique)
    up = generate_ids(server.url, [500 + k, *range(1000, 1039)], 160)["output_ids"]
    head, tail = [600 + k, *range(2001, 2023)], list(range(3000, 3011))
    before = relay_info(server.url).get("unrelated_matches", 0)

    quoted = head + up[60:100] + tail
    got = generate_ids(server.url, quoted, 4, return_logprob=True, top_logprobs_num=5)
    info = got["meta_info"]["relay"]
    assert info["fallback"] == "unrelated_match" and info["reused_tokens"] == 0, info
    # the same prompt, standard prefill, under its own cache salt: no prefix of ``quoted``
    # in the tree serves it (the same tokens, so the same answer is owed exactly)
    want = generate_ids(
        server.url,
        quoted,
        4,
        "standard",
        return_logprob=True,
        top_logprobs_num=5,
        cache_salt=f"reference-{k}",
    )
    assert want["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == want["output_ids"]
    assert relay_info(server.url)["unrelated_matches"] >= before + 1

    pasted = generate_ids(server.url, [800 + k, *head[1:], *up, *tail], 4)
    info = pasted["meta_info"]["relay"]
    assert info["fallback"] is None and info["reused_tokens"] >= 150, info


def test_guard_redoes_a_relayed_reply_that_stops_at_once(server, upstream):
    """The early-stop guard (runtime/sched/guard.py): a relayed reply that ends by a stop
    condition within its first 4 tokens is answered again with standard prefill. Made
    deterministic with a stop token: the relayed greedy reply's second token."""
    _, prompt = upstream
    full = generate(server.url, prompt, n=12)  # long enough: not guarded
    assert full["meta_info"]["relay"]["reused_tokens"] > 0
    assert "guard" not in full["meta_info"]["relay"]
    assert full["meta_info"]["relay"]["ttft_s"] > 0  # the server's measure
    stop = {"stop_token_ids": [full["output_ids"][1]]}
    before = relay_info(server.url)

    def run(relay=None, n=1, **extra):
        params = {"max_new_tokens": 12, "temperature": 0, **stop}
        if n > 1:
            params["n"] = n
        if relay is not None:
            params["custom_params"] = {"relay": relay}
        body = {"text": prompt, "sampling_params": params, **extra}
        resp = requests.post(server.url + "/generate", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    guarded = run()
    info = guarded["meta_info"]["relay"]
    assert info["guard"]["reprefilled"] is True, info
    assert info["guard"]["relayed"]["reused_tokens"] > 0
    assert "stopped after" in info["guard"]["reason"]
    assert info["reused_tokens"] == 0 and info["method"] == "standard"
    assert info["ttft_s"] > info["guard"]["relayed"]["ttft_s"]  # the redo is in it
    want = run("standard")
    assert guarded["output_ids"] == want["output_ids"] and guarded["text"] == want["text"]
    after = relay_info(server.url)
    assert after["guard_reprefills"] == before["guard_reprefills"] + 1
    assert after["guard_relayed_tokens_redone"] > before["guard_relayed_tokens_redone"]
    # n > 1: each sample is guarded on its own and its redo is one sample
    both = run(n=2)
    assert isinstance(both, list) and len(both) == 2, both
    for sample in both:
        assert sample["output_ids"] == want["output_ids"]
        guard = sample["meta_info"]["relay"].get("guard")
        assert guard is None or guard["reprefilled"] is True
        if guard is not None:
            assert guard["first_attempt"]["completion_tokens"] <= 4
    # streams are not held back by default: the relayed reply comes as it is
    resp = requests.post(
        server.url + "/generate",
        json={"text": prompt, "stream": True,
              "sampling_params": {"max_new_tokens": 12, "temperature": 0, **stop}},
        stream=True, timeout=300,
    )  # fmt: skip
    chunks = [ln for ln in resp.iter_lines() if ln.startswith(b"data:") and b"[DONE]" not in ln]
    last = json.loads(chunks[-1][5:])
    assert "guard" not in (last["meta_info"]["relay"] or {}), last["meta_info"]
    assert last["output_ids"] == full["output_ids"][: len(last["output_ids"])]
    assert len(last["output_ids"]) <= 2
