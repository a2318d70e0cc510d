"""Who may reuse whose spans (``--relay-scope``, relay keys, opting out), on real servers.

The oracle is the test's own bookkeeping: a downstream request can relay exactly when an
earlier upstream request that stores spans ran in the same namespace (salt, relay key); the
server's per-request ``meta_info.relay`` must agree on every request of a random schedule."""

from __future__ import annotations

import random

import pytest
from relay_helpers import generate_ids, relay_info, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.model]

UP_IDS = list(range(1000, 1040))  # every upstream asks the same, so outputs are identical


def _up(url, salt, relay):
    extra = {"cache_salt": salt} if salt else {}
    return generate_ids(url, UP_IDS, 64, relay, **extra)["output_ids"]


def _down(url, span, salt, relay, tag):
    prompt = [2000 + tag, *range(2001, 2020), *span, *range(3000, 3009)]
    extra = {"cache_salt": salt} if salt else {}
    return generate_ids(url, prompt, 4, relay, return_logprob=True, **extra)


def test_key_scope_fuzz_never_crosses_namespaces(model_dir):
    """Scope ``key``: 40 random requests over (cache_salt, relay key, opt-out) choices; a
    request without salt or key neither stores nor reuses; nothing crosses namespaces."""
    args = ["--model-path", str(model_dir), "--max-total-tokens", "16384"]
    with running_server(args, env={"SGLANG_RELAY_SCOPE": "key"}) as server:
        assert relay_info(server.url)["scope"] == "key"
        rng = random.Random(7)
        salts, keys = [None, "s1", "s2"], [None, "k1", "k2"]
        stored: set[tuple] = set()  # namespaces an upstream stored a span in
        span = None
        for i in range(40):
            salt, key = rng.choice(salts), rng.choice(keys)
            opt_out = rng.random() < 0.25
            relay: dict = {"key": key} if key else {}
            if opt_out:
                relay["method"] = "off"
            ns = (salt, key) if (salt or key) else None
            if rng.random() < 0.5:  # an upstream agent
                out = _up(server.url, salt, relay or None)
                span = out[:-1]
                if ns is not None and not opt_out:
                    stored.add(ns)
                continue
            if span is None:
                continue
            info = _down(server.url, span, salt, relay or None, i)["meta_info"]["relay"]
            want = ns is not None and not opt_out and ns in stored
            assert (info["reused_tokens"] > 0) == want, (i, salt, key, opt_out, info, stored)
            if ns is None and not opt_out:
                assert info["fallback"] == "no_relay_key"
        counters = relay_info(server.url)
        assert counters["unstored_outputs"] > 0 and counters["fallbacks"] > 0


def test_opt_out_stores_nothing_unless_asked_and_scopes_are_isolated(server):
    """Default scope: an opted-out upstream stores no span (unless ``store: true``), and a
    request's relayed output is bit-identical whether or not another namespace stored the
    same text."""
    url = server.url
    out = _up(url, "optout", "off")
    assert _down(url, out[:-1], "optout", None, 1)["meta_info"]["relay"]["reused_tokens"] == 0
    out = _up(url, "optout", {"method": "off", "store": True})
    assert _down(url, out[:-1], "optout", None, 2)["meta_info"]["relay"]["reused_tokens"] > 0

    out = _up(url, None, {"key": "team-a"})
    _down(url, out[:-1], None, {"key": "team-a"}, 3)  # warm the prompt's exact prefix
    first = _down(url, out[:-1], None, {"key": "team-a"}, 3)
    assert first["meta_info"]["relay"]["reused_tokens"] > 0
    # team b stored nothing yet (another prompt: a plain prefill of this one would put its
    # exact KV in SGLang's radix tree, which relay keys do not partition; cache_salt does)
    assert (
        _down(url, out[:-1], None, {"key": "team-b"}, 4)["meta_info"]["relay"]["reused_tokens"] == 0
    )
    _up(url, None, {"key": "team-b"})  # now team b stores the same text
    again = _down(url, out[:-1], None, {"key": "team-a"}, 3)
    assert again["meta_info"]["relay"] == first["meta_info"]["relay"]
    assert again["output_ids"] == first["output_ids"]
    lp = [x[0] for x in again["meta_info"]["output_token_logprobs"]]
    assert lp == [x[0] for x in first["meta_info"]["output_token_logprobs"]]
