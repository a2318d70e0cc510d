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
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import sglang_relay.runtime.ship.wire as wire
from sglang_relay.runtime.host_tier import HostCopy, HostTier
from sglang_relay.runtime.ship.pages import Geometry, PoolAddress, digest, transfer_lists

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 512 << 20
POLL_BATCH = 64


def _socket(kind: int) -> Any:
    import zmq

    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 1000)
    return sock


def _endpoint(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a ship address is HOST:PORT; got {address!r}")
    return f"tcp://{host}:{port}"


class Publisher:
    """Offers recorded spans to receivers (``peers``: HOST:PORT of each)."""

    def __init__(
        self,
        *,
        tier: HostTier,
        store: Any,
        transport: Any,
        peers: list[str],
        geometry: Geometry,
        lease: float = 60.0,
    ) -> None:
        import zmq

        self.tier, self.store, self.transport = tier, store, transport
        self.lease = lease
        self.address = PoolAddress.of(tier.host_pool)
        transport.register(self.address.base, self.address.nbytes)
        self.counters: Counter[str] = Counter()
        self.pending: dict[int, int] = {}  # span id -> receivers yet to answer
        self.sockets = []
        for peer in peers:
            sock = _socket(zmq.DEALER)
            sock.connect(_endpoint(peer))
            sock.send_multipart(
                wire.hello(transport.session, self.address.base, self.address.size,
                           geometry.to_dict())
            )  # fmt: skip
            self.sockets.append(sock)

    def offer(self, span_id: int, tokens: list[int]) -> None:
        """Offer span ``span_id`` (just recorded, of ``tokens``) to every receiver."""
        import zmq

        span = self.store.spans.get(span_id)
        copy = self.tier.lease(span_id, self.lease) if span is not None else None
        if copy is None:  # too long for the tier, or its copy failed
            self.counters["offers_without_host_copy"] += 1
            return
        side = {"has_hidden": copy.has_hidden, "hidden": copy.hidden,
                "influence": copy.influence, "context": span.context}  # fmt: skip
        message = wire.offer(
            span_id, [int(t) for t in tokens], int(span.positions[0]),
            tuple(span.namespace), span.answer_start, copy.host_idx.tolist(),
            copy.offsets.tolist(), digest(self.tier.host_pool, copy.host_idx), side,
        )  # fmt: skip
        sent = 0
        for sock in self.sockets:
            try:
                sock.send_multipart(message, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                self.counters["offers_dropped_queue_full"] += 1
        self.counters["offers"] += 1
        if sent:
            self.pending[span_id] = sent
        else:
            self.tier.end_lease(span_id)
        self.poll()

    def poll(self) -> None:
        """Read the receivers' answers: an ack ends the lease once every receiver answered."""
        import zmq

        for sock in self.sockets:
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
                if header["kind"] == "refuse":
                    self.counters["refused_by_receiver"] += 1
                    logger.warning("sglang-relay: a ship receiver refused: %s", header.get("why"))
                elif header["kind"] == "ack" and type(header.get("span")) is int:
                    self._answered(header["span"], bool(header.get("ok")))

    def _answered(self, span_id: int, ok: bool) -> None:
        self.counters["acks_taken" if ok else "acks_declined"] += 1
        left = self.pending.get(span_id)
        if left is None:
            return
        if left > 1:
            self.pending[span_id] = left - 1
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import zmq

        self.tier, self.store, self.ledger, self.transport = tier, store, ledger, transport
        self.geometry = geometry
        self.vocab, self.max_position = vocab, max_position
        self.clock = clock
        self.address = PoolAddress.of(tier.host_pool)
        transport.register(self.address.base, self.address.nbytes)
        self.sock = _socket(zmq.ROUTER)
        self.sock.bind(_endpoint(listen))
        self.peers: dict[bytes, wire.Hello] = {}
        self.counters: Counter[str] = Counter()

    def poll(self) -> None:
        import zmq

        for _ in range(POLL_BATCH):
            try:
                identity, *parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # no identity frame
                continue
            try:
                header, frames = wire.decode(parts)
                if header["kind"] == "hello":
                    self._hello(identity, wire.read_hello(header))
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

    def _hello(self, identity: bytes, hello: wire.Hello) -> None:
        mine = self.geometry.to_dict()
        if hello.geometry != mine:
            diff = sorted(k for k in mine if hello.geometry.get(k) != mine[k])
            self.counters["peers_refused"] += 1
            why = f"geometry differs in {', '.join(diff) or 'its fields'}"
            logger.warning("sglang-relay: refused a ship publisher (%s): %s", hello.session, why)
            self._send(identity, wire.refuse(why))
            return
        self.peers[identity] = hello
        self.counters["peers"] = len(self.peers)

    def _offer(self, identity: bytes, header: dict[str, Any], frames: list[bytes]) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            raise wire.BadMessage("an offer from a publisher that said no hello")
        offer = wire.read_offer(
            header, frames, vocab=self.vocab, max_position=self.max_position,
            hidden=self.geometry.hidden,
        )  # fmt: skip
        ok, why = self._take(peer, offer)
        self.counters["received_spans" if ok else f"declined_{why}"] += 1
        self._send(identity, wire.ack(offer.span, ok, why))

    def _take(self, peer: wire.Hello, offer: wire.Offer) -> tuple[bool, str]:
        g = self.geometry
        if len(offer.host_idx) % g.page_size or max(offer.host_idx) >= peer.size:
            raise wire.BadMessage("host_idx: whole pages inside the publisher's pool expected")
        has_hidden = offer.side["has_hidden"]
        hidden = offer.side.get("hidden")
        if (hidden is None) != (self.ledger.hidden is None) or (
            hidden is None and bool(has_hidden.any())
        ):
            raise wire.BadMessage("hidden rows: present exactly when the server stores them")
        if hidden is not None and hidden.dtype != self.ledger.hidden.dtype:
            raise wire.BadMessage(f"hidden rows: {self.ledger.hidden.dtype} expected")
        influence = offer.side.get("influence")
        if (influence is None) != (self.ledger.influence is None):
            raise wire.BadMessage("influence: present exactly when the server keeps it")
        local = self.tier.reserve(len(offer.host_idx))
        if local is None:
            return False, "no_host_room"
        remote = PoolAddress(g.layout, peer.base, peer.size, self.address.layer_num,
                             self.address.row_bytes)  # fmt: skip
        t0 = self.clock()
        try:
            lists = transfer_lists(self.address, local, remote, torch.tensor(offer.host_idx))
            moved = self.transport.read(peer.session, *lists)
        except Exception:  # noqa: BLE001 - counted below
            logger.exception("sglang-relay: pulling a shipped span failed")
            moved = False
        if not moved:
            self.tier.host_pool.free(local)
            return False, "transfer_failed"
        if digest(self.tier.host_pool, local) != offer.digest:
            self.tier.host_pool.free(local)  # its pages changed before the read ended
            return False, "digest_mismatch"
        self.counters["pull_bytes"] += sum(lists[2])
        self.counters["pull_ms"] += int(1000 * (self.clock() - t0))
        n = len(offer.tokens)
        device = self.ledger.stamps.device
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
            torch.zeros(n, dtype=torch.int64, device=device),  # no device slots: on host only
            torch.arange(offer.start, offer.start + n, dtype=torch.int64, device=device),
            torch.full((n,), -1, dtype=torch.int64, device=device),  # no slot has stamp -1
            offer.namespace,
            context=offer.side.get("context"),
            answer_start=offer.answer_start,
            host_copy=copy,
        )
        if span_id is None:
            self.tier.host_pool.free(local)
            return False, "too_short"
        return True, ""

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
