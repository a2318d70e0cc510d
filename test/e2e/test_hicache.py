"""A relay server with SGLang's HiCache (``--enable-hierarchical-cache``, write_through):
the tree's host tier backs up what it inserts and loads it back into device slots when a
prompt's prefix was pushed off the device. On this CPU SGLang's own host pool, cache
controller and transfer engine run, with the stand-in's unpinned allocation and torch row
copy (``SGLANG_RELAY_CPU_HICACHE=1``, ``runtime/standin/cpu.py``).

A prefix loaded back from host gives what prefilling it gives; every load-back stamps the
slots it writes (the relay counter says how many), so relay never reads loaded KV as a
span's; and relay through a HiCache server computes what the reference executor computes,
also after load-backs reused the device slots. Relay's own host tier keeps each recorded
span's KV and side rows: a span whose device slots were reused comes back from host when
a prompt pastes it, and relays as if it had never left."""

from __future__ import annotations

import math

import pytest
from relay_helpers import (
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
    server_fixture,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

DEVICE_TOKENS = 2048
HICACHE = [
    "--enable-hierarchical-cache",
    "--hicache-write-policy", "write_through",
    "--hicache-io-backend", "direct",  # the CPU stand-in's copy (runtime/standin/cpu.py)
    "--hicache-mem-layout", "layer_first",
    "--hicache-ratio", "4",  # host tier: 4x the device pool
]  # fmt: skip
PREFIX = list(range(6000, 6600))  # 600 tokens


hicache_server = server_fixture(
    *HICACHE, kv_tokens=DEVICE_TOKENS, env={"SGLANG_RELAY_CPU_HICACHE": "1"}
)


def _push_off_device(url: str, salt: int) -> None:
    """Unrelated 600-token prompts, 2.6x the device pool: the tree evicts what it held
    before (write_through: its host copy stays)."""
    for i in range(9):
        start = 20000 + 1000 * (9 * salt + i)
        generate_ids(url, list(range(start, start + 600)), 2)


def _host_loaded(url: str) -> int:
    info = relay_info(url)
    return int(info.get("counters", info).get("host_loaded_slots", 0))


def test_a_prefix_loaded_back_from_host_gives_what_its_prefill_gives(hicache_server):
    url = hicache_server.url
    assert relay_info(url)["hicache"] is True
    first = generate_ids(url, PREFIX, 6, return_logprob=True)
    assert first["meta_info"]["cached_tokens"] == 0
    loaded_before = _host_loaded(url)
    _push_off_device(url, salt=0)
    again = generate_ids(url, PREFIX, 6, return_logprob=True)
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] >= 512, details  # the prefix came back from host memory
    assert again["output_ids"] == first["output_ids"]
    got = [x[0] for x in again["meta_info"]["output_token_logprobs"]]
    want = [x[0] for x in first["meta_info"]["output_token_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, want, strict=True))
    # every slot the load-back wrote was stamped before it was written
    assert _host_loaded(url) - loaded_before >= details["host"]


def test_relay_through_a_hicache_server_computes_what_the_reference_computes(
    hicache_server, model_dir
):
    url = hicache_server.url
    ref = R.load_model(str(model_dir))
    cfg = settings_from_env(str(model_dir), {}).config
    served, result, span = relay_one_upstream(url, ref, cfg)
    assert_matches_reference(served, result)

    # the device slots turn over: fillers push the tree's nodes to host, then a prefix
    # comes back into freed slots by a host copy, not a forward
    generate_ids(url, PREFIX, 2)
    _push_off_device(url, salt=1)
    loaded_before = _host_loaded(url)
    back = generate_ids(url, PREFIX, 2)
    assert back["meta_info"]["cached_tokens_details"]["host"] > 0
    assert _host_loaded(url) > loaded_before

    # a fresh upstream relays exactly again on the turned-over pool
    served, result, span = relay_one_upstream(url, ref, cfg)
    assert_matches_reference(served, result)


def test_a_span_pushed_off_the_device_comes_back_from_the_relay_host_tier(
    hicache_server, model_dir
):
    url = hicache_server.url
    ref = R.load_model(str(model_dir))
    cfg = settings_from_env(str(model_dir), {}).config
    up_ids = list(range(1100, 1140))  # not relay_one_upstream's: a span of its own
    upstream = generate_ids(url, up_ids, 96)
    record = R.generate(ref, [up_ids], len(upstream["output_ids"]))[0]
    assert record.output == upstream["output_ids"]
    span = record.span_tokens
    before = relay_info(url)
    assert before["host_capacity_tokens"] > 0 and before["host_spans"] >= 1
    _push_off_device(url, salt=2)  # the tree evicts the upstream; its slots are reused
    head, tail = list(range(2100, 2123)), list(range(3100, 3111))
    prompt = head + span + tail
    served = generate_ids(url, prompt, 4, return_logprob=True, top_logprobs_num=5)
    info = served["meta_info"]["relay"]
    after = relay_info(url)
    assert after["host_restores"] == before.get("host_restores", 0) + 1, after
    assert info["fallback"] is None and info["reused_tokens"] == len(span), info
    # the KV came back exactly: the relay is the reference executor's on the same prompt
    occ = R.SpanOccurrence(len(head), record, 0, len(span))
    assert_matches_reference(served, R.relay_prefill(ref, prompt, [occ], cfg))


@pytest.mark.full  # a tp-2 server; the CI tier proves the copy back at tp 1 (above)
def test_under_tp2_a_span_comes_back_from_host_on_both_ranks(model_dir, tmp_path):
    """Two ranks over gloo, each with its own host tier: the copy back runs only when both
    hold the span (a MIN over the ranks, counted as ``tp_restore_checks``), both ranks then
    plan the same relay, and it computes what the reference executor computes. A small
    random Llama (8 heads; the embedded model's 9 do not split over 2 ranks)."""
    import json

    from relay_helpers import CONTEXT_RULE_AT_2

    from sglang_relay.bench.models import random_llama

    path = random_llama(tmp_path / "RandomLlama-hicache", model_dir)
    env = {"SGLANG_RELAY_CPU_HICACHE": "1", "SGLANG_RELAY_CONFIG": json.dumps(CONTEXT_RULE_AT_2)}
    settings = settings_from_env(str(path), env)
    args = ["--model-path", str(path), "--tp", "2", "--max-total-tokens", str(DEVICE_TOKENS)]
    with running_server([*args, *HICACHE], env=env) as server:
        url = server.url
        ref = R.load_model(str(path))
        cfg = settings.point(settings.reuse_target, ref.num_layers).config
        up_ids = list(range(1100, 1140))
        upstream = generate_ids(url, up_ids, 96)
        record = R.generate(ref, [up_ids], len(upstream["output_ids"]))[0]
        assert record.output == upstream["output_ids"]
        span = record.span_tokens
        _push_off_device(url, salt=0)  # a server of its own
        head, tail = list(range(2100, 2123)), list(range(3100, 3111))
        prompt = head + span + tail
        served = generate_ids(url, prompt, 4, return_logprob=True, top_logprobs_num=5)
        info = relay_info(url)
        assert info["tp_size"] == 2 and info["host_restores"] == 1, info
        assert info["tp_restore_checks"] >= 1 and info.get("tp_restore_mismatches", 0) == 0
        assert info.get("tp_plan_mismatches", 0) == 0
        assert served["meta_info"]["relay"]["reused_tokens"] == len(span)
        occ = R.SpanOccurrence(len(head), record, 0, len(span))
        assert_matches_reference(served, R.relay_prefill(ref, prompt, [occ], cfg))
