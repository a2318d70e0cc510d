"""Span shipping between two relay servers (``runtime/scale/ship``): an upstream agent's output
decoded on one server relays into the next agent's prompt on another, its KV pages pulled
from the first server's relay host tier by Mooncake's transfer engine over TCP on loopback,
its side rows sent with the offer.

First between two ordinary relay servers (a publisher with ``--relay-ship-to``, a receiver
with ``--relay-ship-listen``), then as SGLang's prefill/decode disaggregation runs it: the
upstream is prefilled on the prefill server and decoded on the decode server, which
publishes the span; the downstream prompt is prefilled, relaying it, on the prefill server.
Each relay equals the reference executor's relay of the same prompt, computed from the
upstream's own greedy decode."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import random

import pytest
import requests
from relay_helpers import assert_matches_reference, generate_ids, relay_info, running_server

from sglang_relay.core import reference as R
from sglang_relay.process import free_port
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

# the relay host tier on a CPU copies with the direct backend (runtime/standin/cpu.py)
TIER = ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
UP_IDS = list(range(1100, 1140))
HEAD, TAIL = list(range(2100, 2123)), list(range(3100, 3111))


def _downstream(ref, upstream_ids: list[int]):
    record = R.generate(ref, [UP_IDS], len(upstream_ids))[0]
    assert record.output == upstream_ids  # the same span on both sides
    span = record.span_tokens
    occ = R.SpanOccurrence(len(HEAD), record, 0, len(span))
    return HEAD + span + TAIL, span, occ


def test_a_span_decoded_on_one_server_relays_on_another(model_dir):
    model = str(model_dir)
    port = free_port()
    args = ["--model-path", model, "--max-total-tokens", "4096", *TIER]
    receiver_args = [*args, "--relay-ship-listen", f"127.0.0.1:{port}",
                     "--relay-ship-publishers", "decode-0=*"]  # fmt: skip
    publisher_args = [*args, "--relay-ship-to", f"127.0.0.1:{port}",
                      "--relay-ship-name", "decode-0"]  # fmt: skip
    # started together: a publisher may come up before its receiver (it says hello later)
    with both_servers(publisher_args, receiver_args) as (publisher, receiver):
        upstream = generate_ids(publisher.url, UP_IDS, 96)
        pub = relay_info(publisher.url)
        assert pub["ship_role"] == "publisher" and pub["ship_offers"] == 1, pub
        ref = R.load_model(model)
        cfg = settings_from_env(model, {}).config
        prompt, span, occ = _downstream(ref, upstream["output_ids"])
        served = generate_ids(receiver.url, prompt, 4, return_logprob=True, top_logprobs_num=5)
        info = served["meta_info"]["relay"]
        got = relay_info(receiver.url)
        assert got["ship_received_spans"] == 1 and got["host_restores"] == 1, got
        assert info["fallback"] is None and info["reused_tokens"] == len(span), info
        # the pulled KV and side rows relay as the reference executor's own span
        assert_matches_reference(served, R.relay_prefill(ref, prompt, [occ], cfg))
        # the publisher reads acks when its scheduler next matches a prompt: its staging
        # pages are free again
        generate_ids(publisher.url, [7, 8, 9], 1)
        pub = relay_info(publisher.url)
        assert pub["ship_acks_taken"] == 1, pub
        assert pub["ship_staging_free"] == pub["ship_staging_tokens"], pub


@contextlib.contextmanager
def both_servers(first: list[str], second: list[str], env=None):
    """Two servers started at once (each as ``running_server`` does)."""
    with contextlib.ExitStack() as stack, cf.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(stack.enter_context, running_server(a, env=env))
                for a in (first, second)]  # fmt: skip
        yield tuple(j.result() for j in jobs)


def _pd(prefill, decode, bootstrap: int, body: dict) -> tuple[dict, dict]:
    """One request through a prefill/decode pair, as sglang-router's PD mode sends it."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
            "bootstrap_room": random.randrange(1, 2**62)}  # fmt: skip
    with cf.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(requests.post, s.url + "/generate", json=body, timeout=300)
                for s in (prefill, decode)]  # fmt: skip
        p, d = (j.result() for j in jobs)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    return p.json(), d.json()


@pytest.mark.full  # two more servers; the CI tier ships between two servers above
def test_under_pd_disaggregation_the_prefill_server_relays_what_the_decode_server_decoded(
    model_dir,
):
    model = str(model_dir)
    ship, bootstrap = free_port(), free_port()
    common = ["--model-path", model, "--max-total-tokens", "4096", *TIER,
              "--disaggregation-transfer-backend", "mooncake_tcp",
              "--disable-overlap-schedule"]  # fmt: skip
    env = {"SGLANG_HOST_IP": "127.0.0.1"}
    prefill_args = [*common, "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(bootstrap),
                    "--relay-ship-listen", f"127.0.0.1:{ship}",
                    "--relay-ship-publishers", "decode-0=*"]  # fmt: skip
    decode_args = [*common, "--disaggregation-mode", "decode",
                   "--disaggregation-decode-enable-radix-cache",
                   "--disaggregation-decode-retraction-backup", "cpu_tensor",
                   "--relay-ship-to", f"127.0.0.1:{ship}",
                   "--relay-ship-name", "decode-0"]  # fmt: skip
    greedy = {"temperature": 0, "ignore_eos": True}
    with both_servers(prefill_args, decode_args, env=env) as (prefill, decode):
        up = {"input_ids": UP_IDS, "sampling_params": {"max_new_tokens": 96, **greedy}}
        _, upstream = _pd(prefill, decode, bootstrap, up)
        assert relay_info(decode.url)["ship_offers"] == 1
        ref = R.load_model(model)
        cfg = settings_from_env(model, {}).config
        prompt, span, occ = _downstream(ref, upstream["output_ids"])
        down = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, **greedy},
                "return_logprob": True, "top_logprobs_num": 5}  # fmt: skip
        on_prefill, on_decode = _pd(prefill, decode, bootstrap, down)
        got = relay_info(prefill.url)
        assert got["ship_received_spans"] == 1 and got["host_restores"] == 1, got
        assert got["relayed_tokens"] >= 1, got
        served = on_prefill if "relay" in on_prefill["meta_info"] else on_decode
        info = served["meta_info"]["relay"]
        assert info["fallback"] is None and info["reused_tokens"] == len(span), info
        assert_matches_reference(served, R.relay_prefill(ref, prompt, [occ], cfg))
        # the decode server never relays: its prompts' KV arrives by transfer
        assert relay_info(decode.url).get("relay_extends", 0) == 0
