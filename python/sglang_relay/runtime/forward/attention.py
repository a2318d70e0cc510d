"""Relay-extend attention: a small registry of implementations with the same plan/run pair.

Active rows of a relay extend are not contiguous, so their attention is causal *by
position* over each request's whole context in the KV pool
(:func:`~sglang_relay.core.attention.positional_causal_attention` is the specification).
Each implementation is planned once per active-row set of a batch (the layers of a group
share it) and run once per layer:

* ``torch``: the pure-torch reference, per request (CPU, and the semantics tests use);
* ``triton``: one tiled Triton launch over all rows (``kernels/attention.py``);
* ``flashinfer``: one paged prefill with a custom mask (``kernels/flashinfer_extend.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_relay.core.attention import masked_attention, visible


@dataclass(frozen=True, slots=True)
class RowBatch:
    """The requests of one extend batch, as attention needs them (host lists).

    Attributes:
        row_starts: per request, its first batch row.
        seq_lens: per request, context length after this extend.
        slots: per request, ``[seq_len]`` KV slots by position (device).
        num_rows: rows of the batch.
    """

    row_starts: list[int]
    seq_lens: list[int]
    slots: list[torch.Tensor]
    num_rows: int

    def bounds(self, rows_cpu: torch.Tensor) -> list[int]:
        """Per request, the range of ``rows_cpu`` (sorted batch rows) it owns."""
        edges = torch.tensor([*self.row_starts, self.num_rows])
        return torch.searchsorted(rows_cpu, edges).tolist()


class ExtendAttention(ABC):
    """``plan`` once per active-row set, ``run`` once per layer. Neither writes KV."""

    name: str

    @abstractmethod
    def plan(self, batch: RowBatch, rows_cpu: torch.Tensor, positions: torch.Tensor) -> Any:
        """Prepare attention of ``rows_cpu`` (sorted batch rows, host) whose positions are
        ``positions`` (``[n]`` int64, device); returns a handle for :meth:`run`."""

    @abstractmethod
    def run(
        self,
        handle: Any,
        q: torch.Tensor,
        kbuf: torch.Tensor,
        vbuf: torch.Tensor,
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q``: ``[n, Hq, D]``; ``kbuf``/``vbuf``: the layer's ``[slots, Hkv, D]`` pool
        buffers (the rows' own K/V already written); ``window``: the layer's sliding window
        (keys a row sees, itself included; 0: none); ``sinks``: its ``[Hq]`` sink logits
        (:func:`~sglang_relay.core.attention.positional_causal_attention`). Returns
        ``[n, Hq, Dv]``."""

    def reset(self) -> None:  # noqa: B027 - optional for stateless implementations
        """A new batch begins (handles of the previous one are dead)."""


