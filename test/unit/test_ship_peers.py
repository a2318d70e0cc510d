"""The publisher and the receiver of span shipping (``runtime/scale/ship/peers.py``) in one
process, on real parts: two sets of SGLang's KV pools (device pool, host pool,
``L2TransferEngine``), two relay host tiers and span stores, two of Mooncake's transfer
engines over TCP on loopback, ZMQ between them.

A span recorded on the publisher arrives on the receiver with the publisher's KV slot for
slot and its side rows, and the receiver's copy back puts that KV into fresh device slots;
pages the publisher rewrote before the pull are caught by the digest and nothing is
recorded; a receiver that restarted asks for the hello again; a publisher of other pools
is refused; the lease keeps the offered copy until the ack."""

from __future__ import annotations

import time

import pytest
import torch
from test_relay_host_tier import HIDDEN, LAYERS, _decoded, _parts, _tier

from sglang_relay.process import free_port
from sglang_relay.runtime.cache.span_store import SpanStore
from sglang_relay.runtime.scale.ship.mooncake import MooncakeTransport
from sglang_relay.runtime.scale.ship.pages import pool_geometry
from sglang_relay.runtime.scale.ship.peers import Publisher, Receiver

NS = (None, None, None, None)


def _side(seed: int, **geometry_change):
    p = _parts(1, host_tokens=32)
    tier = _tier(p)
    store = SpanStore(min_match=4, max_tokens=64, release_slots=p.allocator.free)
    store.tier = tier
    layers = {"capture_layer": 1, "influence_layer": 1, "context_layer": -1}
    geometry = pool_geometry(p.host, hidden=p.ledger.hidden, model="m", layers=layers)
    if geometry_change:
        from dataclasses import replace

        geometry = replace(geometry, **geometry_change)
    return p, tier, store, geometry


def _peers(secrets=("k", "k"), **publisher_geometry):
    """A receiver and a publisher pointed at it (the publisher's geometry changed by
    ``publisher_geometry``; ``secrets``: the receiver's and the publisher's)."""
    port = free_port()
    rp, rtier, rstore, rgeo = _side(0)
    receiver = Receiver(
        tier=rtier, store=rstore, ledger=rp.ledger, transport=MooncakeTransport("127.0.0.1"),
        listen=f"127.0.0.1:{port}", geometry=rgeo, vocab=1000, max_position=4096,
        secret=secrets[0],
    )  # fmt: skip
    pp, ptier, pstore, pgeo = _side(1, **publisher_geometry)
    publisher = Publisher(
        tier=ptier, store=pstore, transport=MooncakeTransport("127.0.0.1"),
        peers=[f"127.0.0.1:{port}"], geometry=pgeo, lease=30.0, secret=secrets[1],
    )  # fmt: skip
    return pp, pstore, publisher, rp, rstore, receiver


@pytest.fixture()
def pair():
    parts = _peers()
    assert _until(lambda: len(parts[5].peers) == 1, parts[5], parts[2])  # connected, greeted
    yield parts
    parts[2].close()
    parts[5].close()


def _record(pp, pstore, slots: torch.Tensor) -> int:
    hidden_rows = torch.randn(slots.numel(), HIDDEN)
    stamps = _decoded(pp, slots, hidden_rows)
    tokens = list(range(500, 500 + slots.numel()))
    positions = torch.arange(40, 40 + slots.numel())
    return pstore.add(tokens, slots, positions, stamps, NS), tokens


