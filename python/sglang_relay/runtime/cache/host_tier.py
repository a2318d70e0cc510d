"""Spans that outlive device memory: a relay-owned host tier beside SGLang's HiCache.

With ``--enable-hierarchical-cache`` a relay server keeps a copy of each recorded span's
KV in host memory, with the side data the span needs (its stored hidden rows, influence
scores and which rows have them; its context masses stay on the span), in a host pool of
SGLang's own class and layout (``build_kv_host_pool``) moved by HiCache's own transfer
engine (``L2TransferEngine``). When the device slots a span was recorded on are gone (the
tree evicted and reused them, or SGLang took an owned span's slots back for room) and a
prompt pastes the span again, the planner has it copied back into fresh device slots,
which the span store then owns, and relays from there: a span evicted from the device is
demoted, not dropped.

The tier has its own pool, not HiCache's: the tree's acks pop every node id they carry,
and its host eviction cannot free slots it does not own.

Retention (:class:`Retention`): a copy no prompt used for ``ttl`` seconds is freed
(checked at every copy either way); when a new copy needs room, copies of spans a later
prompt already used give way first, least recently used first, then the rest, least
recently used first (priority ``unconsumed``; ``lru`` is plain LRU). A chain's next agent
is usually seconds away, so what it has not read yet is kept longest.

Under tensor parallelism every rank runs this tier on its own pools. What the ranks agree
on by construction (the index, the stamps, the device allocator) is never decided by the
tier's clock; a copy back, which allocates device slots, runs only when every rank can
run it (a MIN over the ranks), so a TTL that expired on one rank a moment before another
costs that relay, never the schedulers' agreement.

Not thread-safe: the scheduler thread owns it (like the radix tree).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_relay.runtime.cache.host_rows import digest
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.sglang.host import l2_transfer

logger = logging.getLogger(__name__)

PRIORITIES = ("unconsumed", "lru")


@dataclass(slots=True)
class HostCopy:
    """A span's KV and side rows in host memory."""

    host_idx: torch.Tensor  # host pool slots: the span's whole device pages, in page order
    offsets: torch.Tensor  # [n] int64: where token j sits in that block
    has_hidden: torch.Tensor  # [n] bool: the row came with a stored hidden state
    hidden: torch.Tensor | None  # [n, hidden] (host), the ledger's rows
    influence: torch.Tensor | None  # [n] float32 (host)
    last_use: float
    consumed: bool = False  # a later prompt matched the span
    # the KV digest a copy that arrived from a peer (span shipping) was taken with: checked
    # again before the copy goes back to the device (None: this server's own copy)
    digest: str | None = None


class Retention:
    """Which host copy gives way first (pure policy; the clock is passed in)."""

    def __init__(self, *, ttl: float, priority: str = "unconsumed") -> None:
        if ttl <= 0:
            raise ValueError(f"host-tier TTL must be > 0 seconds; got {ttl}")
        if priority not in PRIORITIES:
            raise ValueError(f"host-tier priority must be one of {PRIORITIES}; got {priority!r}")
        self.ttl = ttl
        self.priority = priority

    def victim(self, copies: OrderedDict[int, HostCopy], keep: int) -> tuple[int, str]:
        """(span id, why) of the copy to free next for room (the expired ones are freed
        before, :meth:`expired`); ``copies`` in LRU order (oldest first), ``keep`` never
        chosen. Raises ``LookupError`` when nothing else is held."""
        candidates = [(sid, c) for sid, c in copies.items() if sid != keep]
        if not candidates:
            raise LookupError("no host copy to free")
        if self.priority == "unconsumed":
            for sid, c in candidates:
                if c.consumed:
                    return sid, "lru_consumed"
        return candidates[0][0], "lru"

    def expired(self, copies: OrderedDict[int, HostCopy], now: float) -> list[int]:
        return [sid for sid, c in copies.items() if now - c.last_use > self.ttl]


