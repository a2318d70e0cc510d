"""The receiving end of span shipping (:mod:`.peers` says how the two ends work).

Two threads share it. The receiver's own thread owns the network: it reads hellos and
offers as they arrive, checks them, pulls each offered span's pages into staging pages
(a transfer is bounded only by the engine's timeout, ~30 s) and queues the pulled span.
The scheduler thread, in :meth:`Receiver.poll` (called when it matches prompts), takes
the queued spans: it reserves host slots in its tier, copies the staged pages there,
checks their digest on that copy, and records the span; the ack goes back through the
receiver's thread. So the scheduler never waits for a transfer, and a span pulled while
the scheduler was busy is there when the next prompt that pastes it is matched.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import sglang_relay.runtime.scale.ship.wire as wire
from sglang_relay.runtime.cache.host_rows import digest
from sglang_relay.runtime.cache.host_tier import HostCopy, HostTier
from sglang_relay.runtime.scale.ship.pages import Geometry, PoolAddress, transfer_lists
from sglang_relay.runtime.scale.ship.peers import (
    POLL_BATCH,
    endpoint,
    filed_namespace,
    max_frame_bytes,
    zmq_socket,
)
from sglang_relay.runtime.scale.ship.staging import Staging

logger = logging.getLogger(__name__)

MAX_PEERS = 256
QUARANTINE_S = 120.0  # staging of a failed pull: past Mooncake's transfer timeout (30 s)
WAIT_S = 0.05  # the receiver's thread wakes this often to send answers and check for close


@dataclass(slots=True)
class _Pulled:
    """A span whose pages the receiver's thread pulled into staging."""

    identity: bytes
    offer: wire.Offer
    namespace: tuple
    staged: torch.Tensor
    has_hidden: torch.Tensor
    moved: int  # bytes
    seconds: float


