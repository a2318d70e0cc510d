"""Recorded output spans: their tokens, KV slots, original positions, and validity.

A span is the decoded output of a finished request. Its KV stays in the pool as long as
the radix tree keeps it; the tree may evict it at any time. Validity is tracked per slot:
``owner[slot]`` holds the id of the span whose KV the slot carries, and is reset to -1 the
moment the allocator frees the slot (:meth:`SpanStore.on_free`). Span ids are never
reused, so ``owner[src] == span_id`` proves that the KV is still the span's own, even if
the slot was freed and reallocated in between.

Not thread-safe: the scheduler thread owns it (like the radix tree).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_relay.core.span_index import SpanIndex


@dataclass(slots=True)
class Span:
    span_id: int
    namespace: Hashable
    slots: torch.Tensor  # [n] int64, KV pool slots (device of the pool)
    positions: torch.Tensor  # [n] int64, positions the KV was computed at
    num_tokens: int
    owned: bool = False  # the store (not the radix tree) holds these slots


class SpanSource(NamedTuple):
    """A matched run: ``length`` tokens of span ``span_id`` starting at ``span_start``."""

    span_id: int
    prompt_start: int
    span_start: int
    length: int
    slots: torch.Tensor  # [length] int64
    positions: torch.Tensor  # [length] int64


class SpanStore:
    """Token-budgeted LRU of spans plus the slot-owner map used to validate them.

    Most spans reference KV that the radix tree owns. Spans of requests whose prefill was
    itself relayed are *owned*: their KV is kept out of the tree (it was computed over
    approximate context), so the store holds the slots and gives them back through
    ``free_slots`` when the span is dropped (LRU budget or eviction).
    """

    def __init__(
        self,
        pool_slots: int,
        device: torch.device | str,
        *,
        min_match: int,
        max_tokens: int,
        free_slots: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if max_tokens <= 0:
            raise ValueError(f"span token budget must be > 0; got {max_tokens}")
        # max_bucket: skip anchor grams shared by > 64 places (common boilerplate), see SpanIndex
        self.index = SpanIndex(min_match=min_match, anchor=max(1, min_match // 2), max_bucket=64)
        self.spans: OrderedDict[int, Span] = OrderedDict()  # LRU order, oldest first
        self.owner = torch.full((pool_slots,), -1, dtype=torch.int64, device=device)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.owned_tokens = 0
        self.free_slots = free_slots
        self._next_id = 1

    # ---- recording ------------------------------------------------------------------
    def claim(self, slots: torch.Tensor) -> int:
        """Reserve a new span id and mark ``slots`` as carrying its KV. Call before the
        tree takes (or frees) the slots, then :meth:`commit` or drop the id."""
        span_id = self._next_id
        self._next_id += 1
        self.owner[slots] = span_id
        return span_id

    def commit(
        self,
        span_id: int,
        tokens: list[int],
        slots: torch.Tensor,
        positions: torch.Tensor,
        namespace: Hashable,
        *,
        owned: bool = False,
    ) -> bool:
        """Record the span if all its slots still carry its KV; returns whether it did.
        With ``owned`` the caller hands the slots over to the store (only on success)."""
        if len(tokens) < self.index.min_match or not self.slots_valid(span_id, slots):
            return False
        if owned and self.free_slots is None:
            return False
        self.index.add(span_id, tokens, namespace)
        self.spans[span_id] = Span(span_id, namespace, slots, positions, len(tokens), owned)
        self.num_tokens += len(tokens)
        self.owned_tokens += len(tokens) if owned else 0
        while self.num_tokens > self.max_tokens and len(self.spans) > 1:
            self.drop(next(iter(self.spans)))
        return True

    def drop(self, span_id: int, *, release: bool = True) -> int:
        """Forget a span; an owned span's slots go back to the allocator (``release``).
        Returns the number of slots released."""
        span = self.spans.pop(span_id, None)
        if span is None:
            return 0
        self.index.remove(span_id)
        self.num_tokens -= span.num_tokens
        if not span.owned:
            return 0
        self.owned_tokens -= span.num_tokens
        if release and self.free_slots is not None:
            self.free_slots(span.slots)
            return span.num_tokens
        return 0

    def release_owned(self, num_tokens: int) -> int:
        """Drop owned spans, least recently used first, until ``num_tokens`` slots are
        released (or none is left). Returns the number released."""
        released = 0
        for span_id in [sid for sid, sp in self.spans.items() if sp.owned]:
            if released >= num_tokens:
                break
            released += self.drop(span_id)
        return released

    def clear(self, *, release: bool = True) -> None:
        for span_id in list(self.spans):
            self.drop(span_id, release=release)
        self.owner.fill_(-1)

    # ---- validity -------------------------------------------------------------------
    def on_free(self, slots: torch.Tensor) -> None:
        """Allocator hook: these slots no longer carry any span's KV."""
        if slots.numel():
            self.owner[slots.to(self.owner.device, torch.int64)] = -1

    def slots_valid(self, span_id: int, slots: torch.Tensor) -> bool:
        return bool((self.owner[slots] == span_id).all())

    # ---- lookup ---------------------------------------------------------------------
    def find(self, tokens: list[int], namespace: Hashable) -> list[SpanSource]:
        """Matched runs of recorded spans inside ``tokens`` (same namespace only)."""
        out = []
        for m in self.index.find(tokens, namespace):
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
                )
            )
        return out

    def stats(self) -> dict[str, int]:
        return {
            "spans": len(self.spans),
            "span_tokens": self.num_tokens,
            "owned_span_tokens": self.owned_tokens,
            "span_token_budget": self.max_tokens,
        }