class HostTier:
    """Host copies of recorded spans, and their way back into device slots.

    ``host_pool``: an SGLang host KV pool (``alloc``/``free`` in pages); ``kv_pool``: the
    served device pool; ``engine``: an ``L2TransferEngine``; ``indices(direction, host,
    device)``: the indices as the engine's io backend takes them for a ``"write"`` (device
    to host) or a ``"load"`` (SGLang's controller's own rules); ``load_fence()``: the event
    a load must wait for (SGLang's: the forward stream, which may still write reclaimed
    slots under overlap scheduling), or None; ``allocator``: the device slot allocator;
    ``make_room(n)``: ask the cache to evict ``n`` device slots; ``agree(flag)``: the MIN
    of ``flag`` over the TP ranks (None: one rank).

    Never raises out of :meth:`backup` or :meth:`restore`: a failed copy is logged,
    counted and undone (under TP, a copy back that failed on one rank is undone on all).
    """

    def __init__(
        self,
        *,
        host_pool: Any,
        kv_pool: Any,
        engine: Any,
        indices: Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        ledger: SlotLedger,
        allocator: Any,
        page_size: int,
        retention: Retention,
        make_room: Callable[[int], None] | None = None,
        agree: Callable[[bool], bool] | None = None,
        load_fence: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host_pool = host_pool
        self.kv_pool = kv_pool
        self.engine = engine
        self.indices = indices
        self.load_fence = load_fence
        self.ledger = ledger
        self.allocator = allocator
        self.page_size = page_size
        self.retention = retention
        self.make_room = make_room
        self.agree = agree
        self.clock = clock
        self.copies: OrderedDict[int, HostCopy] = OrderedDict()  # LRU order, oldest first
        self.counters: Counter[str] = Counter()

    @property
    def capacity(self) -> int:
        return int(self.host_pool.size)

    # ---- device -> host ------------------------------------------------------------------
    def backup(self, span_id: int, slots: torch.Tensor, stamps: torch.Tensor) -> bool:
        """Copy the KV of a span just recorded on ``slots`` (with ``stamps``) to host,
        freeing older copies by the retention order if the tier is full. False: it does
        not fit (counted)."""
        ps = self.page_size
        pages = torch.unique(slots // ps)  # sorted
        need = int(pages.numel()) * ps
        now = self.clock()
        self.sweep(now)
        host_idx = self._alloc(need, keep=span_id)
        if host_idx is None:
            self.counters["backups_declined_no_host"] += 1
            return False
        device_idx = (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)
        rows = slots.to(torch.int64)

        def on_host(side: torch.Tensor | None) -> torch.Tensor | None:
            return None if side is None else side[rows].to("cpu")

        try:
            self._copy_to_host(host_idx, device_idx)
            copy = HostCopy(
                host_idx=host_idx,
                offsets=(torch.searchsorted(pages, slots // ps) * ps + slots % ps).cpu(),
                has_hidden=SlotLedger.has_hidden(stamps).cpu(),
                hidden=on_host(self.ledger.hidden),
                influence=on_host(self.ledger.influence),
                last_use=now,
            )
        except Exception:  # noqa: BLE001 - recording a span must never fail a request
            logger.exception("sglang-relay: a span's copy to host failed; it stays device-only")
            self.host_pool.free(host_idx)
            self.counters["backup_errors"] += 1
            return False
        self.copies[span_id] = copy
        self.counters["backups"] += 1
        self.counters["backup_tokens"] += int(slots.numel())
        return True

    # ---- host -> device ------------------------------------------------------------------
    def restore(self, span_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Copy span ``span_id``'s KV back into fresh device slots, with its hidden rows,
        influence scores and fresh stamps carrying its hidden bits. Returns ``(slots,
        stamps, held_slots)`` (the token slots, their stamps, every slot allocated: whole
        pages), or None when the copy is gone or the device has no room on some rank."""
        self.sweep()  # a copy past the TTL is gone
        copy = self.copies.get(span_id)
        if copy is not None and copy.digest is not None and not self._intact(span_id, copy):
            copy = None
        have = copy is not None
        if self.agree is not None and not self.agree(have):
            self.counters["restores_declined_tp" if have else "restores_missed_no_copy"] += 1
            return None
        if copy is None:
            self.counters["restores_missed_no_copy"] += 1
            return None
        # every rank holds the copy: from here on, only state the ranks share decides
        device_idx = self._device_slots(int(copy.host_idx.numel()))
        if device_idx is None:
            self.counters["restores_declined_no_device"] += 1
            return None
        slots = None
        try:
            self._copy_to_device(copy.host_idx, device_idx)
            slots = device_idx[copy.offsets.to(device_idx.device)]
            self.ledger.restore(
                slots,
                copy.has_hidden.to(slots.device),
                hidden=copy.hidden,
                influence=copy.influence,
            )
        except Exception:  # noqa: BLE001 - planning goes on with standard prefill
            logger.exception("sglang-relay: copying a span back from host failed")
            slots = None
        done = slots is not None
        if self.agree is not None:
            done = self.agree(done)  # undone on every rank if it failed on one
        if not done:
            self.allocator.free(device_idx)  # (stamped by the load hook: nobody reads them)
            self.counters["restore_errors"] += 1
            return None
        copy.last_use = self.clock()
        self.copies.move_to_end(span_id)
        self.counters["restores"] += 1
        self.counters["restore_tokens"] += int(slots.numel())
        return slots, self.ledger.snapshot(slots), device_idx

    def _intact(self, span_id: int, copy: HostCopy) -> bool:
        """A copy that arrived from a peer still holds the KV it was taken with (else it
        is dropped, counted: the host memory changed under it)."""
        if digest(self.host_pool, copy.host_idx) == copy.digest:
            return True
        logger.warning("sglang-relay: a shipped span's host copy changed; it is dropped")
        self.counters["restores_declined_digest"] += 1
        self.discard(span_id)
        return False

    def _device_slots(self, need: int) -> torch.Tensor | None:
        available = self.allocator.available_size()
        if available < need and self.make_room is not None:
            self.make_room(need - available)
        return self.allocator.alloc(need) if self.allocator.available_size() >= need else None

    # ---- bookkeeping ---------------------------------------------------------------------
    def has(self, span_id: int) -> bool:
        return span_id in self.copies

    def touch(self, span_id: int) -> None:
        """A prompt matched the span: it is consumed, and recently used."""
        copy = self.copies.get(span_id)
        if copy is not None:
            copy.consumed = True
            copy.last_use = self.clock()
            self.copies.move_to_end(span_id)

    def discard(self, span_id: int) -> None:
        """The span is gone from the store: free its copy."""
        copy = self.copies.pop(span_id, None)
        if copy is not None:
            self.host_pool.free(copy.host_idx)

    # ---- span shipping (runtime/scale/ship): copies that arrive from a peer -----------------
    def reserve(self, tokens: int) -> torch.Tensor | None:
        """Host slots for a copy arriving from a peer (whole pages), making room by the
        retention order; None when it cannot fit (counted)."""
        self.sweep()
        host_idx = self._alloc(tokens, keep=-1)
        if host_idx is None:
            self.counters["receives_declined_no_host"] += 1
        return host_idx

    def adopt(self, span_id: int, copy: HostCopy) -> None:
        """A copy that arrived from a peer (on :meth:`reserve`'d slots) is span ``span_id``'s."""
        self.copies[span_id] = copy
        self.counters["received"] += 1
        self.counters["received_tokens"] += int(copy.offsets.numel())

    def clear(self) -> None:
        for span_id in list(self.copies):
            self.discard(span_id)

    def sweep(self, now: float | None = None) -> int:
        """Free the copies no prompt used for the TTL (returns how many)."""
        expired = self.retention.expired(self.copies, self.clock() if now is None else now)
        for span_id in expired:
            self.discard(span_id)
        self.counters["evicted_ttl"] += len(expired)
        return len(expired)

    def _alloc(self, need: int, *, keep: int) -> torch.Tensor | None:
        if need > self.capacity:
            return None
        freeable = sum(int(c.host_idx.numel()) for sid, c in self.copies.items() if sid != keep)
        if self.host_pool.available_size() + freeable < need:
            return None
        while self.host_pool.available_size() < need:
            try:
                victim, why = self.retention.victim(self.copies, keep)
            except LookupError:
                return None
            self.discard(victim)
            self.counters[f"evicted_{why}"] += 1
        return self.host_pool.alloc(need)

    def _copy_to_host(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> None:
        h, d = self.indices("write", host_idx, device_idx)
        done = self.engine.submit_device_to_host([l2_transfer(self.host_pool, self.kv_pool, h, d)])
        done.finish_event.synchronize()

    def _copy_to_device(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> None:
        h, d = self.indices("load", host_idx, device_idx)
        done = self.engine.submit_host_to_device(
            [l2_transfer(self.host_pool, self.kv_pool, h, d)],
            transfer_layer_id_max=int(self.kv_pool.layer_num),
            start_event=self.load_fence() if self.load_fence is not None else None,
        )
        done.finish_event.synchronize()

    def stats(self) -> dict[str, Any]:
        return {
            "host_spans": len(self.copies),
            "host_tokens": sum(int(c.host_idx.numel()) for c in self.copies.values()),
            "host_capacity_tokens": self.capacity,
            "host_ttl_s": self.retention.ttl,
            "host_priority": self.retention.priority,
            "host_side_bytes": sum(
                sum(t.numel() * t.element_size() for t in (c.hidden, c.influence) if t is not None)
                for c in self.copies.values()
            ),
            **{f"host_{k}": v for k, v in self.counters.items()},
        }
