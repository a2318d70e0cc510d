"""The relay forward of one extend batch: splice, re-rotate, rectify.

Every row is one extend token. Normal rows (new tokens, whole plain requests) run every
layer. Span rows (tokens whose KV is spliced from a recorded span) run only where their
group's schedule says: densely in ``[l_start, l_det)`` from the span's stored hidden state
at ``l_start``, and, if selected at ``l_det``, in ``[l_det, l_end]``. Elsewhere their
spliced, re-rotated KV stands. That schedule is a :class:`ExtendPlan`, run by the driver's
one layer loop (:meth:`.layer_driver.LayerDriver.run`).

The batch plan is built by :mod:`sglang_relay.runtime.sched.planner`; nothing here calls
back into it.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from itertools import groupby
from typing import TYPE_CHECKING

import torch

from sglang_relay.core.config import LayerSchedule, RelayConfig
from sglang_relay.core.selection import kv_deviation, select_runs
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.forward.attention import ExtendAttention, RowBatch
from sglang_relay.runtime.forward.layer_driver import LayerDriver, LayerPlan, RowSet, Stream
from sglang_relay.runtime.forward.lora_rows import info_for, rows_swapped
from sglang_relay.runtime.forward.probe import ProbeTarget, run_probe
from sglang_relay.runtime.forward.tp import TPMismatch, TPSync, fingerprint
from sglang_relay.runtime.stats import ChunkUse, RequestStats
from sglang_relay_kernels import gather_rows, scatter_rows

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch


@dataclass(slots=True)
class SpanGroup:
    """Span rows of the batch that share one config (one relay method)."""

    cfg: RelayConfig
    sched: LayerSchedule
    rows: torch.Tensor  # [S] int64 batch rows
    src: torch.Tensor  # [S] int64 source KV slots
    # per run: (lo, hi) in rows, its request chunk's use, head, whether a reasoning answer
    segments: list[tuple[int, int, ChunkUse, int, bool]]
    selected: torch.Tensor | None = None  # [<=S] int64 batch rows chosen at l_det
    context: torch.Tensor | None = None  # [S] float32 recorded context masses (signal context)
    probed: torch.Tensor | None = None  # [S] context masses x last-row probe (cfg.probe)


@dataclass(slots=True)
class BatchPlan:
    """Everything the relay forward needs for one extend batch."""

    groups: list[SpanGroup]
    span_rows: torch.Tensor  # [S_all] int64, all span rows (any group), ascending
    span_src: torch.Tensor  # [S_all] int64 source slots
    span_delta: torch.Tensor  # [S_all] int64 new position - old position
    normal_rows: torch.Tensor  # [N - S_all] int64
    batch: RowBatch
    attention: ExtendAttention
    owners: list[RequestStats]  # the requests whose chunks this plan relays
    tp: TPSync | None = None  # tensor parallel: scores reduced, selections checked
    probes: list[ProbeTarget] = field(default_factory=list)  # requests whose rule probes
    probe_pre: torch.Tensor | None = None  # [P] int64 rows the probe computes for good
    lora: object | None = None  # SGLang's LoRA backend on a LoRA server (lora_rows.py)
    clock: object | None = None  # the runtime's PhaseClock (bench ttft's breakdown)


def splice(fb: ForwardBatch, drv: LayerDriver, plan: BatchPlan) -> None:
    """Copy every span's KV into the request's slots, keys re-rotated, in all layers."""
    drv.splice(plan.span_src, fb.out_cache_loc[plan.span_rows], plan.span_delta)


def detect_and_select(
    fb: ForwardBatch,
    drv: LayerDriver,
    lid: int,
    group: SpanGroup,
    h,
    r,
    influence,
    tp=None,
    lora=None,
) -> None:
    """At ``l_det``: fresh K/V of the group's span rows vs the spliced ones, then select
    per matched run; fills ``group.selected`` and each run's ``ChunkUse``."""
    cfg, rows = group.cfg, group.rows
    n = rows.numel()
    deviation = group.context if cfg.ranks_context else None  # scores recorded with the span
    if cfg.probes:  # a probing group's scores came from the probe (the TP group's already)
        deviation = group.probed
    if cfg.detects:
        x, _ = drv.norm_in(lid, gather_rows(h, rows), None if r is None else gather_rows(r, rows))
        with rows_swapped(lora, rows):
            _, k, v = drv.qkv(lid, fb.positions[rows], x)
        hd = drv.heads(lid)
        loc = fb.out_cache_loc[rows]
        kbuf, vbuf = drv.kv(lid)
        if cfg.signal == "key":
            buf, new = kbuf, k.reshape(n, hd.kv, hd.d)
        else:
            buf, new = vbuf, v.reshape(n, hd.v, hd.dv)
        old = gather_rows(buf.view(buf.shape[0], -1), loc).view(new.shape)
        deviation = kv_deviation(new, old)
        drv.write_kv(lid, loc, k, v)  # fresh K/V at l_det for every span token
    scores = None if influence is None else influence[group.src]
    if tp is not None:  # this rank saw its KV heads only: rank the TP group's mean
        if deviation is not None and not cfg.probes:
            deviation = tp.mean(deviation)
        scores = None if scores is None else tp.mean(scores)
    keep = []
    # one ChunkUse per request chunk, whose runs are consecutive rows of the group: they
    # select together (one cap per request with budget "request")
    for _, runs in groupby(group.segments, key=lambda seg: id(seg[2])):
        segs = list(runs)
        lo, hi = segs[0][0], segs[-1][1]
        masks = select_runs(
            cfg,
            [b - a for a, b, _, _, _ in segs],
            None if deviation is None else deviation[lo:hi],
            None if scores is None else scores[lo:hi],
            heads=[head for _, _, _, head, _ in segs],
            reserve=int(cfg.probes),  # the probe's row is charged
            answers=[answer for *_, answer in segs],
        )
        for (lo, hi, use, _, _), mask in zip(segs, masks, strict=True):
            keep.append(rows[lo:hi][mask.to(rows.device)])
            chosen = int(keep[-1].numel())
            use.selected += chosen
            use.recomputed_token_layers += chosen * group.sched.sparse_layers
    group.selected = torch.cat(keep) if keep else rows[:0]
    if tp is not None and not tp.agree(fingerprint(group.selected), "selection"):
        raise TPMismatch("relay selections differ across tensor-parallel ranks")


