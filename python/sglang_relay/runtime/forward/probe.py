"""The last-row probe of ``cfg.probe``: what the downstream's next token reads.

Before the relay forward of an extend batch, every request whose rule probes (and whose
chunk ends its prompt) runs one extra row through all layers: its last prompt token, over
the spliced span KV, the context before the request's first span and nothing else (the
rows between the spans and the last row are not computed yet, so they are left out of its
attention). The attention that row gives each span token, averaged over query heads and
the upper half of the layers, multiplies the token's context mass
(:func:`~sglang_relay.core.selection.probed_mass`); the row is charged to the request's
cap. The rows before the first span are computed here for good (their KV does not depend
on the spans), so the forward that follows skips them.

The same pass on the Hugging Face reference is
:func:`sglang_relay.core.reference.last_row_probe`; a test compares the two. The last
row's attention is one query per request, in plain torch (on any device); the rows before
the first span use the batch's extend attention like every other row set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_relay.core.attention import attention_probs
from sglang_relay.core.selection import probe_layers, probed_mass
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.forward.layer_driver import LayerDriver, LayerPlan, RowSet, Stream
from sglang_relay.runtime.forward.lora_rows import info_for
from sglang_relay_kernels import gather_rows, scatter_rows

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch


@dataclass(slots=True)
class ProbeTarget:
    """One probing request of the batch.

    Attributes:
        group: index of its :class:`~sglang_relay.runtime.forward.extend.SpanGroup` in the plan.
        lo, hi: its span rows' range in that group's ``rows`` (consecutive).
        row: batch row of its last prompt token.
        req: its index in the batch (``RowBatch.slots``).
        first: row position of its first span token in this chunk (the context before it
            is final: the prefix and the rows the probe computes).
    """

    group: int
    lo: int
    hi: int
    row: int
    req: int
    first: int


def pre_span_rows(targets: list[ProbeTarget], row_starts: list[int], prefix_lens: list[int]):
    """``[n]`` int64 batch rows before each target's first span (ascending)."""
    parts = [
        torch.arange(row_starts[t.req], row_starts[t.req] + t.first - prefix_lens[t.req])
        for t in targets
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class ProbePlan(LayerPlan):
    """The probe's layers: its rows (the pre rows, then each target's last row; a compact
    stream of their own) run every layer; the pre rows attend through the batch's extend
    attention, each last row over the slots it sees in plain torch, its attention on its
    spans summed over the probe layers (``sums``). The pre rows' stream is stored at
    ``capture_layer``."""

    def __init__(self, drv: LayerDriver, positions, fb: ForwardBatch, plan, ledger: SlotLedger,
                 capture_layer, device):  # fmt: skip
        targets, pre = plan.probes, plan.probe_pre  # device rows
        last = torch.tensor([t.row for t in targets], dtype=torch.int64, device=device)
        self.batch_rows = rows = torch.cat([pre, last])  # the stream's rows in the batch
        self.drv, self.plan, self.ledger, self.capture_layer = drv, plan, ledger, capture_layer
        self.n_pre = n_pre = pre.numel()
        self.handle = plan.attention.plan(plan.batch, pre.cpu(), positions[pre]) if n_pre else None
        self.summed = set(probe_layers(drv.num_layers))  # the layers whose attention counts
        self.sums = [torch.zeros(t.hi - t.lo, dtype=torch.float32, device=device) for t in targets]
        self.lora_backend = plan.lora
        # per target, the slots its last row sees (context before the first span, the spans,
        # itself) and where its spans sit among them: the same in every layer
        self.visible, self.where, self.seen_pos = [], [], []
        for t in targets:
            slots = plan.batch.slots[t.req]
            span_pos = positions[plan.groups[t.group].rows[t.lo : t.hi]].to(slots.device)
            own = positions[t.row : t.row + 1].to(slots.device)
            head = torch.arange(t.first, device=slots.device)
            seen = torch.cat([head, span_pos, own])
            self.visible.append(slots[seen].to(torch.int64))
            self.seen_pos.append(seen)
            self.where.append(slice(t.first, t.first + t.hi - t.lo))
        index = torch.arange(rows.numel(), device=device)
        # the same rows in every layer, and their LoRA info
        self.rows = RowSet(
            index, positions[rows], fb.out_cache_loc[rows], self.attend, info_for(plan.lora, rows)
        )

    def uses_stream(self, lid: int) -> bool:
        return lid == self.capture_layer and self.n_pre > 0

    def enter(self, lid: int, stream: Stream) -> RowSet:
        n_pre = self.n_pre
        if lid == self.capture_layer and n_pre:
            rows_r = None if stream.r is None else stream.r[:n_pre]
            entering = self.drv.stream(stream.h[:n_pre], rows_r)
            self.ledger.store_hidden(self.rows.loc[:n_pre], entering)
        return self.rows

    def attend(self, lid: int, hd, q, kbuf, vbuf):
        n_pre = self.n_pre
        out = q.new_empty((q.shape[0], hd.q, vbuf.shape[-1]))
        if self.handle is not None:
            out[:n_pre] = self.plan.attention.run(
                self.handle, q[:n_pre], kbuf, vbuf, hd.scale, hd.window, hd.sinks
            )
        for j, (vis, where) in enumerate(zip(self.visible, self.where, strict=True)):
            keys, vals = kbuf[vis].float(), vbuf[vis].float()
            pos = self.seen_pos[j].to(keys.device)
            seen = pos[None, :] > pos[-1] - (hd.window or pos[-1] + 1)  # its window, or all
            qj = q[n_pre + j : n_pre + j + 1].float()
            probs = attention_probs(qj, keys, seen, hd.scale, hd.sinks)  # [1, Hkv, group, T]
            if lid in self.summed:
                self.sums[j] += probs[0].mean((0, 1))[where]
            o = torch.einsum("ngrt,tgd->ngrd", probs, vals).reshape(1, hd.q, -1)
            out[n_pre + j] = o[0].to(out.dtype)
        return out


def run_probe(
    drv: LayerDriver, positions, fb: ForwardBatch, plan, h, ledger: SlotLedger, capture_layer
):
    """The probe pass of ``plan.probes``: computes the rows before the first spans
    (``plan.probe_pre``) for good, their final ``h`` scattered into ``h`` and their hidden
    state stored at ``capture_layer``, and sets each probing group's ``probed`` scores.
    Returns the pre rows' final residual (``None`` if there are none)."""
    probe = ProbePlan(drv, positions, fb, plan, ledger, capture_layer, h.device)
    n_pre = probe.n_pre
    stream = drv.run(probe, Stream(gather_rows(h, probe.batch_rows)), fb)
    if n_pre:
        scatter_rows(h, plan.probe_pre, stream.h[:n_pre])
    tp = plan.tp
    for j, t in enumerate(plan.probes):
        g = plan.groups[t.group]
        a = probe.sums[j] / len(probe.summed)
        mass = g.context[t.lo : t.hi]
        if tp is not None:  # each rank saw its own heads: the TP group's means
            a, mass = tp.mean(a), tp.mean(mass)
        if g.probed is None:
            g.probed = torch.full_like(g.context, float("nan"))
        g.probed[t.lo : t.hi] = probed_mass(mass, a, g.cfg.probe)
    return stream.r[:n_pre] if n_pre else None
