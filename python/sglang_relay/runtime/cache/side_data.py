"""Per-slot side data and the stamps that prove it (and the slot's KV) still belong together.

Validity is written, never inferred. Every forward of the served model stamps the KV slots
it writes (``out_cache_loc``) with a fresh generation, whatever the forward mode (extend,
decode, mixed, verify, a retracted request's re-prefill). The stamp's low bit says whether
the same forward also stored the hidden state entering ``l_start`` for that slot.

So a span needs no free hook: it remembers the stamps of its slots when it is recorded and
is valid exactly while ``stamps[slots]`` still equal them. Any path that frees a slot
(``free``, ``free_group_end``, ``restore_state``, segment frees, a future SGLang path)
followed by any forward that reuses it changes the stamp; a slot that was freed but not yet
rewritten still carries the span's KV, which is what a relay reads. The one premise is that
only model forwards write KV into slots, or a KV write outside them the ledger follows
(:meth:`SlotLedger.move`: speculative decoding compacts accepted tokens' KV with the pool's
``move_kv_cache``; HiCache's host-to-device copies stamp the slots they write first,
``plugin._before_host_load``); servers with other KV writers (disaggregated KV transfer,
HiCache storage backends) are refused at start-up (:mod:`sglang_relay.runtime.config.modes`).

Not thread-safe: the scheduler thread owns it (like the radix tree).
"""

from __future__ import annotations

import torch

HIDDEN_BIT = 1  # stamp bit: the hidden state at l_start was stored with this KV


class SlotLedger:
    """Stamps plus the hidden states (and influence scores) stored per KV slot.

    Tensors (device of the KV pool):
        stamps: ``[pool_slots]`` int64; ``generation << 1 | has_hidden``; 0 = never written.
        generation: ``[1]`` int64, advanced once per stamped forward.
        hidden: ``[pool_slots, hidden_size]`` model dtype, the residual stream entering
            ``l_start`` (None when no method of this server needs it).
        influence: ``[pool_slots]`` float32 attention mass received (None unless tau_inf).
    """

    def __init__(
        self,
        pool_slots: int,
        device: torch.device | str,
        *,
        hidden_size: int | None,
        dtype: torch.dtype,
        influence: bool = False,
    ) -> None:
        self.stamps = torch.zeros(pool_slots, dtype=torch.int64, device=device)
        self.hidden = (
            torch.zeros(pool_slots, hidden_size, dtype=dtype, device=device)
            if hidden_size is not None
            else None
        )
        self.influence = (
            torch.zeros(pool_slots, dtype=torch.float32, device=device) if influence else None
        )
        # the generation lives on the device and is advanced by tensor ops only, so a
        # captured decode graph (CUDA graph, the CPU graph runner) advances it on every
        # replay: a Python counter would be frozen into the graph as a constant
        self.generation = torch.zeros(1, dtype=torch.int64, device=device)

    # ---- writing (every forward) ---------------------------------------------------------
    def stamp(self, loc: torch.Tensor, *, with_hidden: bool) -> None:
        """The forward about to run writes KV into ``loc`` (``[n]`` slots); with
        ``with_hidden`` it also stores their hidden states (the caller writes them).
        Pure tensor ops without host syncs: safe inside captured graphs."""
        self.generation.add_(1)
        value = self.generation * 2 + (HIDDEN_BIT if with_hidden else 0)
        loc = loc.to(torch.int64)
        self.stamps.index_copy_(0, loc, value.expand(loc.shape[0]))

    def store_hidden(self, loc: torch.Tensor, stream: torch.Tensor) -> None:
        """Store ``stream`` (``[n, hidden]``) for ``loc``; call in the forward that stamped
        ``loc`` with ``with_hidden=True``."""
        assert self.hidden is not None
        self.hidden.index_copy_(0, loc.to(torch.int64), stream.to(self.hidden.dtype))

    def move(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """The pool copied the KV of slots ``src`` to slots ``tgt`` (``[n]`` each, pairs
        in order; SGLang's ``move_kv_cache``): each ``tgt`` slot now holds what its ``src``
        held, so it takes its hidden state and influence, and a fresh stamp with its
        hidden bit (a slot ``src`` never written stays unwritten at ``tgt``). Every side
        tensor is gathered before any is written, as the KV move does, so overlapping
        ``tgt``/``src`` are safe. Fresh, not copied, stamps: a span that recorded ``tgt``
        before can never see the moved KV as its own, whichever forward wrote ``src``.
        Pure tensor ops without host syncs."""
        tgt = tgt.reshape(-1).to(torch.int64)
        src = src.reshape(-1).to(torch.int64)
        old = self.stamps[src]
        rows = self.hidden[src] if self.hidden is not None else None
        mass = self.influence[src] if self.influence is not None else None
        if rows is not None:
            self.hidden.index_copy_(0, tgt, rows)
        if mass is not None:
            self.influence.index_copy_(0, tgt, mass)
        self.generation.add_(1)
        fresh = self.generation * 2 + (old & HIDDEN_BIT)
        self.stamps.index_copy_(0, tgt, torch.where(old != 0, fresh, torch.zeros_like(old)))

    def restore(
        self,
        loc: torch.Tensor,
        has_hidden: torch.Tensor,
        *,
        hidden: torch.Tensor | None = None,
        influence: torch.Tensor | None = None,
    ) -> None:
        """A span's KV was copied back into ``loc`` (``[n]`` slots) from host memory, with
        the side rows it was recorded with: each slot takes its row and a fresh stamp whose
        hidden bit is ``has_hidden`` (``[n]`` bool). Fresh, so no span recorded on these
        slots before reads the copy as its own."""
        loc = loc.to(torch.int64)
        if hidden is not None and self.hidden is not None:
            self.hidden.index_copy_(0, loc, hidden.to(self.hidden.device, self.hidden.dtype))
        if influence is not None and self.influence is not None:
            self.influence.index_copy_(0, loc, influence.to(self.influence.device))
        self.generation.add_(1)
        bits = has_hidden.to(torch.int64) if self.hidden is not None else torch.zeros_like(loc)
        self.stamps.index_copy_(0, loc, self.generation * 2 + bits)

    # ---- checking (record time and use time) -----------------------------------------------
    def snapshot(self, slots: torch.Tensor) -> torch.Tensor:
        """The stamps of ``slots`` now (``[n]`` int64, a copy)."""
        return self.stamps[slots].clone()

    def unchanged(self, slots: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: slot still holds the KV it held when ``snapshot`` was taken."""
        return self.stamps[slots] == snapshot

    @staticmethod
    def has_hidden(snapshot: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: the snapshot's KV came with a stored hidden state."""
        return (snapshot & HIDDEN_BIT).bool() & (snapshot != 0)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.stamps, self.hidden, self.influence)
            if t is not None
        )

    def reset(self) -> None:
        """``flush_cache``: forget every stamp (no span survives a flush)."""
        self.generation.add_(1)
        self.stamps.zero_()
