"""The publisher and the receiver of span shipping (``runtime/scale/ship/``) in one
process, on real parts: two sets of SGLang's KV pools (device pool, host pool,
``L2TransferEngine``), two relay host tiers and span stores, two of Mooncake's transfer
engines over TCP on loopback, ZMQ between them.

A span recorded on the publisher arrives on the receiver with the publisher's KV slot for
slot and its side rows, and the receiver's copy back puts that KV into fresh device slots;
pages rewritten in the publisher's staging before the pull (what a peer reaching the
transfer port could do) are caught by the digest and nothing is recorded; a host copy
changed after it was taken is caught again before it goes back to the device; a receiver
that restarted asks for the hello again; a publisher of other pools, without the key its
name has, or not in the receiver's map is refused; a span is filed under the namespace
the receiver's map gives its publisher, and one offered under another tenant is declined;
only the staging regions are registered with the transfer engines; a pull blocked in the
engine does not block the receiver's poll."""

from __future__ import annotations

import time

import pytest
import torch
from test_relay_host_tier import HIDDEN, LAYERS, _decoded, _parts, _tier

from sglang_relay.process import free_port
from sglang_relay.runtime.cache.span_store import SpanStore
from sglang_relay.runtime.scale.ship.mooncake import MooncakeTransport
from sglang_relay.runtime.scale.ship.pages import pool_geometry
from sglang_relay.runtime.scale.ship.peers import Publisher
from sglang_relay.runtime.scale.ship.receiver import Receiver
from sglang_relay.runtime.scale.ship.wire import publisher_key

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


def _peers(secrets=("k", "k"), name="decode-0", publishers=None, transport=MooncakeTransport,
           **publisher_geometry):  # fmt: skip
    """A receiver and a publisher ``name`` pointed at it (the publisher's geometry changed
    by ``publisher_geometry``; ``secrets``: the receiver's, and the one the publisher's key
    was derived from; ``publishers``: the receiver's map, default ``{name: "*"}``)."""
    port = free_port()
    rp, rtier, rstore, rgeo = _side(0)
    receiver = Receiver(
        tier=rtier, store=rstore, ledger=rp.ledger, transport=transport("127.0.0.1"),
        listen=f"127.0.0.1:{port}", geometry=rgeo, vocab=1000, max_position=4096,
        secret=secrets[0], publishers=publishers or {name: "*"}, staging_tokens=24,
    )  # fmt: skip
    pp, ptier, pstore, pgeo = _side(1, **publisher_geometry)
    publisher = Publisher(
        tier=ptier, store=pstore, transport=MooncakeTransport("127.0.0.1"),
        peers=[f"127.0.0.1:{port}"], geometry=pgeo, lease=30.0, name=name,
        key=publisher_key(secrets[1], name), staging_tokens=24,
    )  # fmt: skip
    return pp, pstore, publisher, rp, rstore, receiver


@pytest.fixture()
def pair():
    parts = _peers()
    assert _until(lambda: len(parts[5].peers) == 1, parts[5], parts[2])  # connected, greeted
    yield parts
    parts[2].close()
    parts[5].close()


def _record(pp, pstore, slots: torch.Tensor, namespace=NS) -> int:
    hidden_rows = torch.randn(slots.numel(), HIDDEN)
    stamps = _decoded(pp, slots, hidden_rows)
    tokens = list(range(500, 500 + slots.numel()))
    positions = torch.arange(40, 40 + slots.numel())
    return pstore.add(tokens, slots, positions, stamps, namespace), tokens


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
    # the ack frees the publisher's staging pages; the receiver's are free too
    assert publisher.staging.available() < publisher.staging.size
    assert _until(lambda: publisher.staging.available() == publisher.staging.size,
                  publisher=publisher)  # fmt: skip
    assert receiver.staging.available() == receiver.staging.size
    assert receiver.counters["received_spans"] == 1 and receiver.counters["pull_bytes"] > 0


def test_only_the_staging_regions_are_exposed_to_the_transfer_engines(pair):
    """Mooncake serves every registered address to any peer: neither host pool is."""
    pp, pstore, publisher, rp, rstore, receiver = pair
    for end, host in ((publisher, pp.host), (receiver, rp.host)):
        buf = end.staging.kv_buffer
        assert end.transport.registered == [(buf.data_ptr(), buf.numel() * buf.element_size())]
        h0, h1 = host.kv_buffer.data_ptr(), host.kv_buffer.data_ptr() + host.kv_buffer.nbytes
        assert all(p + n <= h0 or p >= h1 for p, n in end.transport.registered)


def test_pages_rewritten_in_staging_before_the_pull_are_caught_by_the_digest():
    pp, pstore, publisher, rp, rstore, receiver = _peers(transport=_GatedTransport)
    try:
        assert _until(lambda: len(receiver.peers) == 1, receiver, publisher)
        span_id, tokens = _record(pp, pstore, torch.tensor([5, 6, 7, 8, 20, 21]))
        publisher.offer(span_id, tokens)
        assert _until(lambda: receiver.counters["pulls"] == 1)  # held in the engine
        staged = publisher.pending[span_id][2]
        publisher.staging.kv_buffer[:, :, staged[2]] += 1.0  # a remote write into staging
        free_before = rp.host.available_size()
        receiver.transport.gate.set()
        assert _until(lambda: receiver.counters["declined_digest_mismatch"] == 1, receiver)
        assert not rstore.spans and rp.host.available_size() == free_before  # nothing kept
        assert receiver.staging.available() == receiver.staging.size
    finally:
        receiver.transport.gate.set()
        publisher.close()
        receiver.close()


