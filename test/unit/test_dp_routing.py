"""DP routing by span fingerprints: the hashes against a brute-force polynomial hash, the
router's decisions against the rules in runtime/dp_routing.py, and the rank -> controller
messages over a real ZMQ socket."""

from __future__ import annotations

import random
import time

from sglang_relay.runtime.dp_routing import (
    STRIDE,
    WINDOW,
    DPRouter,
    FingerprintPublisher,
    window_hashes,
)

BASE = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def _brute_hash(window: list[int]) -> int:
    h = 0
    for t in window:
        h = (h * BASE + t) & MASK
    return h


def test_window_hashes_equal_a_brute_force_polynomial_hash():
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(100)]
    for stride in (1, STRIDE):
        got = window_hashes(tokens, stride).tolist()
        want = [_brute_hash(tokens[i : i + WINDOW]) for i in range(0, 100 - WINDOW + 1, stride)]
        assert got == want
    assert window_hashes(tokens[: WINDOW - 1]).size == 0


def _router(tmp_path, imbalance=8) -> DPRouter:
    return DPRouter(2, f"ipc://{tmp_path}/router", max_imbalance=imbalance)


def test_a_pasted_span_routes_to_the_rank_that_holds_it(tmp_path):
    rng = random.Random(1)
    span_a = [rng.randrange(50_000) for _ in range(200)]
    span_b = [rng.randrange(50_000) for _ in range(80)]
    router = _router(tmp_path)
    router.apply(0, "add", 1, window_hashes(span_b, STRIDE))
    router.apply(1, "add", 1, window_hashes(span_a, STRIDE))
    prompt = [7] * 13 + span_b + [9] * 5 + span_a + [11] * 3  # both pasted, odd offsets
    held = router.held_tokens(prompt)
    assert held[1] == STRIDE * len(range(0, 200 - WINDOW + 1, STRIDE))  # every window found
    assert held[0] == STRIDE * len(range(0, 80 - WINDOW + 1, STRIDE))
    assert router.route(prompt, None, [0, 0], [0, 1]) == 1  # rank 1 holds more
    assert router.route(prompt, None, [0, 9], [0, 1]) is None  # 9 > 0 + 8: overloaded
    assert router.route(prompt, None, [1, 9], [0, 1]) == 1  # within the imbalance
    assert router.route(prompt, None, [0, 0], [0]) == 0  # rank 1 inactive
    assert router.decisions == {"matched": 3, "fallback_overloaded": 1}

    router.apply(1, "drop", 1, None)  # evicted on rank 1
    assert router.route(prompt, None, [0, 0], [0, 1]) == 0
    router.apply(0, "drop", 1, None)
    assert router.holders == {} and router.spans == {}
    assert router.route(prompt, None, [0, 0], [0, 1]) is None  # nothing held: SGLang decides


def test_a_routing_key_pins_a_chain_to_one_rank(tmp_path):
    router = _router(tmp_path)
    keys = [f"chain-{i}" for i in range(16)]
    first = [router.route(list(range(40)), k, [0, 0], [0, 1]) for k in keys]
    again = [router.route(list(range(100, 180)), k, [5, 0], [0, 1]) for k in keys]
    assert first == again  # the same rank for every request of a chain
    assert set(first) == {0, 1}  # and chains spread over the ranks
    assert router.route(list(range(40)), None, [0, 0], [0, 1]) is None


def test_ranks_publish_to_the_controller_over_zmq(tmp_path):
    router = _router(tmp_path)
    pub = FingerprintPublisher(router.endpoint, rank=1)
    span = list(range(1000, 1100))
    pub.added(5, span)
    deadline = time.time() + 5
    while not router.spans and time.time() < deadline:
        router.drain()
        time.sleep(0.01)
    assert (1, 5) in router.spans and router.held_tokens([0, *span])[1] > 0
    pub.dropped_span(5)
    deadline = time.time() + 5
    while router.spans and time.time() < deadline:
        router.drain()
        time.sleep(0.01)
    assert router.spans == {} and router.holders == {}
    assert pub.sent == 2 and pub.dropped == 0


def test_the_decision_rides_with_the_request_to_its_rank():
    from types import SimpleNamespace

    from sglang_relay.runtime import compat

    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))
    assert compat.dp_route(req) is None
    compat.tag_dp_route(req, "matched")
    assert compat.dp_route(req) == "matched"
    req.sampling_params.custom_params["relay"] = {"reuse": 0.9}  # the user's own options stay
    compat.tag_dp_route(req, "key")
    assert req.sampling_params.custom_params == {
        "relay": {"reuse": 0.9},
        compat.DP_ROUTE_KEY: "key",
    }