def _until(cond, receiver=None, publisher=None, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if receiver is not None:
            receiver.poll()
        if publisher is not None:
            publisher.poll()
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_shipped_span_arrives_with_the_publishers_kv_and_side_rows(pair):
    pp, pstore, publisher, rp, rstore, receiver = pair
    slots = torch.tensor([9, 3, 17, 40, 41, 42, 11])
    span_id, tokens = _record(pp, pstore, slots)
    want_k = [pp.pool.k_buffer[i][slots].clone() for i in range(LAYERS)]
    want_v = [pp.pool.v_buffer[i][slots].clone() for i in range(LAYERS)]
    want_hidden = pp.ledger.hidden[slots].clone()
    publisher.offer(span_id, tokens)
    assert _until(lambda: rstore.spans, receiver=receiver)
    ((rid, span),) = rstore.spans.items()
    assert torch.equal(span.positions, torch.arange(40, 40 + slots.numel()))
    assert rstore.find(tokens, NS)[0].span_id == rid
    # the receiver's copy back: the publisher's KV in fresh device slots, with side rows
    back = rstore.tier.restore(rid)
    assert back is not None
    new, new_stamps, _ = back
    for i in range(LAYERS):
        assert torch.equal(rp.pool.k_buffer[i][new], want_k[i])
        assert torch.equal(rp.pool.v_buffer[i][new], want_v[i])
    has = (new_stamps & 1).bool()
    assert has.tolist() == [True] * (slots.numel() - 2) + [False, False]
    assert torch.equal(rp.ledger.hidden[new][has], want_hidden[: slots.numel() - 2])
    # the ack ends the publisher's lease
    assert publisher.tier.copies[span_id].lease_until > 0
    assert _until(lambda: publisher.tier.copies[span_id].lease_until == 0, publisher=publisher)
    assert receiver.counters["received_spans"] == 1 and receiver.counters["pull_bytes"] > 0


def test_pages_rewritten_before_the_pull_are_caught_by_the_digest(pair):
    pp, pstore, publisher, rp, rstore, receiver = pair
    slots = torch.tensor([5, 6, 7, 8, 20, 21])
    span_id, tokens = _record(pp, pstore, slots)
    publisher.offer(span_id, tokens)
    copy = publisher.tier.copies[span_id]
    pp.host.kv_buffer[:, :, copy.host_idx[2]] += 1.0  # the lease broken: a page rewritten
    free_before = rp.host.available_size()
    assert _until(lambda: receiver.counters["declined_digest_mismatch"] == 1, receiver=receiver)
    assert not rstore.spans and rp.host.available_size() == free_before  # nothing kept


def test_a_receiver_that_restarted_gets_the_hello_again(pair):
    pp, pstore, publisher, rp, rstore, receiver = pair
    assert _until(lambda: len(receiver.peers) == 1, receiver, publisher)  # the hello arrived
    receiver.peers.clear()  # as after a restart: the connection is unknown
    span_id, tokens = _record(pp, pstore, torch.tensor([30, 31, 32, 33, 34]))
    publisher.offer(span_id, tokens)
    assert _until(lambda: publisher.counters["hellos_resent"] == 1, receiver, publisher)
    assert _until(lambda: len(receiver.peers) == 1, receiver, publisher)
    span2, tokens2 = _record(pp, pstore, torch.tensor([50, 51, 52, 53, 54]))
    publisher.offer(span2, tokens2)
    assert _until(lambda: receiver.counters["received_spans"] == 1, receiver=receiver)


def test_a_publisher_of_other_pools_is_refused_and_stops_offering():
    pp, pstore, publisher, rp, rstore, receiver = _peers(capture_layer=2)  # other layer's rows
    ptier = pstore.tier
    try:
        assert _until(lambda: receiver.counters["peers_refused"] == 1, receiver, publisher)
        assert _until(lambda: publisher.refused == {0}, publisher=publisher)
        span_id, tokens = _record(pp, pstore, torch.tensor([1, 2, 3, 4, 5]))
        publisher.offer(span_id, tokens)
        assert publisher.counters["offers"] == 1 and not publisher.pending
        assert ptier.copies[span_id].lease_until == 0  # nobody to wait for
    finally:
        publisher.close()
        receiver.close()


def test_a_publisher_without_the_receivers_secret_is_refused_and_plants_nothing():
    """The hello is signed, never carries the secret: a publisher with another secret is
    refused at its hello, stops offering, and the receiver's store stays empty."""
    pp, pstore, publisher, rp, rstore, receiver = _peers(secrets=("ours", "guessed"))
    try:
        assert _until(lambda: receiver.counters["peers_refused"] == 1, receiver, publisher)
        assert _until(lambda: publisher.refused == {0}, publisher=publisher)
        span_id, tokens = _record(pp, pstore, torch.tensor([1, 2, 3, 4, 5]))
        publisher.offer(span_id, tokens)
        receiver.poll()
        assert not receiver.peers and not rstore.spans
    finally:
        publisher.close()
        receiver.close()