def _phase(g: SpanGroup, lid: int) -> str:
    """What a group's span rows do at layer ``lid``: ``dense``, ``selected`` or ``idle``."""
    if g.sched.l_start <= lid < g.sched.l_det:
        return "dense"
    if g.sched.l_det <= lid <= g.sched.l_end and g.selected is not None:
        return "selected"
    return "idle"


# what a TP rank without a plan for an extend batch sends (a plan has >= 1 group)
NO_PLAN = [0] * 8


def plan_fingerprint(plan: BatchPlan) -> list[int]:
    """What every TP rank must agree on before the plan's first collective (8 ints, like
    :data:`NO_PLAN`)."""
    # str hashes are salted per process: a stable digest of each group's config instead
    methods = sum(zlib.crc32(repr(g.cfg.to_dict()).encode()) for g in plan.groups)
    return [len(plan.groups), methods] + fingerprint(plan.span_rows, plan.span_src)


class ExtendPlan(LayerPlan):
    """The layers of a relay extend: normal rows run every layer; a group's span rows start
    at ``l_start`` from their stored hidden state (injected at its entry), run densely to
    ``l_det``, where detection selects the rows that run on to ``l_end``. Normal rows'
    stream is stored at ``capture_layer``. The rows change only at group phase boundaries,
    so each row set's attention is planned once and run per layer (:mod:`.attention`)."""

    def __init__(self, fb: ForwardBatch, plan: BatchPlan, ledger: SlotLedger, normal_rows,
                 positions, capture_layer, drv: LayerDriver):  # fmt: skip
        self.fb, self.plan, self.ledger, self.drv = fb, plan, ledger, drv
        self.normal_rows, self.positions, self.capture_layer = normal_rows, positions, capture_layer
        self.normal_loc = fb.out_cache_loc[normal_rows]
        self.lora_backend = plan.lora
        self._phase: tuple | None = None
        self._rows: RowSet | None = None

    def _stores(self, lid: int) -> bool:
        """Whether layer ``lid``'s entry stores the normal rows' stream."""
        return lid == self.capture_layer and bool(self.normal_rows.numel())

    @staticmethod
    def _injects(g: SpanGroup, lid: int) -> bool:
        """Whether group ``g``'s span rows enter at ``lid`` from their stored hidden state."""
        return lid == g.sched.l_start and lid > 0 and g.sched.needs_hidden()

    @staticmethod
    def _detects(g: SpanGroup, lid: int) -> bool:
        """Whether group ``g`` selects its rows at ``lid`` (from the stream entering it)."""
        return lid == g.sched.l_det and lid <= g.sched.l_end

    def uses_stream(self, lid: int) -> bool:
        return self._stores(lid) or any(
            self._injects(g, lid) or self._detects(g, lid) for g in self.plan.groups
        )

    def enter(self, lid: int, stream: Stream) -> RowSet | None:
        plan, ledger, normal = self.plan, self.ledger, self.normal_rows
        if self._stores(lid):
            rows_r = None if stream.r is None else gather_rows(stream.r, normal)
            rows_h = gather_rows(stream.h, normal)
            ledger.store_hidden(self.normal_loc, self.drv.stream(rows_h, rows_r))
        for g in plan.groups:
            if self._injects(g, lid):
                r = stream.residual()  # zeros if no row ran yet (a chunk of span rows only)
                scatter_rows(stream.h, g.rows, gather_rows(ledger.hidden, g.src))
                r[g.rows] = 0  # the stored stream is h + r: carry it in h
            if self._detects(g, lid):
                detect_and_select(
                    self.fb, self.drv, lid, g, stream.h, stream.r, ledger.influence, plan.tp,
                    plan.lora,
                )  # fmt: skip
        phase = tuple(_phase(g, lid) for g in plan.groups)
        if phase != self._phase:  # the active rows change at group boundaries only
            self._phase = phase
            parts = [normal]
            for g, ph in zip(plan.groups, phase, strict=True):
                if ph == "dense":
                    parts.append(g.rows)
                elif ph == "selected":
                    parts.append(g.selected)
            rows = torch.cat(parts).sort().values if len(parts) > 1 else parts[0]
            self._rows = None
            if rows.numel():
                row_pos = self.positions[rows]
                handle = plan.attention.plan(plan.batch, rows.cpu(), row_pos)
                self._rows = RowSet(
                    rows, row_pos, self.fb.out_cache_loc[rows],
                    lambda lid, hd, q, k, v, handle=handle: plan.attention.run(
                        handle, q, k, v, hd.scale, hd.window, hd.sinks
                    ),
                    info_for(plan.lora, rows),  # a LoRA server: each row's own adapter
                )  # fmt: skip
        return self._rows


