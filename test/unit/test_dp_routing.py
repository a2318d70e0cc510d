"""DP routing by span fingerprints: the hashes against a brute-force polynomial hash, the
router's decisions against the rules in runtime/scale/dp_routing.py, and the rank -> controller
messages over a real Unix socket."""

from __future__ import annotations

import random
import time

from sglang_relay.runtime.scale.dp_fingerprints import (
    STRIDE,
    WINDOW,
    FingerprintPublisher,
    covered_tokens,
    decode_message,
    encode_message,
    fingerprint_choice,
    key_worker,
    span_fingerprints,
    window_hashes,
)
from sglang_relay.runtime.scale.dp_routing import DPRouter
from sglang_relay.runtime.state import STATE

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
    return DPRouter(2, str(tmp_path / "router"), max_imbalance=imbalance)


def test_a_spans_fingerprints_are_its_stride_windows_and_its_last():
    rng = random.Random(3)
    for n in (WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + STRIDE, 39, 200):
        span = [rng.randrange(50_000) for _ in range(n)]
        offsets = sorted({*range(0, n - WINDOW + 1, STRIDE), n - WINDOW}) if n >= WINDOW else []
        want = [_brute_hash(span[o : o + WINDOW]) for o in offsets]
        assert span_fingerprints(span).tolist() == want


def test_covered_tokens_is_the_size_of_the_union_of_the_windows():
    rng = random.Random(4)
    for _ in range(300):
        starts = sorted(rng.sample(range(200), rng.randint(0, 12)))
        union = {t for s in starts for t in range(s, s + WINDOW)}
        assert covered_tokens(starts) == len(union)


def test_a_pasted_span_routes_to_the_rank_that_holds_it(tmp_path):
    rng = random.Random(1)
    span_a = [rng.randrange(50_000) for _ in range(200)]
    span_b = [rng.randrange(50_000) for _ in range(80)]
    router = _router(tmp_path)
    router.apply(0, "add", 1, span_fingerprints(span_b))
    router.apply(1, "add", 1, span_fingerprints(span_a))
    prompt = [7] * 13 + span_b + [9] * 5 + span_a + [11] * 3  # both pasted, odd offsets
    held = router.held_tokens(prompt)
    assert held == {1: 200, 0: 80}  # every token of each span: its windows cover it
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


def test_fingerprint_choice_is_the_brute_force_argmax_under_the_load_bound():
    rng = random.Random(10)
    for _ in range(2000):
        n = rng.randint(1, 8)
        loads = [rng.randint(0, 20) for _ in range(n)]
        active = sorted(rng.sample(range(n), rng.randint(1, n)))
        holders = rng.sample(active, rng.randint(1, len(active)))
        held = {w: rng.choice([16, 32, 48, 512]) for w in sorted(holders)}
        top = max(held.values())
        best = [w for w in held if held[w] == top]
        calm = min(loads[w] for w in best)
        want = min(w for w in best if loads[w] == calm)  # held in rank order: the first
        if loads[want] - min(loads[w] for w in active) > 8:  # inactive ranks do not count
            want = None
        assert fingerprint_choice(held, loads, active, 8) == want


def test_a_routing_key_indexes_the_active_ranks():
    for i in range(32):
        key = f"chain-{i}"
        assert key_worker(key, [0, 2, 5]) == [0, 2, 5][key_worker(key, range(3))]
        assert key_worker(key, range(4)) == key_worker(key, [0, 1, 2, 3])


def test_a_ranks_message_is_visible_to_the_controller_when_its_send_returns(tmp_path):
    """The rank publishes a span before it streams the request's output, so a downstream
    request that pastes the output reaches the controller after the message did: no wait,
    no poll, the next drain has it (a race under load with ZMQ's I/O threads before)."""
    router = _router(tmp_path)
    pubs = [FingerprintPublisher(router.endpoint, rank=r) for r in (0, 1)]
    spans = {r: list(range(1000 + 500 * r, 1100 + 500 * r)) for r in (0, 1)}
    for round_ in range(50):
        for r, pub in enumerate(pubs):
            pub.added(round_, spans[r])
            router.drain()
            assert (r, round_) in router.spans
            assert router.held_tokens([0, *spans[r]])[r] == 100
            pub.dropped_span(round_)
        router.drain()
        assert router.spans == {} and router.holders == {}
    assert [(p.sent, p.dropped) for p in pubs] == [(100, 0), (100, 0)]
    for pub in pubs:
        pub.close()
    router.drain()  # the ranks' closed connections are let go
    assert router._conns == []
    router.close()
    assert not (tmp_path / "router").exists()


