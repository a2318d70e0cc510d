"""The two ends of span shipping: a :class:`Publisher` on the server that decodes an
agent's output (a PD decode server), a :class:`Receiver` on the server that prefills the
next agent's prompt (a PD prefill server).

The publisher offers each span it records (and backed up to its host tier) to every
receiver it was pointed at, leasing the host copy meanwhile; a receiver checks the offer,
reserves host slots in its own tier, pulls the pages through the transfer engine, checks
their digest, and records the span in its own store, with stamps no slot ever has (its KV
is on host only). From there the receiver's planner treats it as any span whose device
slots are gone: a related prompt has it copied into fresh device slots and relays it.
Acks end the publisher's lease; a lease also ends by itself after ``lease`` seconds.

Both run on the scheduler thread (as the host tier and the store): ``poll()`` is called
when the scheduler matches prompts, and a pull blocks it for the transfer (bounded by the
engine's timeout). A failed or refused transfer leaves nothing recorded (counted).
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
from sglang_relay.runtime.cache.host_tier import HostCopy, HostTier
from sglang_relay.runtime.scale.ship.pages import Geometry, PoolAddress, digest, transfer_lists

logger = logging.getLogger(__name__)

POLL_BATCH = 64  # messages read per poll
PULLS_PER_POLL = 8  # spans pulled per poll (each blocks the scheduler for its transfer)
MAX_PEERS = 256
QUARANTINE_S = 120.0  # slots of a failed pull: past Mooncake's transfer timeout (30 s)


def _socket(kind: int, *, max_frame: int) -> Any:
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


def _endpoint(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a ship address is HOST:PORT; got {address!r}")
    return f"tcp://{host}:{port}"


class Publisher:
    """Offers recorded spans to receivers (``peers``: HOST:PORT of each)."""

    role = "publisher"

    def __init__(
        self,
        *,
        tier: HostTier,
        store: Any,
        transport: Any,
        peers: list[str],
        geometry: Geometry,
        lease: float = 60.0,
        secret: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.tier, self.store, self.transport = tier, store, transport
        self.lease = lease
        self.clock, self.wall = clock, wall
        self.secret = secret
        self.geometry = geometry
        self.address = PoolAddress.of(tier.host_pool)
        transport.register(self.address.base, self.address.nbytes)
        self.counters: Counter[str] = Counter()
        # span id -> (receivers yet to answer, when the lease ends)
        self.pending: dict[int, tuple[int, float]] = {}
        self.keys: dict[int, bytes] = {}  # receiver -> its connection's key (its hello's)
        self.seq = 0  # offers are numbered across connections, never reused
        self.sockets = []
        self.refused: set[int] = set()  # receivers that refused this publisher
        frame = max_frame_bytes(geometry, tier.capacity)
        for i, peer in enumerate(peers):
            sock = _socket(zmq.DEALER, max_frame=frame)
            # one identity per connection across reconnects: the receiver knows it
            sock.setsockopt(zmq.ROUTING_ID, f"{transport.session}/{i}".encode())
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a receiver not connected
            sock.connect(_endpoint(peer))
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
            hello = wire.hello(self.transport.session, a.base, a.size, self.geometry.to_dict(),
                               self.secret, nonce, self.wall())  # fmt: skip
            try:
                sock.send_multipart(hello, flags=zmq.NOBLOCK)
                self.greeted.add(i)
                self.keys[i] = wire.session_key(self.secret, nonce)
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
        copy = self.tier.lease(span_id, self.lease) if span is not None else None
        if copy is None:  # too long for the tier, or its copy failed
            self.counters["offers_without_host_copy"] += 1
            return
        side = {"has_hidden": copy.has_hidden, "hidden": copy.hidden,
                "influence": copy.influence, "context": span.context}  # fmt: skip
        fields = (
            span_id, [int(t) for t in tokens], int(span.positions[0]),
            tuple(span.namespace), span.answer_start, copy.host_idx.tolist(),
            copy.offsets.tolist(), digest(self.tier.host_pool, copy.host_idx), side,
        )  # fmt: skip
        sent = 0
        self._greet()
        for i, sock in enumerate(self.sockets):
            if i in self.refused or i not in self.greeted:
                self.counters["offers_not_sent"] += int(i not in self.refused)
                continue
            self.seq += 1
            message = wire.offer(self.keys[i], self.seq, *fields)
            try:
                sock.send_multipart(message, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # not connected, or its queue is full
                self.counters["offers_not_sent"] += 1
        self.counters["offers"] += 1
        if sent:
            self.pending[span_id] = (sent, self.clock() + self.lease)
        else:
            self.tier.end_lease(span_id)

    def poll(self) -> None:
        """Read the receivers' answers: an ack ends the lease once every receiver answered.
        Never raises (the scheduler calls it while matching prompts)."""
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
        now = self.clock()
        for span_id in [k for k, (_, end) in self.pending.items() if end <= now]:
            del self.pending[span_id]  # the lease ended by itself
            self.counters["offers_unanswered"] += 1

    def _answered(self, span_id: int, ok: bool) -> None:
        self.counters["acks_taken" if ok else "acks_declined"] += 1
        left, end = self.pending.get(span_id, (0, 0.0))
        if left == 0:
            return
        if left > 1:
            self.pending[span_id] = (left - 1, end)
            return
        del self.pending[span_id]
        self.tier.end_lease(span_id)

    def stats(self) -> dict[str, Any]:
        return {f"ship_{k}": v for k, v in self.counters.items()} | {
            "ship_role": "publisher",
            "ship_peers": len(self.sockets),
            "ship_pending": len(self.pending),
        }

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)


class Receiver:
    """Takes spans offered by publishers into this server's tier and store."""

    role = "receiver"

    def __init__(
        self,
        *,
        tier: HostTier,
        store: Any,
        ledger: Any,
        transport: Any,
        listen: str,
        geometry: Geometry,
        vocab: int,
        max_position: int,
        secret: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.tier, self.store, self.ledger, self.transport = tier, store, ledger, transport
        self.geometry = geometry
        self.secret = secret
        self.vocab, self.max_position = vocab, max_position
        self.clock, self.wall = clock, wall
        self.seen: dict[str, float] = {}  # hello nonces of the replay window -> when seen
        self.address = PoolAddress.of(tier.host_pool)
        transport.register(self.address.base, self.address.nbytes)
        self.sock = _socket(zmq.ROUTER, max_frame=max_frame_bytes(geometry, tier.capacity))
        self.sock.bind(_endpoint(listen))
        # connection -> [its hello, its key, the number of the last offer taken]
        self.peers: dict[bytes, list] = {}
        self.counters: Counter[str] = Counter()
        self.pulls = 0  # in this poll

    def poll(self) -> None:
        import zmq

        self.pulls = 0
        for _ in range(POLL_BATCH):
            if self.pulls >= PULLS_PER_POLL:  # the rest wait in the socket for the next poll
                return
            try:
                identity, *parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # no identity frame
                continue
            try:
                header, frames = wire.decode(parts)
                if header["kind"] == "hello":
                    self._hello(identity, header)
                elif header["kind"] == "offer":
                    self._offer(identity, header, frames)
                else:
                    raise wire.BadMessage(f"a receiver takes no {header['kind']}")
            except wire.BadMessage as exc:
                self.counters["bad_messages"] += 1
                logger.warning("sglang-relay: a ship message was dropped: %s", exc)
            except Exception:  # noqa: BLE001 - a peer's message must never end the scheduler
                self.counters["receive_errors"] += 1
                logger.exception("sglang-relay: taking a shipped span failed")

    def _hello(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            hello = wire.read_hello(header, self.secret, self.wall(), self.seen)
            why = wire.hello_refusal(hello, self.geometry.to_dict())
        except wire.BadMessage as exc:  # unsigned, wrong secret, stale or replayed
            hello, why = None, str(exc)
        if why is not None:
            self.counters["peers_refused"] += 1
            session = getattr(hello, "session", "unauthenticated")
            logger.warning("sglang-relay: refused a ship publisher (%s): %s", session, why)
            self._send(identity, wire.refuse(why))
            return
        if identity not in self.peers and len(self.peers) >= MAX_PEERS:
            self.peers.pop(next(iter(self.peers)))  # the oldest connection
        self.peers[identity] = [hello, wire.session_key(self.secret, hello.nonce), 0]
        self.counters["peers"] = len(self.peers)

    def _offer(self, identity: bytes, header: dict[str, Any], frames: list[bytes]) -> None:
        peer = self.peers.get(identity)
        if peer is None:  # a connection this receiver does not know (it restarted)
            self.counters["offers_before_hello"] += 1
            self._send(identity, wire.refuse("hello first", resend_hello=True))
            return
        hello, key, last_seq = peer
        seq, offer = wire.read_offer(
            header, frames, key=key, last_seq=last_seq, vocab=self.vocab,
            max_position=self.max_position, hidden=self.geometry.hidden,
        )  # fmt: skip
        peer[2] = seq
        self.pulls += 1
        ok, why = self._take(hello, offer)
        self.counters["received_spans" if ok else f"declined_{why}"] += 1
        self._send(identity, wire.ack(offer.span, ok, why))

    def _take(self, peer: wire.Hello, offer: wire.Offer) -> tuple[bool, str]:
        g = self.geometry
        ps = g.page_size
        idx = torch.tensor(offer.host_idx, dtype=torch.int64)
        pages = idx.view(-1, ps) if idx.numel() % ps == 0 else None
        if pages is None or not torch.equal(
            pages, pages[:, :1] - pages[:, :1] % ps + torch.arange(ps)
        ):
            raise wire.BadMessage("host_idx: whole aligned pages expected")
        if int(idx.max()) >= peer.size:
            raise wire.BadMessage("host_idx: inside the publisher's pool expected")
        ledger = self.ledger
        has_hidden = offer.side["has_hidden"].to(ledger.stamps.device)
        hidden = offer.side.get("hidden")
        if (hidden is None) != (ledger.hidden is None) or (
            hidden is None and bool(has_hidden.any())
        ):
            raise wire.BadMessage("hidden rows: present exactly when the server stores them")
        if hidden is not None and hidden.dtype != ledger.hidden.dtype:
            raise wire.BadMessage(f"hidden rows: {ledger.hidden.dtype} expected")
        influence = offer.side.get("influence")
        if (influence is None) != (ledger.influence is None) or (
            influence is not None and influence.dtype != ledger.influence.dtype
        ):
            raise wire.BadMessage("influence: as the server keeps it expected")
        context = offer.side.get("context")
        if context is not None and context.dtype != torch.float32:
            raise wire.BadMessage("context: float32 expected")
        local = self.tier.reserve(len(offer.host_idx))
        if local is None:
            return False, "no_host_room"
        remote = PoolAddress(g.layout, peer.base, peer.size, self.address.layer_num,
                             self.address.row_bytes)  # fmt: skip
        t0 = self.clock()
        try:
            lists = transfer_lists(self.address, local, remote, idx)
            moved = self.transport.read(peer.session, *lists)
        except Exception:  # noqa: BLE001 - counted below
            logger.exception("sglang-relay: pulling a shipped span failed")
            moved = False
        if not moved:  # a late write may still land: the slots wait past the timeout
            self.tier.quarantine(local, QUARANTINE_S)
            return False, "transfer_failed"
        span_id = None
        try:
            if digest(self.tier.host_pool, local) != offer.digest:
                return False, "digest_mismatch"  # its pages changed before the read ended
            self.counters["pull_bytes"] += sum(lists[2])
            self.counters["pull_ms"] += int(1000 * (self.clock() - t0))
            n = len(offer.tokens)
            device = ledger.stamps.device
            copy = HostCopy(
                host_idx=local,
                offsets=torch.tensor(offer.offsets, dtype=torch.int64),
                has_hidden=has_hidden,
                hidden=hidden,
                influence=influence,
                last_use=self.clock(),
            )
            span_id = self.store.add(
                offer.tokens,
                torch.zeros(n, dtype=torch.int64, device=device),  # no device slots: host only
                torch.arange(offer.start, offer.start + n, dtype=torch.int64, device=device),
                torch.full((n,), -1, dtype=torch.int64, device=device),  # no slot has stamp -1
                offer.namespace,
                context=None if context is None else context.to(device),
                answer_start=offer.answer_start,
                host_copy=copy,
            )
            return (True, "") if span_id is not None else (False, "too_short")
        finally:
            if span_id is None or not self.tier.has(span_id):
                self.tier.host_pool.free(local)

    def _send(self, identity: bytes, message: list[bytes]) -> None:
        import zmq

        try:
            self.sock.send_multipart([identity, *message], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["answers_dropped"] += 1

    def stats(self) -> dict[str, Any]:
        return {f"ship_{k}": v for k, v in self.counters.items()} | {"ship_role": "receiver"}

    def close(self) -> None:
        self.sock.close(0)