def relay_prepare(
    drv: LayerDriver, fb: ForwardBatch, plan: BatchPlan, ledger: SlotLedger, capture_layer=None
) -> None:
    """What a relay extend does before its first collective (it may fail on one TP rank
    alone, and every rank can still fall back together): the batch's slots stamped (normal
    rows as holding a hidden row when ``capture_layer`` stores them), every span's KV
    spliced into the request's slots, the attention plans reset."""
    ledger.stamp(fb.out_cache_loc[plan.span_rows], with_hidden=False)
    ledger.stamp(fb.out_cache_loc[plan.normal_rows], with_hidden=capture_layer is not None)
    splice(fb, drv, plan)
    plan.attention.reset()


def relay_extend(
    drv: LayerDriver, input_ids, positions, fb: ForwardBatch, plan: BatchPlan, ledger: SlotLedger,
    capture_layer=None,
):  # fmt: skip
    """The relay forward of an extend batch; returns final-norm hidden states ``[N, H]``.
    Per-run selected counts land in the plan's ``ChunkUse`` objects. Stamps the batch's
    slots: normal rows (computed exactly, e.g. the decode rows of a mixed batch) with their
    hidden state at ``capture_layer`` stored, span rows without. :func:`relay_prepare`
    ran before."""
    stream = Stream(drv.embed(input_ids))  # (vocab-parallel: the first TP collective)
    normal_rows, pre_r = plan.normal_rows, None
    clock = plan.clock or contextlib.nullcontext
    if plan.probes:  # the rows before the first spans are final after the probe
        with clock("probe"):
            pre_r = run_probe(drv, positions, fb, plan, stream.h, ledger, capture_layer)
        if plan.probe_pre is not None and plan.probe_pre.numel():
            normal_rows = normal_rows[~torch.isin(normal_rows, plan.probe_pre)]
    layers = ExtendPlan(fb, plan, ledger, normal_rows, positions, capture_layer, drv)
    with clock("layers"):
        r = drv.run(layers, stream, fb).residual()  # zeros if no row was active anywhere
    if pre_r is not None:
        scatter_rows(r, plan.probe_pre, pre_r)
    return drv.final_norm(stream.h, r)