def test_a_full_socket_delays_a_ranks_messages_in_order_and_never_raises(tmp_path):
    router = _router(tmp_path)
    pub = FingerprintPublisher(router.endpoint, rank=0)
    span = list(range(100))
    i = 0
    while not pub.waiting:  # never drained: the socket fills
        pub.added(i, span)
        i += 1
    assert pub.sent == i - 1 > 100 and pub.dropped == 0
    for span_id in range(i - 1):  # a burst of drops while it is full: kept, not lost
        pub.dropped_span(span_id)
    assert pub.waiting == i and pub.dropped == 0
    router.drain()  # what the socket held
    assert len(router.spans) == pub.sent
    # the rank's span store flushes at every look-up (a request arrived), in order
    from sglang_relay.runtime.cache.span_store import SpanStore

    store = SpanStore(min_match=32, max_tokens=4096, release_slots=None, listener=pub)
    for _ in range(1000):
        if not pub.waiting:
            break
        store.matches(list(range(40)), None)
        router.drain()
    assert pub.waiting == 0 and pub.dropped == 0
    assert list(router.spans) == [(0, i - 1)] and router.spans[(0, i - 1)].size > 0
    router.close()
    pub.added(10**6, span)  # the controller gone: counted, never raised
    assert pub.dropped == 1 and pub.waiting == 0
    nowhere = FingerprintPublisher(str(tmp_path / "nobody"), rank=0)  # never listened
    nowhere.added(1, span)
    assert (nowhere.sent, nowhere.dropped) == (0, 1)


def test_fingerprint_messages_are_raw_bytes_and_malformed_ones_are_dropped(tmp_path):
    import socket

    import numpy as np
    import pytest

    hashes = window_hashes(list(range(500, 600)), STRIDE, 12345)
    raw = encode_message(1, "add", 2**40 + 3, hashes)
    assert b"\x80\x04" not in raw[:2] and len(raw) == 13 + 8 * len(hashes)  # no pickle
    rank, op, span_id, got = decode_message(raw)
    assert (rank, op, span_id) == (1, "add", 2**40 + 3) and np.array_equal(got, hashes)
    assert decode_message(encode_message(0, "drop", 7, None)) == (0, "drop", 7, None)
    for bad in (b"", raw[:-3], b"\x01\x00\x00\x00\x09" + bytes(8),
                encode_message(0, "drop", 7, None) + bytes(8)):  # fmt: skip
        with pytest.raises(ValueError):
            decode_message(bad)
    # the controller skips what it cannot decode (and ranks it does not have)
    router = _router(tmp_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(router.endpoint)
    for msg in (b"garbage", encode_message(9, "add", 1, hashes), raw):
        sock.send(msg)
    router.drain()
    assert list(router.spans) == [(1, 2**40 + 3)]
    assert router.decisions["bad_fingerprint_messages"] == 1
    sock.close()


def test_the_decision_rides_with_the_request_to_its_rank():
    from types import SimpleNamespace

    from sglang_relay.runtime.sglang.scheduling import DP_ROUTE_KEY, dp_route, tag_dp_route

    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))
    assert dp_route(req) is None
    tag_dp_route(req, "matched")
    assert dp_route(req) == "matched"
    req.sampling_params.custom_params["relay"] = {"reuse": 0.9}  # the user's own options stay
    tag_dp_route(req, "key")
    assert req.sampling_params.custom_params == {
        "relay": {"reuse": 0.9},
        DP_ROUTE_KEY: "key",
    }


def _req(tokens, extra_key=None, cache_salt=None, relay=None):
    from types import SimpleNamespace

    params = SimpleNamespace(custom_params={"relay": relay} if relay is not None else None)
    return SimpleNamespace(
        input_ids=tokens,
        extra_key=extra_key,
        lora_id=None,
        cache_salt=cache_salt,
        sampling_params=params,
    )


