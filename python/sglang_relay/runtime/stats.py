"""What relay did for one request (``meta_info["relay"]``), as a typed object.

A request may be planned once per prefill chunk. Each chunk's figures are held apart
(:class:`ChunkUse`) until its forward has run: :meth:`RequestStats.commit` adds them,
:meth:`RequestStats.discard` forgets them and records why. So a fallback in a later chunk
leaves what earlier chunks really reused, and reports itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ChunkUse:
    """Span tokens one chunk's forward reuses (filled by the planner and the forward)."""

    spans: int = 0
    tokens: int = 0
    selected: int = 0
    recomputed_token_layers: int = 0
    first_position: int | None = None  # first relayed position in the request's row
    probe: str | None = None  # cfg.probe: "last_row" (ran), "no_last_row", "small_budget"
    answer_tokens: int = 0  # of ``tokens``: reasoning answers (cfg.answer_max_ratio)


@dataclass(slots=True)
class RequestStats:
    method: str
    num_layers: int = 0
    spans_matched: int = 0
    reused_tokens: int = 0
    selected_tokens: int = 0
    recomputed_token_layers: int = 0
    trimmed_tokens: int = 0  # matched tokens left out because their slots were not valid
    answer_tokens: int = 0  # of reused_tokens: reasoning answers, capped apart
    fallback: str | None = None
    probe: str | None = None  # the last chunk's probe (cfg.probe), as in ChunkUse
    point: dict[str, Any] | None = None  # the operating point (reuse target) it ran at
    relayed_from: int | None = None  # first relayed row position (exactness clamp)
    chunk: ChunkUse | None = field(default=None, repr=False)  # figures of the running chunk
    req: Any = field(default=None, repr=False)  # the scheduler's Req (meta_info goes there)
    # the run that ended the previous chunk: (span id, span offset after it, row position
    # after it, tokens of that occurrence so far), so the next chunk can continue it
    open_run: tuple[int, int, int, int] | None = field(default=None, repr=False)

    # ---- one chunk at a time ---------------------------------------------------------
    def begin_chunk(self) -> ChunkUse:
        self.chunk = ChunkUse()
        return self.chunk

    def commit(self) -> None:
        """The chunk's forward ran the relay path: its figures count."""
        c, self.chunk = self.chunk, None
        if c is None:
            return
        self.spans_matched += c.spans
        self.reused_tokens += c.tokens
        self.answer_tokens += c.answer_tokens
        self.selected_tokens += c.selected
        self.recomputed_token_layers += c.recomputed_token_layers
        if c.probe is not None:
            self.probe = c.probe
        if c.first_position is not None and (
            self.relayed_from is None or c.first_position < self.relayed_from
        ):
            self.relayed_from = c.first_position

    def discard(self, reason: str) -> None:
        """The chunk's forward ran standard prefill: nothing of it was reused."""
        self.chunk = None
        self.fallback = reason

    @property
    def reuse_rate(self) -> float:
        total = self.reused_tokens * self.num_layers
        return round(1.0 - self.recomputed_token_layers / total, 4) if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "spans_matched": self.spans_matched,
            "reused_tokens": self.reused_tokens,
            "selected_tokens": self.selected_tokens,
            "recomputed_token_layers": self.recomputed_token_layers,
            "reuse_rate": self.reuse_rate,
            "trimmed_tokens": self.trimmed_tokens,
            "fallback": self.fallback,
            **({"probe": self.probe} if self.probe is not None else {}),
            **({"answer_tokens": self.answer_tokens} if self.answer_tokens else {}),
            **({"operating_point": self.point} if self.point is not None else {}),
        }
