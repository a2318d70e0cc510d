"""Relay's own memory for one extend, bounded before the forward starts.

Beyond what SGLang's forward of the same batch allocates (SGLang budgets that), a relay
extend needs transient buffers of its own: the span keys and values of one layer in
float32 while they are re-rotated into the request's slots, the probe's view of each
target's visible keys and values in float32 (one target and one layer at a time), and
the fresh K/V of a group's span rows at its detection layer. :func:`scratch_bytes` bounds
their peak from the plan; :func:`scratch_refusal` compares it with the memory free on the
device, so a batch that would run out falls back to standard prefill before any of its
work (reason ``memory``), on every TP rank together (the plan agreement carries it),
instead of failing inside the layer loop, where a TP rank alone cannot leave.
(Span recording, the other buffer relay allocates per request, runs after the answer is
final and drops the span on any error: ``span_record_errors``.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

FLOAT = 4  # bytes of a float32
# the allocator's rounding and short-lived temporaries (a matmul's output beside its inputs)
SLACK = 2


class HeadMaxima(NamedTuple):
    """The widest layer's attention sizes over the stack (a buffer sized by them holds any
    layer's rows); made once, with the driver (``LayerDriver.head_max``)."""

    q: int  # query heads
    qd: int  # query heads x head dim (the larger of the qk and v dims)
    kvd: int  # key heads x head dim (likewise)


def head_maxima(heads: Iterable[Any]) -> HeadMaxima:
    """:class:`HeadMaxima` of every layer's ``Heads`` (``q``, ``kv``, ``d``, ``dv``)."""
    heads = list(heads)
    return HeadMaxima(
        max(h.q for h in heads),
        max(h.q * max(h.d, h.dv) for h in heads),
        max(h.kv * max(h.d, h.dv) for h in heads),
    )


def scratch_bytes(plan: Any, drv: Any) -> int:
    """An upper bound of relay's own peak transient memory for ``plan`` (bytes)."""
    q, qd, kvd = drv.head_max
    splice = 2 * int(plan.span_rows.numel()) * kvd * FLOAT
    probe = 0
    for t in plan.probes or ():
        visible = int(t.first) + int(t.hi - t.lo) + 1
        probe = max(probe, 2 * visible * kvd * FLOAT + visible * q * FLOAT)
    detect = max((int(g.rows.numel()) for g in plan.groups), default=0) * (qd + 2 * kvd) * FLOAT
    return SLACK * max(splice, probe, detect)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on ``device`` can take now: CUDA's free memory plus what
    the caching allocator holds unused; the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.virtual_memory().available)


def scratch_refusal(plan: Any, drv: Any, free: int) -> str | None:
    """The fallback reason when ``plan`` needs more than ``free`` bytes, else None."""
    need = scratch_bytes(plan, drv)
    if need <= free:
        return None
    return f"memory: relay needs {need / 2**20:.1f} MiB of scratch, {free / 2**20:.1f} MiB free"