def test_a_prompt_only_matches_spans_of_its_own_namespace(tmp_path):
    """Fingerprints are salted per namespace: a tenant's prompt holding another tenant's
    text is not routed by it (nor can it time whether the other tenant holds it)."""
    rng = random.Random(2)
    span = [rng.randrange(50_000) for _ in range(120)]
    prompt = [7] * 9 + span + [11] * 4
    router = _router(tmp_path)
    pub = FingerprintPublisher(router.endpoint, rank=1)
    ns_a = router.namespace(_req(prompt, cache_salt="tenant-a"))
    assert ns_a == (None, None, "tenant-a", None)  # extra_key, lora_id, cache_salt, relay key
    pub.added(3, span, ns_a)  # what the rank's SpanStore tells the publisher
    router.drain()
    assert router.held_tokens(prompt, ns_a)[1] == len(span)
    for other in (
        _req(prompt),  # the default namespace
        _req(prompt, cache_salt="tenant-b"),
        _req(prompt, extra_key="lora-x", cache_salt="tenant-a"),
        _req(prompt, cache_salt="tenant-a", relay={"key": "team-2"}),
    ):
        assert router.held_tokens(prompt, router.namespace(other)) == {}
        assert router.route(prompt, None, [0, 0], [0, 1], router.namespace(other)) is None
    assert router.route(prompt, None, [0, 0], [0, 1], ns_a) == 1
    # the default namespace's hashes are the unsalted ones (brute force above)
    assert window_hashes(span, STRIDE, 0).tolist() == window_hashes(span, STRIDE).tolist()


def test_the_controller_loop_waits_on_its_socket_and_dispatches_everything(tmp_path, monkeypatch):
    """The CPU stand-in's DP controller loop: every message sent is dispatched in order,
    and the loop sleeps in between (it does not spin a core while idle); while idle it
    still reads the ranks' fingerprints (they do not queue up in the ranks)."""
    import threading

    # SGLang's controller module imports slowly (12 s on a loaded 2-core VM): import it
    # here, not on the loop thread, so the deadline below times the loop only
    import sglang.srt.managers.data_parallel_controller  # noqa: F401
    import zmq

    from sglang_relay.runtime.standin.cpu import blocking_event_loop

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"ipc://{tmp_path}/loop")
    push.connect(f"ipc://{tmp_path}/loop")
    got, feeds = [], []

    class _Controller:  # the attributes dp_controller_receiver reads
        recv_from_tokenizer = pull
        soft_watchdog = type("W", (), {"feed": lambda self: feeds.append(1)})()

        def _request_dispatcher(self, message):
            got.append(message)

    def run():
        try:
            blocking_event_loop(None, _Controller())
        except zmq.ContextTerminated:
            pass

    router = _router(tmp_path)
    monkeypatch.setattr(STATE, "dp_router", router)
    pub = FingerprintPublisher(router.endpoint, rank=1)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for i in range(50):
        push.send_pyobj({"req": i})
    deadline = time.time() + 10
    while len(got) < 50 and time.time() < deadline:
        time.sleep(0.05)
    assert got == [{"req": i} for i in range(50)]
    start = time.process_time()  # this process's CPU time, every thread
    pub.added(7, list(range(300, 400)))
    time.sleep(1.5)  # idle: a spinning loop would burn ~1.5 s of CPU here
    assert time.process_time() - start < 0.5
    assert feeds  # the watchdog is fed
    assert (1, 7) in router.spans  # read by the idle loop, no request needed
    push.close(linger=0)


class _Controller:
    """The load snapshot ``scheduling.dp_loads`` reads of SGLang's DP controller."""

    def __init__(self, loads):
        self.dp_budget = type("Budget", (), {"total_requests": loads})()
        self._active_workers = list(range(len(loads)))

    def refresh_load_budget(self):
        pass


def test_the_routing_hook_never_raises_into_the_controller(tmp_path, monkeypatch):
    """An embedding request (no ``extra_key``) used to raise AttributeError inside SGLang's
    controller loop; the hook now leaves it to SGLang's own routing, counted."""
    from array import array

    from sglang.srt.managers.io_struct import TokenizedEmbeddingReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_relay.runtime.scale import dp_routing

    router = _router(tmp_path)
    span = list(range(500, 600))
    router.apply(1, "add", 1, span_fingerprints(span))  # rank 1 holds the prompt's text
    monkeypatch.setattr(STATE, "dp_router", router)
    req = TokenizedEmbeddingReqInput(
        input_text=None,
        input_ids=array("i", [3] * 5 + span),
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
    )
    assert not hasattr(req, "extra_key")
    handed = []

    def original(controller, r):  # SGLang's maybe_external_dp_rank_routing
        handed.append(r)
        return False

    controller = _Controller([0, 0])
    assert dp_routing.route_request(original, controller, req) is False
    assert handed == [req] and req.routed_dp_rank is None  # SGLang's method decides
    assert router.decisions == {"fallback_error": 1}

    # a generate request (the shape the router reads) is still routed to its spans' rank
    gen = _req([3] * 5 + span)
    gen.routed_dp_rank = None
    dp_routing.route_request(original, controller, gen)
    assert gen.routed_dp_rank == 1 and handed[-1] is gen
    assert router.decisions == {"fallback_error": 1, "matched": 1}