_REGISTRY: dict[str, Callable[[torch.device], ExtendAttention]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def build(name: str, device: torch.device) -> ExtendAttention:
    if name not in _REGISTRY:
        raise ValueError(f"unknown relay extend attention {name!r} (known: {sorted(_REGISTRY)})")
    return _REGISTRY[name](device)


@dataclass(frozen=True, slots=True)
class _Block:
    """Consecutive rows ``[lo, hi)`` of request ``req``, positions ``first..last``."""

    lo: int
    hi: int
    req: int
    first: int
    last: int


@register("torch")
class TorchAttention(ExtendAttention):
    """Per request, its rows in blocks of :attr:`BLOCK` on the CPU: a block reads the keys
    up to its last row's position only (in a sliding-window layer, from its first row's
    window on), so it skips most of what the causal mask hides, as a tiled kernel skips
    masked tiles (the CPU SDPA kernel computes every masked score: one mask over the whole
    context cost relay's rows 1.4-2.1x the attention a causal kernel spends on them,
    ``research/studies/blocked_attention_timing.py``). On a GPU (this implementation serves
    MLA models and backends without a relay kernel) a request's rows stay one block over
    its whole context, as before: each block would be a launch per layer (not measured
    there), and planning reads no positions back to the host. A block's mask is built at its first
    layer of each window and kept with the handle (one row set of one batch)."""

    BLOCK = 32

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, batch, rows_cpu, positions):
        bounds = batch.bounds(rows_cpu)
        spans = list(enumerate(zip(bounds[:-1], bounds[1:], strict=True)))
        if positions.device.type != "cpu":  # one block per request over its whole context
            blocks = [_Block(lo, hi, req, 0, batch.seq_lens[req] - 1)
                      for req, (lo, hi) in spans if hi > lo]  # fmt: skip
        else:
            pos, blocks = positions, []
            for req, (lo, hi) in spans:
                for a in range(lo, hi, self.BLOCK):
                    b = min(a + self.BLOCK, hi)
                    blocks.append(_Block(a, b, req, int(pos[a:b].min()), int(pos[a:b].max())))
        ends: dict[int, int] = {}  # per request with rows: its keys, to its last row's
        for blk in blocks:
            ends[blk.req] = max(ends.get(blk.req, 0), blk.last + 1)
        return blocks, positions, [batch.slots[r][:e] for r, e in sorted(ends.items())], {}

    def run(self, handle, q, kbuf, vbuf, scale, window=0, sinks=None):
        blocks, positions, slots, masks = handle
        out = q.new_empty((q.shape[0], q.shape[1], vbuf.shape[-1]))
        req, n, k, v = -1, -1, None, None
        for i, blk in enumerate(blocks):
            if blk.req != req:  # the next request with rows: its keys
                req, n = blk.req, n + 1
                k, v = kbuf[slots[n]], vbuf[slots[n]]
                if k.dtype != q.dtype:  # an FP8 / bf16 KV cache: its elements, unscaled
                    k, v = k.to(q.dtype), v.to(q.dtype)
            start = max(0, blk.first - window + 1) if window > 0 else 0
            mask = masks.get((i, window))
            if mask is None:  # positions from ``start`` on: keys start..last
                at = positions[blk.lo : blk.hi] - start
                mask = masks[(i, window)] = visible(at, blk.last + 1 - start, window)
            out[blk.lo : blk.hi] = masked_attention(
                q[blk.lo : blk.hi], k[start : blk.last + 1], v[start : blk.last + 1], mask,
                scale, sinks,
            )  # fmt: skip
        return out


@register("triton")
class TritonAttention(ExtendAttention):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, batch, rows_cpu, positions):
        from sglang_relay_kernels.attention import make_tiles

        bounds = batch.bounds(rows_cpu)
        counts = torch.tensor([hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)])
        offsets = torch.tensor([0, *batch.seq_lens[:-1]]).cumsum(0)
        kv_indices = torch.cat(batch.slots)
        kv_start = offsets.repeat_interleave(counts)  # host
        tiles = make_tiles(kv_start, device=positions.device)
        return positions, kv_start.to(positions.device), kv_indices, tiles

    def run(self, handle, q, kbuf, vbuf, scale, window=0, sinks=None):
        from sglang_relay_kernels.attention import positional_attention_triton

        positions, kv_start, kv_indices, tiles = handle
        return positional_attention_triton(
            q, kbuf, vbuf, positions, kv_start, kv_indices, scale, tiles=tiles,
            window=window, sinks=sinks,
        )  # fmt: skip


@register("flashinfer")
class FlashInferAttention(ExtendAttention):
    """One FlashInfer wrapper per active-row set and window (planned at its first layer);
    ``backend`` is a :class:`~sglang_relay_kernels.flashinfer_extend.FlashInferExtend` (or a
    test double)."""

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        if backend is None:
            from sglang_relay_kernels.flashinfer_extend import FlashInferExtend

            backend = FlashInferExtend(device)
        self.backend = backend
        self.planned: set[tuple[int, int]] = set()
        self._next = 0

    def reset(self) -> None:
        self.backend.reset()
        self.planned.clear()

    def plan(self, batch, rows_cpu, positions):
        bounds = batch.bounds(rows_cpu)
        counts = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        self._next += 1
        return self._next, (counts, positions, batch.seq_lens, batch.slots)

    def run(self, handle, q, kbuf, vbuf, scale, window=0, sinks=None):
        from sglang_relay_kernels.flashinfer_extend import build_extend_plan

        key = (handle[0], window)
        if key not in self.planned:  # planned at first use: head counts come with q / kbuf
            layout = build_extend_plan(*handle[1], window=window)
            heads = (q.shape[1], kbuf.shape[1], q.shape[2], vbuf.shape[-1])
            self.backend.plan(key, layout, heads, scale, q.dtype, kbuf.dtype)
            self.planned.add(key)
        return self.backend.run(key, q, kbuf, vbuf, sinks)
