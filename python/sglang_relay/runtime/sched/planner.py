"""Scheduler-side planning: which stored spans a request's extend chunk reuses, and the
batch plan the relay forward runs.

Two steps, paired like FlashInfer's plan/run:
1. :meth:`Planner.plan_request` (after ``prepare_for_extend``): find spans in the chunk's
   tokens (same namespace only); remember them per request until the forward.
2. :meth:`Planner.plan_batch` (in the model forward): re-check every matched run where it is
   used: slot stamps unchanged (:class:`SlotLedger`), hidden states stored if the method
   needs them, no slot rewritten by this very batch; keep the valid sub-runs of at least
   ``min_span`` tokens (the rest is counted as trimmed), and build the :class:`BatchPlan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.selection import probe_pays
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.cache.span_store import SpanSource, SpanStore
from sglang_relay.runtime.forward.attention import ExtendAttention, RowBatch
from sglang_relay.runtime.forward.extend import BatchPlan, SpanGroup
from sglang_relay.runtime.forward.probe import ProbeTarget, pre_span_rows
from sglang_relay.runtime.forward.tp import TPSync
from sglang_relay.runtime.stats import RequestStats

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestPlan:
    cfg: RelayConfig
    prefix_len: int
    sources: list[SpanSource]
    heads: list[int]  # per source, tokens of its occurrence relayed in earlier chunks
    stats: RequestStats
    last_chunk: bool = True  # the chunk ends the prompt (holds its last row: cfg.probe)


def valid_runs(ok: torch.Tensor, min_len: int) -> list[tuple[int, int]]:
    """Maximal runs ``[lo, hi)`` of True in ``ok`` (``[n]`` bool) at least ``min_len`` long."""
    edge = torch.zeros(1, dtype=torch.int8, device=ok.device)
    step = torch.cat([edge, ok.to(torch.int8), edge]).diff()
    starts = (step == 1).nonzero().flatten().tolist()
    ends = (step == -1).nonzero().flatten().tolist()
    return [(lo, hi) for lo, hi in zip(starts, ends, strict=True) if hi - lo >= min_len]


class PlanningFailed(RuntimeError):
    """Planning an extend batch raised (the cause is chained); ``stats`` are the requests
    whose plans it had taken, so each can fall back and say so."""

    def __init__(self, stats: list[RequestStats]) -> None:
        super().__init__("planning an extend batch failed")
        self.stats = stats


class Planner:
    """Owns the per-request plans between ``prepare_for_extend`` and the forward."""

    def __init__(
        self,
        store: SpanStore,
        ledger: SlotLedger,
        *,
        num_layers: int,
        min_span: int,
        req_to_token: torch.Tensor,
        attention: ExtendAttention,
        tp: TPSync | None = None,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.num_layers = num_layers
        self.min_span = min_span
        self.req_to_token = req_to_token
        self.attention = attention
        self.tp = tp
        self.pending: dict[str, RequestPlan] = {}

    def plan_request(
        self,
        rid: str,
        cfg: RelayConfig,
        stats: RequestStats,
        tokens: list[int],
        prefix_len: int,
        namespace: Hashable,
        related: Callable[[], set[int]] | None = None,
        *,
        last_chunk: bool = True,
        written: torch.Tensor | None = None,
    ) -> tuple[bool, int]:
        """Find spans in this chunk's ``tokens`` (they start at row position
        ``prefix_len``), keeping those of spans in ``related()`` (None: all). Returns
        whether any was kept and the number of matches left out as unrelated.
        ``last_chunk``: the chunk ends the prompt, whose last row follows ``tokens``.
        ``written``: the slots this batch writes; with a host tier, a span whose device
        slots are gone (or among them) is copied back from host first."""
        sources = self.store.find(tokens, namespace)
        unrelated = 0
        if sources and related is not None:
            ids = related()
            kept = [s for s in sources if s.span_id in ids]
            unrelated, sources = len(sources) - len(kept), kept
        if sources and self.store.tier is not None:
            sources = [self._on_device(s, written) for s in sources]
        heads = [self._continued(stats, s, prefix_len) for s in sources]
        stats.open_run = None
        for s, head in zip(sources, heads, strict=True):
            if s.prompt_start + s.length == len(tokens):  # may go on in the next chunk
                end = prefix_len + len(tokens)
                stats.open_run = (s.span_id, s.span_start + s.length, end, head + s.length)
        if not sources:
            return False, unrelated
        self.pending[rid] = RequestPlan(cfg, prefix_len, sources, heads, stats, last_chunk)
        return True, unrelated

    def _on_device(self, s: SpanSource, written: torch.Tensor | None) -> SpanSource:
        """``s`` on device: its span copied back from host if its recorded slots were
        rewritten (or this batch writes them) and the tier holds it. Whether to copy is
        decided on the stamps, which every TP rank shares."""
        span = self.store.spans.get(s.span_id)
        if span is None:  # dropped by the budget while an earlier source came back
            return s
        self.store.tier.touch(s.span_id)  # a related prompt pastes it: consumed
        gone = not bool(self.ledger.unchanged(span.slots, span.stamps).all())
        if not gone and written is not None:
            gone = bool(torch.isin(span.slots, written.to(span.slots.device)).any())
        if gone:
            back = self.store.tier.restore(s.span_id)
            if back is not None:
                self.store.rehome(s.span_id, *back)
        sl = slice(s.span_start, s.span_start + s.length)
        return s._replace(slots=span.slots[sl], stamps=span.stamps[sl])

    @staticmethod
    def _continued(stats: RequestStats, s: SpanSource, prefix_len: int) -> int:
        """Tokens of the same occurrence before ``s`` (a span cut by a chunk boundary)."""
        run = stats.open_run
        if run is None or s.prompt_start != 0:
            return 0
        span_id, span_end, row_end, count = run
        continues = s.span_id == span_id and s.span_start == span_end and prefix_len == row_end
        return count if continues else 0

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)

    def take_pending(self) -> list[RequestPlan]:
        """Every plan not yet run (they are dropped)."""
        plans, self.pending = list(self.pending.values()), {}
        return plans

    def plan_batch(
        self, fb: ForwardBatch
    ) -> tuple[BatchPlan | None, list[tuple[RequestStats, str]]]:
        """The plan for this extend batch (None: nothing to relay) and the requests whose
        plan could not run, with the reason. Takes every pending plan; if planning raises,
        :class:`PlanningFailed` hands back the requests it took."""
        pending, self.pending = self.pending, {}
        taken = [p.stats for p in pending.values()]
        try:
            return self._plan_batch(fb, pending)
        except Exception as exc:
            raise PlanningFailed(taken) from exc

    def _plan_batch(
        self, fb: ForwardBatch, pending: dict[str, RequestPlan]
    ) -> tuple[BatchPlan | None, list[tuple[RequestStats, str]]]:
        rids = fb.rids or []
        plans = [pending.pop(rid, None) for rid in rids]
        dropped = [(p.stats, "stale_plan") for p in pending.values()]  # planned, not batched
        if not any(plans):
            return None, dropped
        ext_lens = list(fb.extend_seq_lens_cpu)
        prefix_lens = list(fb.extend_prefix_lens_cpu)
        row_starts = [0]
        for n in ext_lens[:-1]:
            row_starts.append(row_starts[-1] + n)
        num_rows = sum(ext_lens)
        written = fb.out_cache_loc.to(torch.int64)
        groups: dict[RelayConfig, dict[str, list]] = {}
        probing = []  # (cfg, first group row, request index, use) of the requests that probe
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            if prefix_lens[i] != plan.prefix_len:
                dropped.append((plan.stats, "stale_plan"))
                continue
            use = plan.stats.begin_chunk()
            sched = plan.cfg.schedule(self.num_layers)
            needs_hidden = sched.needs_hidden() and sched.l_start > 0  # 0: embeddings
            ranks_context = plan.cfg.ranks_context
            reasons, found = [], []
            for s, head in zip(plan.sources, plan.heads, strict=True):
                ok = self.ledger.unchanged(s.slots, s.stamps)
                if not bool(ok.all()):
                    reasons.append("span_evicted")
                ok &= ~torch.isin(s.slots, written)  # this batch rewrites the slot
                if needs_hidden:
                    has = SlotLedger.has_hidden(s.stamps)
                    if not bool(has.all()):
                        reasons.append("hidden_invalid")
                    ok &= has
                if ranks_context and s.context is None:  # recorded before / without it
                    reasons.append("context_missing")
                    ok &= False
                runs = valid_runs(ok, self.min_span)
                plan.stats.trimmed_tokens += s.length - sum(hi - lo for lo, hi in runs)
                found.append((s, head, runs))
            tokens = sum(hi - lo for _, _, runs in found for lo, hi in runs)
            if tokens == 0:
                plan.stats.chunk = None
                dropped.append((plan.stats, reasons[0] if reasons else "span_evicted"))
                continue
            if reasons:
                plan.stats.fallback = f"trimmed: {reasons[0]}"
            cfg = plan.cfg
            if cfg.probes:  # the last-row probe, where the chunk has that row and a choice
                if not plan.last_chunk:
                    use.probe = "no_last_row"
                elif not probe_pays(cfg, tokens):
                    use.probe = "small_budget"
                else:
                    use.probe = "last_row"
                if use.probe != "last_row":  # the context rule alone
                    cfg = replace(cfg, probe=None)
            g = groups.setdefault(cfg, {"rows": [], "src": [], "delta": [], "seg": [], "ctx": []})
            first_row = sum(len(r) for r in g["rows"])
            for s, head, runs in found:
                answer_start = self.store.answer_start(s.span_id)
                for lo, hi in runs:
                    n = hi - lo
                    start = s.prompt_start + lo
                    dest = plan.prefix_len + start
                    offs = torch.arange(n, device=s.slots.device)
                    base = sum(len(r) for r in g["rows"])
                    g["rows"].append(row_starts[i] + start + offs)
                    g["src"].append(s.slots[lo:hi])
                    g["delta"].append(dest + offs - s.positions[lo:hi])
                    if ranks_context:
                        g["ctx"].append(s.context[lo:hi])
                    # a reasoning answer: the run starts at or after its span's answer
                    answer = 0 < answer_start <= s.span_start + lo
                    g["seg"].append((base, base + n, use, head + lo, answer))
                    use.spans += 1
                    use.tokens += n
                    use.answer_tokens += n * answer
                    use.recomputed_token_layers += n * sched.dense_layers
                    use.first_position = (
                        dest if use.first_position is None else min(use.first_position, dest)
                    )
            if cfg.probes:
                probing.append((cfg, first_row, i, use))
                use.recomputed_token_layers += self.num_layers  # the probe's row
        built = [
            SpanGroup(
                cfg=cfg,
                sched=cfg.schedule(self.num_layers),
                rows=torch.cat(g["rows"]),
                src=torch.cat(g["src"]),
                segments=g["seg"],
                context=torch.cat(g["ctx"]) if g["ctx"] else None,
            )
            for cfg, g in groups.items()
            if g["rows"]
        ]
        index = {g.cfg: k for k, g in enumerate(built)}
        probes = [
            ProbeTarget(
                group=index[cfg],
                lo=lo,
                hi=lo + use.tokens,
                row=row_starts[i] + ext_lens[i] - 1,
                req=i,
                first=use.first_position,
            )
            for cfg, lo, i, use in probing
        ]
        if not built:
            return None, dropped
        span_rows = torch.cat([g.rows for g in built])
        order = span_rows.argsort()
        deltas = torch.cat([torch.cat(g["delta"]) for g in groups.values() if g["rows"]])
        mask = torch.ones(num_rows, dtype=torch.bool, device=span_rows.device)
        mask[span_rows] = False
        seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens, strict=True)]
        slots = [self.req_to_token[fb.req_pool_indices[i], : seq_lens[i]] for i in range(len(rids))]
        plan = BatchPlan(
            groups=built,
            span_rows=span_rows[order],
            span_src=torch.cat([g.src for g in built])[order],
            span_delta=deltas[order],
            normal_rows=mask.nonzero().flatten(),
            batch=RowBatch(row_starts, seq_lens, slots, num_rows),
            attention=self.attention,
            owners=[p.stats for p in plans if p is not None and p.stats.chunk is not None],
            tp=self.tp,
            probes=probes,
            probe_pre=pre_span_rows(probes, row_starts, prefix_lens).to(span_rows.device),
        )
        return plan, dropped