def test_a_shipped_copy_changed_on_host_is_dropped_before_it_reaches_the_device(pair):
    pp, pstore, publisher, rp, rstore, receiver = pair
    span_id, tokens = _record(pp, pstore, torch.tensor([12, 13, 14, 15, 16]))
    publisher.offer(span_id, tokens)
    assert _until(lambda: rstore.spans, receiver=receiver)
    (rid,) = rstore.spans
    copy = rstore.tier.copies[rid]
    rp.host.kv_buffer[1, 0, copy.host_idx[copy.offsets[3]]] += 1.0  # V of one token changed
    device_free = rp.allocator.available_size()
    assert rstore.tier.restore(rid) is None
    assert rstore.tier.counters["restores_declined_digest"] == 1 and not rstore.tier.has(rid)
    assert rp.allocator.available_size() == device_free  # nothing allocated


def test_spans_are_filed_where_the_receivers_map_puts_the_publisher():
    """The namespace an offer carries is advice: a publisher mapped to tenant ``acme`` has
    every span filed under ``acme``; one it offers under another tenant is declined."""
    pp, pstore, publisher, rp, rstore, receiver = _peers(publishers={"decode-0": "acme"})
    try:
        assert _until(lambda: len(receiver.peers) == 1, receiver, publisher)
        plain, tokens = _record(pp, pstore, torch.tensor([1, 2, 3, 4, 5]))
        publisher.offer(plain, tokens)
        assert _until(lambda: rstore.spans, receiver=receiver)
        ((rid, span),) = rstore.spans.items()
        assert span.namespace == (None, None, None, ("tenant", "acme"), None)
        foreign = (None, None, None, ("tenant", "victim"), None)
        other, tokens2 = _record(pp, pstore, torch.tensor([20, 21, 22, 23, 24]), foreign)
        publisher.offer(other, tokens2)
        assert _until(lambda: receiver.counters["declined_namespace_mismatch"] == 1, receiver)
        assert list(rstore.spans) == [rid] and not rstore.find(tokens2, foreign)
        assert _until(lambda: publisher.counters["acks_declined"] == 1, publisher=publisher)
    finally:
        publisher.close()
        receiver.close()


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
        assert ptier.has(span_id)  # nothing staged: nobody to offer it to
        assert publisher.staging.available() == publisher.staging.size
    finally:
        publisher.close()
        receiver.close()


@pytest.mark.parametrize(
    "change",
    [
        dict(secrets=("ours", "guessed")),  # a key of another secret
        dict(secrets=("ours", "ours"), publishers={"decode-1": "*"}),  # a name not mapped
    ],
    ids=["wrong-secret", "unmapped-name"],
)
def test_a_publisher_without_a_key_or_place_on_the_receiver_is_refused(change):
    """The hello is signed with the publisher's own key, never carries it: a publisher
    whose key is not the one the receiver's secret gives its name, or whose name the
    receiver does not map, is refused at its hello, stops offering, and plants nothing."""
    pp, pstore, publisher, rp, rstore, receiver = _peers(**change)
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


def test_a_publisher_cannot_sign_as_another():
    """``decode-1`` holds its own key (the secret bound to its name); claiming the name
    ``decode-0`` with it fails, though both names are mapped."""
    from dataclasses import replace

    pp, pstore, publisher, rp, rstore, receiver = _peers(
        name="decode-0", publishers={"decode-0": "*", "decode-1": "*"}
    )
    publisher.close()
    try:
        impostor = Publisher(
            tier=pstore.tier, store=pstore, transport=MooncakeTransport("127.0.0.1"),
            peers=[receiver.sock.last_endpoint.decode().removeprefix("tcp://")],
            geometry=replace(publisher.geometry), lease=30.0, name="decode-0",
            key=publisher_key("k", "decode-1"), staging_tokens=24,
        )  # fmt: skip
        assert _until(lambda: receiver.counters["peers_refused"] == 1, receiver, impostor)
        # (the real decode-0 may have been greeted before it closed: the impostor was not)
        sessions = {hello.session for hello, *_ in receiver.peers.values()}
        assert impostor.transport.session not in sessions
        impostor.close()
    finally:
        receiver.close()


class _GatedTransport(MooncakeTransport):
    """Mooncake's engine, each read held until the test opens the gate (a slow network)."""

    def __init__(self, host):
        import threading

        super().__init__(host)
        self.gate = threading.Event()

    def read(self, *args):
        assert self.gate.wait(30)
        return super().read(*args)


def test_a_pull_blocked_in_the_engine_does_not_block_the_receivers_poll():
    pp, pstore, publisher, rp, rstore, receiver = _peers(transport=_GatedTransport)
    try:
        assert _until(lambda: len(receiver.peers) == 1, receiver, publisher)
        span_id, tokens = _record(pp, pstore, torch.tensor([3, 4, 5, 6, 7]))
        publisher.offer(span_id, tokens)
        assert _until(lambda: receiver.counters["pulls"] == 1)  # held in the engine
        t0 = time.monotonic()
        for _ in range(20):
            receiver.poll()  # the scheduler's matching goes on
        assert time.monotonic() - t0 < 1.0 and not rstore.spans
        receiver.transport.gate.set()
        assert _until(lambda: rstore.spans, receiver=receiver)
        assert receiver.counters["received_spans"] == 1
    finally:
        receiver.transport.gate.set()
        publisher.close()
        receiver.close()