class Receiver:
    """Takes spans offered by the publishers ``publishers`` names (name -> tenant, or
    :data:`~.peers.ANY_NAMESPACE`) into this server's tier and store."""

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
        publishers: dict[str, str],
        staging_tokens: int,
        secret: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.tier, self.store, self.ledger, self.transport = tier, store, ledger, transport
        self.geometry = geometry
        self.secret = secret
        self.publishers = dict(publishers)
        self.vocab, self.max_position = vocab, max_position
        self.clock, self.wall = clock, wall
        self.seen: dict[str, float] = {}  # hello nonces of the replay window -> when seen
        self.staging = Staging(tier.host_pool, staging_tokens, geometry.page_size, clock)
        self.address = PoolAddress.of(self.staging)
        transport.register(self.address.base, self.address.nbytes)
        self.sock = zmq_socket(zmq.ROUTER, max_frame=max_frame_bytes(geometry, self.staging.size))
        self.sock.bind(endpoint(listen))
        # connection -> [its hello, its key, the number of the last offer taken]
        self.peers: dict[bytes, list] = {}
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # counters and staging: both threads
        self.pulled: queue.SimpleQueue[_Pulled] = queue.SimpleQueue()  # -> scheduler
        self.answers: queue.SimpleQueue[tuple[bytes, list[bytes]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="sglang-relay-ship", daemon=True)
        self.thread.start()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    # ---- the scheduler thread ---------------------------------------------------------------
    def poll(self) -> None:
        """Record the spans the receiver's thread pulled (never waits for a transfer)."""
        while True:
            try:
                pulled = self.pulled.get_nowait()
            except queue.Empty:
                return
            try:
                why = self._record(pulled)
            except Exception:  # noqa: BLE001 - a peer's span must never end the scheduler
                logger.exception("sglang-relay: recording a shipped span failed")
                why = "record_error"
            finally:
                with self._lock:
                    self.staging.free(pulled.staged)
            if not why:
                self._count("pull_bytes", pulled.moved)
                self._count("pull_ms", int(1000 * pulled.seconds))
            self._count(f"declined_{why}" if why else "received_spans")
            self.answers.put((pulled.identity, wire.ack(pulled.offer.span, not why, why)))

    def _record(self, pulled: _Pulled) -> str:
        """Copy the staged pages into reserved host slots, check them there, record the
        span; "" or why it was not recorded."""
        offer, span_id = pulled.offer, None
        local = self.tier.reserve(len(offer.host_idx))
        if local is None:
            return "no_host_room"
        try:
            self.staging.give(pulled.staged, self.tier.host_pool, local)
            if digest(self.tier.host_pool, local) != offer.digest:
                return "digest_mismatch"  # its pages changed before the read ended
            n = len(offer.tokens)
            device = self.ledger.stamps.device
            context = offer.side.get("context")
            copy = HostCopy(
                host_idx=local,
                offsets=torch.tensor(offer.offsets, dtype=torch.int64),
                has_hidden=pulled.has_hidden,
                hidden=offer.side.get("hidden"),
                influence=offer.side.get("influence"),
                last_use=self.clock(),
                digest=offer.digest,
            )
            span_id = self.store.add(
                offer.tokens,
                torch.zeros(n, dtype=torch.int64, device=device),  # no device slots: host only
                torch.arange(offer.start, offer.start + n, dtype=torch.int64, device=device),
                torch.full((n,), -1, dtype=torch.int64, device=device),  # no slot has stamp -1
                pulled.namespace,
                context=None if context is None else context.to(device),
                answer_start=offer.answer_start,
                host_copy=copy,
            )
            return "" if span_id is not None else "too_short"
        finally:
            if span_id is None or not self.tier.has(span_id):
                self.tier.host_pool.free(local)

    # ---- the receiver's thread --------------------------------------------------------------
    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._send_answers()
                if poller.poll(int(WAIT_S * 1000)):
                    self._read()
            except Exception:  # noqa: BLE001 - the thread outlives any one message
                self._count("receive_errors")
                logger.exception("sglang-relay: the ship receiver's loop failed")
                time.sleep(WAIT_S)

    def _send_answers(self) -> None:
        import zmq

        while True:
            try:
                identity, message = self.answers.get_nowait()
            except queue.Empty:
                return
            try:
                self.sock.send_multipart([identity, *message], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self._count("answers_dropped")

    def _read(self) -> None:
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
                    self._hello(identity, header)
                elif header["kind"] == "offer":
                    self._offer(identity, header, frames)
                else:
                    raise wire.BadMessage(f"a receiver takes no {header['kind']}")
            except wire.BadMessage as exc:
                self._count("bad_messages")
                logger.warning("sglang-relay: a ship message was dropped: %s", exc)
            except Exception:  # noqa: BLE001 - a peer's message must never end the receiver
                self._count("receive_errors")
                logger.exception("sglang-relay: taking a shipped span failed")

    def _hello(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            hello = wire.read_hello(header, self.secret, self.wall(), self.seen)
            why = wire.hello_refusal(hello, self.geometry.to_dict())
            if why is None and hello.name not in self.publishers:
                why = (f"publisher {hello.name} is not in this receiver's "
                       "SGLANG_RELAY_SHIP_PUBLISHERS")  # fmt: skip
        except wire.BadMessage as exc:  # unsigned, wrong key, stale or replayed
            hello, why = None, str(exc)
        if why is not None:
            self._count("peers_refused")
            name = getattr(hello, "name", "unauthenticated")
            logger.warning("sglang-relay: refused a ship publisher (%s): %s", name, why)
            self.answers.put((identity, wire.refuse(why)))
            return
        if identity not in self.peers and len(self.peers) >= MAX_PEERS:
            self.peers.pop(next(iter(self.peers)))  # the oldest connection
        self.peers[identity] = [hello, wire.session_key(hello.key, hello.nonce), 0]
        with self._lock:
            self.counters["peers"] = len(self.peers)

    def _offer(self, identity: bytes, header: dict[str, Any], frames: list[bytes]) -> None:
        peer = self.peers.get(identity)
        if peer is None:  # a connection this receiver does not know (it restarted)
            self._count("offers_before_hello")
            self.answers.put((identity, wire.refuse("hello first", resend_hello=True)))
            return
        hello, key, last_seq = peer
        seq, offer = wire.read_offer(
            header, frames, key=key, last_seq=last_seq, vocab=self.vocab,
            max_position=self.max_position, hidden=self.geometry.hidden,
        )  # fmt: skip
        peer[2] = seq
        why = self._pull(identity, hello, offer)
        if why:
            self._count(f"declined_{why}")
            self.answers.put((identity, wire.ack(offer.span, False, why)))

    def _pull(self, identity: bytes, peer: wire.Hello, offer: wire.Offer) -> str:
        """Check ``offer``, pull its pages into staging and queue it for the scheduler
        (""), or why it is declined."""
        namespace = filed_namespace(self.publishers[peer.name], offer.namespace)
        if namespace is None:
            return "namespace_mismatch"
        idx = torch.tensor(offer.host_idx, dtype=torch.int64)
        ps = self.geometry.page_size
        pages = idx.view(-1, ps) if idx.numel() % ps == 0 else None
        if pages is None or not torch.equal(
            pages, pages[:, :1] - pages[:, :1] % ps + torch.arange(ps)
        ):
            raise wire.BadMessage("host_idx: whole aligned pages expected")
        if int(idx.max()) >= peer.size:
            raise wire.BadMessage("host_idx: inside the publisher's staging expected")
        has_hidden = self._check_side(offer)
        with self._lock:
            staged = self.staging.alloc(idx.numel())
        if staged is None:  # the scheduler has not taken what was pulled before
            return "no_staging_room"
        t0 = self.clock()
        a = self.address
        remote = PoolAddress(a.layout, peer.base, peer.size, a.layer_num, a.row_bytes)
        lists = transfer_lists(a, staged, remote, idx)
        self._count("pulls")
        try:
            moved = self.transport.read(peer.session, *lists)
        except Exception:  # noqa: BLE001 - counted below
            logger.exception("sglang-relay: pulling a shipped span failed")
            moved = False
        if not moved:  # a late write may still land: the pages wait past the timeout
            with self._lock:
                self.staging.quarantine(staged, QUARANTINE_S)
            return "transfer_failed"
        seconds = self.clock() - t0
        self.pulled.put(_Pulled(identity, offer, namespace, staged, has_hidden,
                                sum(lists[2]), seconds))  # fmt: skip
        return ""

    def _check_side(self, offer: wire.Offer) -> torch.Tensor:
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
        return has_hidden

    # ---- either ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters)
            free = self.staging.available()
        return {f"ship_{k}": v for k, v in counters.items()} | {
            "ship_role": "receiver",
            "ship_pulled_waiting": self.pulled.qsize(),
            "ship_staging_tokens": self.staging.size,
            "ship_staging_free": free,
        }

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=60)
        self.sock.close(0)
