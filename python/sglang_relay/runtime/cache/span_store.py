"""Recorded output spans: their tokens, KV slots, original positions and slot stamps.

A span is the decoded output of a finished request. Its KV stays in the pool as long as
the radix tree keeps it; the tree may evict it at any time. A span keeps the stamps its
slots had when it was recorded (:class:`~sglang_relay.runtime.cache.side_data.SlotLedger`); the
planner compares them again where the span is used, so a slot that was freed and rewritten
by anyone, through any path, is never read as the span's KV.

Not thread-safe: the scheduler thread owns it (like the radix tree).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sglang_relay.core.span_index import SpanIndex, SpanMatch
from sglang_relay.runtime.cache.evicted import EvictedSpans


@dataclass(slots=True)
class Span:
    span_id: int
    namespace: Hashable
    slots: torch.Tensor  # [n] int64, KV pool slots (device of the pool)
    positions: torch.Tensor  # [n] int64, positions the KV was computed at
    stamps: torch.Tensor  # [n] int64, the slots' ledger stamps when recorded
    num_tokens: int
    owned: bool = False  # the store (not the radix tree) holds these slots
    # [n] float32 context mass per token (signal "context"), None when not computed
    context: torch.Tensor | None = None
    # offset of the answer: just after the model's reasoning end marker (0: none)
    answer_start: int = 0
    # pool slots an owned span holds: its tokens, rounded out to whole pages of a paged
    # allocator (the first page's prompt tail, the last page's rest), and the slots whose
    # release gives them back (all of ``slots``, or the tail of a span whose aligned part
    # the tree holds)
    held: int = 0
    held_slots: torch.Tensor | None = None
    meta: int = 0  # bytes of the arrays above and the index's tokens (SpanStore.meta_bytes)


class SpanSource(NamedTuple):
    """A matched run: ``length`` tokens of span ``span_id`` starting at ``span_start``."""

    span_id: int
    prompt_start: int
    span_start: int
    length: int
    slots: torch.Tensor  # [length] int64
    positions: torch.Tensor  # [length] int64
    stamps: torch.Tensor  # [length] int64, recorded stamps of ``slots``
    context: torch.Tensor | None = None  # [length] float32 context masses, if recorded


class SpanStore:
    """Token-budgeted LRU of recorded spans and their index.

    Most spans reference KV that the radix tree owns. Spans of requests whose prefill was
    itself relayed are *owned*: their KV is kept out of the tree (it was computed over
    approximate context), so the store holds the slots and hands them back through
    ``release_slots`` when the span is dropped (LRU budget or eviction).

    Paired verbs: :meth:`add` / :meth:`drop`; :meth:`release_owned` drops owned spans for
    room; :meth:`clear` drops everything.

    With a host tier (:class:`~sglang_relay.runtime.cache.host_tier.HostTier`, under HiCache)
    every span is copied to host when recorded; an owned span whose slots SGLang needs, or
    that the device budget pushes out, is *demoted* (its slots go back, the span stays
    indexed), and :meth:`rehome` gives a span copied back into fresh slots to the store.
    The index then holds up to the device budget plus the tier's capacity. Which spans
    are indexed never depends on the host tier's state (only on what every TP rank shares).
    """

    def __init__(
        self,
        *,
        min_match: int,
        max_tokens: int,
        release_slots: Callable[[torch.Tensor], None],
        listener: Any = None,
    ) -> None:
        if max_tokens <= 0:
            raise ValueError(f"span token budget must be > 0; got {max_tokens}")
        # max_bucket: skip anchor grams shared by > 64 places (common boilerplate), see SpanIndex
        self.index = SpanIndex(min_match=min_match, anchor=max(1, min_match // 2), max_bucket=64)
        self.spans: OrderedDict[int, Span] = OrderedDict()  # LRU order, oldest first
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.owned_tokens = 0
        self.release_slots = release_slots
        # told of every add and drop (``added(span_id, tokens, namespace)``,
        # ``dropped_span(span_id)``) and asked to ``flush()`` what it could not send yet at
        # every look-up: the DP fingerprint publisher (:mod:`.dp_routing`)
        self.listener = listener
        self._next_id = 1
        self.scans = 0  # index look-ups (admission checks and plans)
        self.scans_truncated = 0  # ... that hit the index's work bound (see SpanIndex)
        self.reasoning_spans = 0  # spans recorded with a reasoning part before the answer
        self.pressure_spans = 0  # owned spans dropped because SGLang needed their slots
        self.pressure_tokens = 0  # ... and the slots they gave back
        self.tier: Any = None  # the host tier (HiCache servers; host_tier.HostTier)
        self.demoted_spans = 0  # owned spans whose slots went back, kept indexed (tier)
        self.demoted_tokens = 0
        self.evicted = EvictedSpans()  # what was dropped for room: pasting it is told so
        self._meta = 0  # running sum of the spans' ``meta`` (kept on add/rehome/drop)

    # ---- recording ------------------------------------------------------------------
    def add(
        self,
        tokens: list[int],
        slots: torch.Tensor,
        positions: torch.Tensor,
        stamps: torch.Tensor,
        namespace: Hashable,
        *,
        owned: bool = False,
        context: torch.Tensor | None = None,
        answer_start: int = 0,
        held: int | None = None,
        held_slots: torch.Tensor | None = None,
        host_copy: Any = None,
    ) -> int | None:
        """Record a span (``stamps``: its slots' stamps now; ``context``: its tokens'
        context masses, if the server ranks by them; ``answer_start``: where its answer
        begins after a reasoning part); returns its id, or None when it is too short to
        match. With ``owned`` the store takes the slots over (and releases them when the
        span is dropped); ``held``: how many pool slots that is (default: one per token;
        whole pages under a paged allocator, whose free gives back every page a slot is
        in); ``held_slots``: the slots to free for them (default: all of ``slots``; the
        tail's, when the tree holds the span's whole pages and the store its last partial
        one); ``host_copy``: the span's KV is on host only, in this copy (a span shipped
        from a peer server: its ``slots`` are placeholders, its ``stamps`` match none)."""
        if len(tokens) < self.index.min_match:
            return None
        span_id = self._next_id
        self._next_id += 1
        self.index.add(span_id, tokens, namespace)
        held = (len(tokens) if held is None else held) if owned else 0
        held_slots = (slots if held_slots is None else held_slots) if owned else None
        self.spans[span_id] = Span(
            span_id, namespace, slots, positions, stamps, len(tokens), owned, context,
            answer_start, held, held_slots,
        )  # fmt: skip
        self._measure(self.spans[span_id])
        self.reasoning_spans += int(answer_start > 0)
        self.num_tokens += len(tokens)
        self.owned_tokens += held
        if self.listener is not None:
            self.listener.added(span_id, tokens, namespace)
        if self.tier is not None and host_copy is not None:
            self.tier.adopt(span_id, host_copy)
        elif self.tier is not None:
            self.tier.backup(span_id, slots, stamps)
        self._within_budget(keep=span_id)
        return span_id

    def _within_budget(self, *, keep: int) -> None:
        """The budget bounds the tokens indexed and the pool slots held (a span's whole
        pages: at page 128 a short span holds far more slots than tokens). With a host
        tier, owned spans over the budget are demoted and the index also holds what the
        tier can hold."""
        if self.tier is not None:
            for span_id in [sid for sid, sp in self.spans.items() if sp.owned and sid != keep]:
                if self.owned_tokens <= self.max_tokens:
                    break
                self._demote(self.spans[span_id])
            indexed = self.max_tokens + int(self.tier.capacity)
        else:
            indexed = self.max_tokens
        while (self.num_tokens > indexed or self.owned_tokens > self.max_tokens) and len(
            self.spans
        ) > 1:
            self.drop(next(iter(self.spans)), evicted=True)

    def _give_back(self, span: Span) -> int:
        """An owned span's slots go back to the allocator; returns how many."""
        released = span.held
        self.release_slots(span.held_slots)
        self.owned_tokens -= released
        span.owned, span.held, span.held_slots = False, 0, None
        return released

    def _demote(self, span: Span) -> int:
        """Give an owned span's slots back, keeping it indexed (its host copy, if any,
        brings it back; until SGLang reuses the slots, their KV is still its own)."""
        released = self._give_back(span)
        self._measure(span)  # without ``held_slots`` now
        self.demoted_spans += 1
        self.demoted_tokens += released
        return released

    def rehome(
        self, span_id: int, slots: torch.Tensor, stamps: torch.Tensor, held_slots: torch.Tensor
    ) -> None:
        """Span ``span_id``'s KV was copied back into ``held_slots`` (whole pages; its
        tokens on ``slots``, stamped ``stamps``): the store owns them from now on (what it
        held of the span before goes back)."""
        span = self.spans[span_id]
        if span.owned:
            self._give_back(span)
        span.slots, span.stamps = slots, stamps
        span.owned, span.held, span.held_slots = True, int(held_slots.numel()), held_slots
        self._measure(span)
        self.owned_tokens += span.held
        self.spans.move_to_end(span_id)
        self._within_budget(keep=span_id)

    def drop(self, span_id: int, *, release: bool = True, evicted: bool = False) -> int:
        """Forget a span; an owned span's slots go back to the allocator (``release``);
        ``evicted``: dropped for room (remembered, :mod:`.evicted`). Returns the number of
        slots released."""
        span = self.spans.pop(span_id, None)
        if span is None:
            return 0
        if evicted:
            self.evicted.add(self.index.tokens(span_id).tolist(), span.namespace)
        self._meta -= span.meta
        self.index.remove(span_id)
        self.num_tokens -= span.num_tokens
        if self.listener is not None:
            self.listener.dropped_span(span_id)
        if self.tier is not None:
            self.tier.discard(span_id)
        if not span.owned:
            return 0
        if release:
            return self._give_back(span)
        self.owned_tokens -= span.held
        return 0

    def release_owned(self, num_tokens: int) -> int:
        """Drop owned spans (demote them, with a host tier), least recently used first,
        until ``num_tokens`` slots are released (or none is left). Returns the number
        released."""
        released = 0
        for span_id in [sid for sid, sp in self.spans.items() if sp.owned]:
            if released >= num_tokens:
                break
            if self.tier is not None:
                released += self._demote(self.spans[span_id])
            else:
                released += self.drop(span_id, evicted=True)
            self.pressure_spans += 1
        self.pressure_tokens += released
        return released

    def clear(self, *, release: bool = True) -> None:
        for span_id in list(self.spans):
            self.drop(span_id, release=release)
        self.evicted.clear()

    # ---- lookup ---------------------------------------------------------------------
    def matches(self, tokens: list[int], namespace: Hashable) -> list[SpanMatch]:
        """The index's matches in ``tokens`` (no LRU touch, no slots)."""
        if self.listener is not None:
            self.listener.flush()  # a request arrived: the controller has been reading
        matches = self.index.find(tokens, namespace)
        self.scans += 1
        self.scans_truncated += self.index.last_find_truncated
        return matches

    def span_length(self, span_id: int) -> int:
        return self.spans[span_id].num_tokens

    def answer_start(self, span_id: int) -> int:
        return self.spans[span_id].answer_start

    def find(self, tokens: list[int], namespace: Hashable) -> list[SpanSource]:
        """Matched runs of recorded spans inside ``tokens`` (same namespace only).
        Validity is the caller's to check (:class:`SlotLedger`), at use time."""
        out = []
        for m in self.matches(tokens, namespace):
            span = self.spans.get(m.span_id)
            if span is None:
                continue
            self.spans.move_to_end(m.span_id)  # LRU touch
            sl = slice(m.span_start, m.span_start + m.length)
            out.append(
                SpanSource(
                    m.span_id,
                    m.prompt_start,
                    m.span_start,
                    m.length,
                    span.slots[sl],
                    span.positions[sl],
                    span.stamps[sl],
                    None if span.context is None else span.context[sl],
                )
            )
        return out

    def _measure(self, span: Span) -> None:
        """(Re)count what ``span`` keeps per token into the running total: its ``slots``,
        ``positions`` and ``stamps`` (int64, on the pool's device), its ``context`` (float32,
        when recorded) and ``held_slots`` (a view of ``slots``, or a re-homed span's whole
        pages, which ``slots`` then views), each storage counted once, and the index's copy
        of its tokens (int64, host)."""
        arrays = (span.slots, span.positions, span.stamps, span.context, span.held_slots)
        storages = {t.untyped_storage() for t in arrays if t is not None}
        meta = sum({s.data_ptr(): s.nbytes() for s in storages}.values())
        meta += self.index.tokens(span.span_id).nbytes
        self._meta += meta - span.meta
        span.meta = meta

    def meta_bytes(self) -> int:
        """Bytes of the arrays the recorded spans keep, one entry per token
        (:meth:`_measure`), a running total: ``/get_server_info`` reads it without walking
        the spans. Not counted: the index's anchor entries (one Python dict entry per
        ``anchor`` tokens) and the Python objects around the arrays."""
        return self._meta

    def stats(self) -> dict[str, Any]:
        meta = self.meta_bytes()
        out: dict[str, Any] = {
            "spans": len(self.spans),
            "span_tokens": self.num_tokens,
            # what the recorded spans keep beside their KV (:meth:`meta_bytes`)
            "span_meta_bytes": meta,
            "span_meta_bytes_per_token": round(meta / self.num_tokens, 2) if self.num_tokens else 0,
            "owned_span_tokens": self.owned_tokens,
            "span_token_budget": self.max_tokens,
            "match_scans": self.scans,
            "match_scans_truncated": self.scans_truncated,
            "owned_spans_released_for_room": self.pressure_spans,
            "owned_tokens_released_for_room": self.pressure_tokens,
            "reasoning_spans": self.reasoning_spans,
            "evicted_spans_remembered": self.evicted.spans,
            "evicted_windows": len(self.evicted.windows),
        }
        if self.tier is not None:
            out.update(demoted_spans=self.demoted_spans, demoted_tokens=self.demoted_tokens)
            out.update(self.tier.stats())
        return out
