"""The two ends of span shipping: a :class:`Publisher` on the server that decodes an
agent's output (a PD decode server), a :class:`Receiver` on the server that prefills the
next agent's prompt (a PD prefill server).

The publisher copies each span it records (and backed up to its host tier) into its
staging region (:mod:`.staging`: the only memory its transfer engine exposes) and offers
it to every receiver it was pointed at, holding the staging pages meanwhile; a receiver
checks the offer, files it under the namespace *its own* configuration maps that
publisher to (``SGLANG_RELAY_SHIP_PUBLISHERS``: every namespace the publisher sends, or
one tenant; never an arbitrary one from the offer), reserves host slots in its own tier
and staging pages, pulls the pages through the transfer engine into staging, copies them
into the host slots, checks their digest there, and records the span in its own store,
with stamps no slot ever has (its KV is on host only) and the digest, which the host tier
checks again before the copy goes back to the device. From there the receiver's planner
treats it as any span whose device slots are gone: a related prompt has it copied into
fresh device slots and relays it. Acks free the publisher's staging pages; so does the
end of ``lease`` seconds.

Both run on the scheduler thread (as the host tier and the store): ``poll()`` is called
when the scheduler matches prompts. The receiver's transfers, copies and digests run on
one worker thread (a transfer is bounded only by the engine's timeout, ~30 s): ``poll()``
hands new pulls to it and records the finished ones, never waiting for one. A failed or
refused transfer leaves nothing recorded (counted).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import sglang_relay.runtime.scale.ship.wire as wire
from sglang_relay.runtime.cache.host_rows import digest
from sglang_relay.runtime.cache.host_tier import HostTier
from sglang_relay.runtime.scale.ship.pages import Geometry, PoolAddress
from sglang_relay.runtime.scale.ship.staging import Staging

logger = logging.getLogger(__name__)

POLL_BATCH = 64  # messages read per poll
ANY_NAMESPACE = "*"  # a publisher mapping that files spans under the namespace they carry


def filed_namespace(rule: str, namespace: tuple) -> tuple | None:
    """The namespace a receiver files a shipped span under, by the ``rule`` its
    configuration has for the publisher: :data:`ANY_NAMESPACE` keeps ``namespace`` (the
    publisher serves this receiver's own tenants, a PD pair behind one gateway); a tenant
    name files it under that tenant (``("tenant", name)`` as a header scope puts it), and
    a span the publisher filed under another tenant is not taken (None)."""
    if rule == ANY_NAMESPACE:
        return namespace
    tenants = [x for x in namespace if isinstance(x, tuple)]
    rest = [x for x in namespace if not isinstance(x, tuple)]
    if tenants not in ([], [("tenant", rule)]) or not rest:
        return None
    return (*rest[:-1], ("tenant", rule), rest[-1])


def zmq_socket(kind: int, *, max_frame: int) -> Any:
    import zmq

    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)  # per frame: larger ones drop the connection
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, 64)
    return sock


def max_frame_bytes(geometry: Geometry, tokens: int) -> int:
    """The largest frame an offer of up to ``tokens`` tokens needs (its hidden rows)."""
    return max(wire.MAX_HEADER_BYTES, tokens * max(geometry.hidden, 1) * 4 + 4096)


def endpoint(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a ship address is HOST:PORT; got {address!r}")
    return f"tcp://{host}:{port}"


class Publisher:
    """Offers recorded spans to receivers (``peers``: HOST:PORT of each), as ``name``,
    signing with its own ``key`` (:func:`.wire.publisher_key`)."""

    role = "publisher"

    def __init__(
        self,
        *,
        tier: HostTier,
        store: Any,
        transport: Any,
        peers: list[str],
        geometry: Geometry,
        name: str,
        key: bytes,
        staging_tokens: int,
        lease: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.tier, self.store, self.transport = tier, store, transport
        self.lease = lease
        self.clock, self.wall = clock, wall
        self.name, self.key = wire.check_name(name), key
        self.geometry = geometry
        self.staging = Staging(tier.host_pool, staging_tokens, geometry.page_size, clock)
        self.address = PoolAddress.of(self.staging)
        transport.register(self.address.base, self.address.nbytes)
        self.counters: Counter[str] = Counter()
        # span id -> (receivers yet to answer, when the lease ends, its staging slots)
        self.pending: dict[int, tuple[int, float, torch.Tensor]] = {}
        self.keys: dict[int, bytes] = {}  # receiver -> its connection's key (its hello's)
        self.seq = 0  # offers are numbered across connections, never reused
        self.sockets = []
        self.refused: set[int] = set()  # receivers that refused this publisher
        frame = max_frame_bytes(geometry, self.staging.size)
        for i, peer in enumerate(peers):
            sock = zmq_socket(zmq.DEALER, max_frame=frame)
            # one identity per connection across reconnects: the receiver knows it
            sock.setsockopt(zmq.ROUTING_ID, f"{transport.session}/{i}".encode())
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a receiver not connected
            sock.connect(endpoint(peer))
            self.sockets.append(sock)
        self.greeted: set[int] = set()  # receivers the hello reached (they may start later)
        self._greet()

    def _greet(self) -> None:
        import zmq

        for i, sock in enumerate(self.sockets):
            if i in self.greeted:
                continue
            nonce = secrets.token_hex(16)  # fresh per hello: a receiver refuses one it saw
            a = self.address
            hello = wire.hello(self.name, self.transport.session, a.base, a.size,
                               self.geometry.to_dict(), self.key, nonce, self.wall())  # fmt: skip
            try:
                sock.send_multipart(hello, flags=zmq.NOBLOCK)
                self.greeted.add(i)
                self.keys[i] = wire.session_key(self.key, nonce)
            except zmq.Again:  # not connected yet
                pass

    def offer(self, span_id: int, tokens: list[int]) -> None:
        """Offer span ``span_id`` (just recorded, of ``tokens``) to every receiver. Never
        raises: recording a span must not fail a request."""
        try:
            self._offer(span_id, tokens)
            self._poll()
        except Exception:  # noqa: BLE001
            self.counters["offer_errors"] += 1
            logger.exception("sglang-relay: offering a span failed")

    def _offer(self, span_id: int, tokens: list[int]) -> None:
        import zmq

        span = self.store.spans.get(span_id)
        copy = self.tier.copies.get(span_id) if span is not None else None
        if copy is None:  # too long for the tier, or its copy failed
            self.counters["offers_without_host_copy"] += 1
            return
        self._end_leases()
        self._greet()
        to = [i for i in range(len(self.sockets)) if i in self.greeted and i not in self.refused]
        self.counters["offers"] += 1
        self.counters["offers_not_sent"] += len(self.sockets) - len(self.refused) - len(to)
        if not to:
            return
        staged = self.staging.alloc(int(copy.host_idx.numel()))
        if staged is None:  # every staging page is on offer still
            self.counters["offers_without_staging"] += 1
            return
        self.staging.take(self.tier.host_pool, copy.host_idx, staged)
        side = {"has_hidden": copy.has_hidden, "hidden": copy.hidden,
                "influence": copy.influence, "context": span.context}  # fmt: skip
        fields = (
            span_id, [int(t) for t in tokens], int(span.positions[0]),
            tuple(span.namespace), span.answer_start, staged.tolist(),
            copy.offsets.tolist(), digest(self.staging, staged), side,
        )  # fmt: skip
        sent = 0
        for i in to:
            self.seq += 1
            message = wire.offer(self.keys[i], self.seq, *fields)
            try:
                self.sockets[i].send_multipart(message, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # not connected, or its queue is full
                self.counters["offers_not_sent"] += 1
        if sent:
            self.pending[span_id] = (sent, self.clock() + self.lease, staged)
        else:
            self.staging.free(staged)

    def poll(self) -> None:
        """Read the receivers' answers: an ack frees the staging pages once every receiver
        answered. Never raises (the scheduler calls it while matching prompts)."""
        try:
            self._poll()
        except Exception:  # noqa: BLE001
            self.counters["poll_errors"] += 1
            logger.exception("sglang-relay: reading ship answers failed")

    def _poll(self) -> None:
        import zmq

        self._greet()
        for i, sock in enumerate(self.sockets):
            for _ in range(POLL_BATCH):
                try:
                    parts = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    header, _ = wire.decode(parts)
                except wire.BadMessage:
                    self.counters["bad_messages"] += 1
                    continue
                if header["kind"] == "refuse" and header.get("resend_hello") is True:
                    self.greeted.discard(i)  # said again now, or at the next greeting
                    self.counters["hellos_resent"] += 1
                    self._greet()
                elif header["kind"] == "refuse":
                    self.refused.add(i)
                    self.counters["refused_by_receiver"] += 1
                    logger.warning("sglang-relay: a ship receiver refused: %s", header.get("why"))
                elif header["kind"] == "ack" and type(header.get("span")) is int:
                    self._answered(header["span"], bool(header.get("ok")))
        self._end_leases()

    def _end_leases(self) -> None:
        now = self.clock()
        for span_id in [k for k, (_, end, _) in self.pending.items() if end <= now]:
            self.staging.free(self.pending.pop(span_id)[2])  # a late read fails its digest
            self.counters["offers_unanswered"] += 1

    def _answered(self, span_id: int, ok: bool) -> None:
        self.counters["acks_taken" if ok else "acks_declined"] += 1
        left, end, staged = self.pending.get(span_id, (0, 0.0, None))
        if left > 1:
            self.pending[span_id] = (left - 1, end, staged)
        elif left == 1:
            del self.pending[span_id]
            self.staging.free(staged)

    def stats(self) -> dict[str, Any]:
        return {f"ship_{k}": v for k, v in self.counters.items()} | {
            "ship_role": "publisher",
            "ship_name": self.name,
            "ship_peers": len(self.sockets),
            "ship_pending": len(self.pending),
            "ship_staging_tokens": self.staging.size,
            "ship_staging_free": self.staging.available(),
        }

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
