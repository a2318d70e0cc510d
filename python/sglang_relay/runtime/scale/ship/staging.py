"""The only memory a shipping server exposes to the transfer engine: a staging region.

Mooncake's transfer port serves every address an engine registered to any peer that
reaches it, for reads and writes alike, without authentication. So neither end registers
its host pool: a publisher copies each span it offers into staging pages and offers
those; a receiver pulls into its own staging pages, copies them into host slots it
reserved, and checks the digest on that copy (the destination, after the copy: a write
into staging after the check cannot reach it). What a peer can reach is at most the
spans on offer, never the tier.

A :class:`Staging` looks like a ``layer_first`` host pool to the address code
(:class:`~.pages.PoolAddress`: ``kv_buffer``, ``layout``, ``size``, ``layer_num``,
``head_num``, ``head_dim``), whatever the host pool's own layout. Pages are handed out
whole and aligned; pages a failed transfer may still write are held back (quarantined)
for a while. Owned by the scheduler thread; a receiver's pull worker only writes pages
the scheduler handed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from sglang_relay.runtime.cache.host_rows import read_rows, write_rows


class Staging:
    """``tokens`` slots (whole pages of ``page_size``) of ``like``'s KV rows."""

    layout = "layer_first"

    def __init__(
        self, like: Any, tokens: int, page_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        pages = max(1, -(-int(tokens) // page_size))
        self.page_size = page_size
        self.size = pages * page_size
        self.layer_num = int(like.layer_num)
        self.head_num = int(like.head_num)
        self.head_dim = int(like.head_dim)
        shape = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=like.kv_buffer.dtype)
        self.clock = clock
        self.free_pages: list[int] = list(range(pages))
        self.held: list[tuple[torch.Tensor, float]] = []  # quarantined: (slots, until)

    @property
    def nbytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    def available(self) -> int:
        self._release_held()
        return len(self.free_pages) * self.page_size

    def alloc(self, slots: int) -> torch.Tensor | None:
        """``slots`` staging slots (a multiple of the page size), or None when full."""
        ps = self.page_size
        if slots <= 0 or slots % ps:
            raise ValueError(f"staging takes whole pages of {ps}; got {slots} slots")
        if self.available() < slots:
            return None
        pages = torch.tensor(sorted(self.free_pages[: slots // ps]), dtype=torch.int64)
        del self.free_pages[: slots // ps]
        return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)

    def free(self, idx: torch.Tensor) -> None:
        self.free_pages.extend(sorted({int(s) // self.page_size for s in idx.tolist()}))

    def quarantine(self, idx: torch.Tensor, seconds: float) -> None:
        """Slots a failed (or timed-out) transfer may still write: free after ``seconds``."""
        self.held.append((idx, self.clock() + seconds))

    def _release_held(self) -> None:
        now = self.clock()
        for idx, _ in [h for h in self.held if h[1] <= now]:
            self.free(idx)
        self.held = [h for h in self.held if h[1] > now]

    def take(self, pool: Any, pool_idx: torch.Tensor, idx: torch.Tensor) -> None:
        """Copy ``pool``'s rows at ``pool_idx`` into staging slots ``idx`` (same order)."""
        write_rows(self, idx, read_rows(pool, pool_idx))

    def give(self, idx: torch.Tensor, pool: Any, pool_idx: torch.Tensor) -> None:
        """Copy staging slots ``idx`` into ``pool``'s rows at ``pool_idx`` (same order)."""
        write_rows(pool, pool_idx, read_rows(self, idx))
