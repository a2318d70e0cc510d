"""Plain traffic on a relay server runs SGLang's own model forward, untouched.

A relay server whose profile stores hidden states (the shipped profile: ``l_start`` 3)
keeps every decoded token's residual stream by a hook inside SGLang's forward, not by a
layer loop of its own. So plain requests get exactly what a ``--no-relay`` server with the
same flags gives: the same tokens and the same logprobs, bit for bit (requests sent one at
a time, so both servers run the same batches). Checked in eager mode, with decode graphs
and mixed chunks (CPU graph runner), and under ``--tp 2`` (full tier). The stored states
are then used: a downstream prompt pasting a plain output relays it whole, nothing
trimmed, and relay's stats show that every plain forward passed the hook.
"""

from __future__ import annotations

import json
import time

import pytest
from relay_helpers import (
    E2E_KV_TOKENS,
    GRAPH_ARGS,
    chat,
    generate,
    generate_ids,
    relay_info,
    running_server,
    server_fixture,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

TOPICS = ["rivers", "compilers", "bread", "volcanoes", "chess", "tides"]


def _plain_outputs(url: str, prompts: list) -> list[dict]:
    """Greedy generations with logprobs, one request in flight at a time."""
    outs = []
    for p in prompts:
        if isinstance(p, str):
            outs.append(generate(url, p, 40, None, True))
        else:
            outs.append(generate_ids(url, p, 40, return_logprob=True, top_logprobs_num=5))
    return outs


def _assert_bit_identical(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gm, wm = g["meta_info"], w["meta_info"]
        # exact float equality: the same forward, not an approximation of it
        assert gm["output_token_logprobs"] == wm["output_token_logprobs"]
        assert gm["output_top_logprobs"] == wm["output_top_logprobs"]


def _assert_stored_and_relayed(url: str, src: dict, paste) -> None:
    """A plain output (``src``), pasted into the next prompt, relays whole from the hidden
    states the hook stored (nothing trimmed for want of a stored state)."""
    stats = relay_info(url)
    assert stats["capture_layer"] is not None and stats["disabled"] is None, stats
    down = paste(src)
    info = down["meta_info"]["relay"]
    assert info["fallback"] is None, info
    assert info["trimmed_tokens"] == 0, info
    assert info["reused_tokens"] >= 0.75 * len(src["output_ids"]), info


def _chat_prompts(tok) -> list[str]:
    return [chat(tok, "You are concise.", f"Explain {t} in three sentences.") for t in TOPICS]


def _paste_chat(url, tok):
    def paste(src):
        prompt = chat(tok, "Critic.", f"Draft:\n\n{src['text']}\n\nCritique it.")
        return generate(url, prompt, 4)

    return paste


# a --no-relay server with the session relay server's flags
plain_server = server_fixture("--enable-metrics", "--no-relay", kv_tokens=E2E_KV_TOKENS)


def test_plain_requests_equal_a_no_relay_server_bit_for_bit(server, plain_server, tok):
    """Eager: the session's relay server (hidden states at layer 3) against --no-relay."""
    prompts = _chat_prompts(tok)
    before = relay_info(server.url)
    got = _plain_outputs(server.url, prompts)
    after = relay_info(server.url)
    assert after.get("relay_extends", 0) == before.get("relay_extends", 0)  # all plain
    assert after["forwards_decode"] > before.get("forwards_decode", 0)
    want = _plain_outputs(plain_server.url, prompts)
    _assert_bit_identical(got, want)
    src = generate(server.url, chat(tok, "Writer.", "Describe a harbour at dawn."), 120)
    _assert_stored_and_relayed(server.url, src, _paste_chat(server.url, tok))


# full tier: two compiling servers. In CI test_tp.py checks graph decode (hidden states
# stored inside the graph) against the reference, and test_pages.py runs mixed chunks.
@pytest.mark.full
def test_plain_requests_with_graph_decode_and_mixed_chunks_equal_no_relay(model_dir, tok):
    """Decode forwards replay graphs captured with relay's hook traced in (CPU graph
    runner); mixed chunks on. Plain outputs are still SGLang's, bit for bit; then an
    output decoded partly in mixed batches (prefills joined by its decode rows) relays
    whole: those rows' states were stored too."""
    import concurrent.futures as cf

    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192", *GRAPH_ARGS]
    args += ["--enable-mixed-chunk", "--chunked-prefill-size", "64"]
    prompts = _chat_prompts(tok)[:4]
    with running_server([*args, "--no-relay"]) as plain:
        want = _plain_outputs(plain.url, prompts)
    with running_server(args) as server:
        info = relay_info(server.url)
        assert info["cuda_graphs"]["decode"] is True and info["capture_in_graph"] is True
        got = _plain_outputs(server.url, prompts)
        assert relay_info(server.url)["graph_forwards_decode"] >= 100
        _assert_bit_identical(got, want)
        # a long decode while other prompts prefill in chunks of 64: mixed batches
        with cf.ThreadPoolExecutor(4) as pool:
            up = pool.submit(generate, server.url, chat(tok, "Writer.", "Tell a long story."), 160)
            time.sleep(2.0)  # the story decodes while these prefill
            others = [
                pool.submit(generate, server.url, chat(tok, f"Helper {i}.", "Go on. " * 60), 4)
                for i in range(3)
            ]
            a = up.result()
            [f.result() for f in others]
        stats = relay_info(server.url)
        # mixing really happened (SGLang 0.5.23 runs a mixed batch as an EXTEND forward)
        assert stats.get("mixed_batches", 0) > 0, stats
        _assert_stored_and_relayed(server.url, a, _paste_chat(server.url, tok))


@pytest.mark.full  # two tp-2 servers; test_tp.py's CI case checks graph decode under tp 2
def test_plain_requests_under_tp2_equal_no_relay(model_dir, tmp_path):
    """Two ranks over gloo: the residual the hook copies is complete on each rank after
    SGLang's all-reduce; plain outputs are SGLang's bit for bit. Random 8-head Llama."""
    from relay_helpers import CONTEXT_RULE_AT_2

    from sglang_relay.bench.models import random_llama

    path = random_llama(tmp_path / "RandomLlama-tp", model_dir)
    env = {"SGLANG_RELAY_CONFIG": json.dumps(CONTEXT_RULE_AT_2)}
    args = ["--model-path", str(path), "--tp", "2", "--max-total-tokens", "8192"]
    prompts = [list(range(1100 + 9 * i, 1140 + 9 * i)) for i in range(3)]
    with running_server([*args, "--no-relay"]) as plain:
        want = _plain_outputs(plain.url, prompts)
    with running_server(args, env=env) as server:
        assert relay_info(server.url)["tp_size"] == 2
        got = _plain_outputs(server.url, prompts)
        _assert_bit_identical(got, want)

        def paste(src):
            ids = list(range(2100, 2117)) + src["output_ids"] + list(range(3000, 3011))
            return generate_ids(server.url, ids, 2)

        _assert_stored_and_relayed(server.url, generate_ids(server.url, prompts[0][:30], 96), paste)


def _long_upstream(url, tok, k, n=520):
    return generate(url, chat(tok, f"Historian {k}.", "Write a long history of bridges."), n=n)


def test_plain_requests_batched_with_relays_get_plain_sglangs_output(server, plain_server, tok):
    """Plain requests that arrive together with a relaying one never share its prefill
    batch: they run SGLang's own forward and get what a --no-relay server gives. (The
    relay side runs on the session's server, the reference on a plain one.)"""
    import concurrent.futures as cf

    plains = [
        chat(tok, f"Helper {i}.", f"List {i + 3} fruits and their colours.") for i in range(3)
    ]
    a = _long_upstream(server.url, tok, "plain", 160)
    relayed = chat(tok, "Critic.", f"History:\n\n{a['text']}\n\nCritique it.")
    blocker = chat(tok, "Reader.", "Read this. " * 600)  # a long prefill: the rest queues
    before = relay_info(server.url).get("batches_split", 0)
    with cf.ThreadPoolExecutor(5) as pool:
        busy = pool.submit(generate, server.url, blocker, 4)
        time.sleep(0.5)
        futures = [pool.submit(generate, server.url, relayed, 24, None, True)]
        futures += [pool.submit(generate, server.url, p, 24, None, True) for p in plains]
        outs = [f.result() for f in futures]
        busy.result()
    assert outs[0]["meta_info"]["relay"]["reused_tokens"] >= 100
    stats = relay_info(server.url)
    assert stats.get("batches_split", 0) > before, stats  # they did arrive together
    with cf.ThreadPoolExecutor(3) as pool:
        ref = list(pool.map(lambda p: generate(plain_server.url, p, 24, None, True), plains))
    for got, want in zip(outs[1:], ref, strict=True):
        assert got["output_ids"] == want["output_ids"]
        lp_got = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        lp_want = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
        # batch composition alone moves stock SGLang's logprobs in the last float bits
        assert lp_got == pytest.approx(lp_want, abs=1e-4)
