"""The relay forward of one extend batch: splice, re-rotate, rectify.

Every row is one extend token. Normal rows (new tokens, whole plain requests) run every
layer. Span rows (tokens whose KV is spliced from a recorded span) run only where their
group's schedule says: densely in ``[l_start, l_det)`` from the span's stored hidden state
at ``l_start``, and, if selected at ``l_det``, in ``[l_det, l_end]``. Elsewhere their
spliced, re-rotated KV stands. The active rows change only at group phase boundaries, so
attention is planned once per row set and run per layer (:mod:`.attention`).

The batch plan is built by :mod:`.planner`; nothing here calls back into it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from itertools import groupby

import torch

from sglang_relay.core.config import LayerSchedule, RelayConfig
from sglang_relay.core.rope import delta_cos_sin
from sglang_relay.core.selection import kv_deviation, select_runs
from sglang_relay.runtime.anatomy import rotation_table
from sglang_relay.runtime.attention import ExtendAttention, RowBatch
from sglang_relay.runtime.layer_step import qkv, run_layer, stream, write_kv
from sglang_relay.runtime.lora_rows import info_for, installed, rows_swapped
from sglang_relay.runtime.probe import ProbeTarget, run_probe
from sglang_relay.runtime.side_data import SlotLedger
from sglang_relay.runtime.stats import ChunkUse, RequestStats
from sglang_relay.runtime.tp import TPMismatch, TPSync, fingerprint
from sglang_relay_kernels import gather_rows, scatter_rows, splice_rerotate


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
    kv_pool: object  # SGLang's token_to_kv_pool (get_key_buffer / set_kv_buffer)
    attention: ExtendAttention
    owners: list[RequestStats]  # the requests whose chunks this plan relays
    tp: TPSync | None = None  # tensor parallel: scores reduced, selections checked
    probes: list[ProbeTarget] = field(default_factory=list)  # requests whose rule probes
    probe_pre: torch.Tensor | None = None  # [P] int64 rows the probe computes for good
    lora: object | None = None  # SGLang's LoRA backend on a LoRA server (lora_rows.py)


def splice(fb, model, plan: BatchPlan) -> None:
    """Copy every span's KV into the request's slots, keys re-rotated, in all layers."""
    rope = model.layers[0].self_attn.rotary_emb
    cos, sin = delta_cos_sin(rotation_table(rope), plan.span_delta)
    dst = fb.out_cache_loc[plan.span_rows]
    pool = plan.kv_pool
    ids = [layer.self_attn.attn.layer_id for layer in model.layers]
    # Triton on CUDA (one launch per layer), the torch reference elsewhere
    splice_rerotate(
        [pool.get_key_buffer(i) for i in ids],
        [pool.get_value_buffer(i) for i in ids],
        plan.span_src,
        dst,
        cos,
        sin,
        is_neox=rope.is_neox_style,
    )


def detect_and_select(
    fb, pool, layer, group: SpanGroup, h, r, influence, tp=None, lora=None
) -> None:
    """At ``l_det``: fresh K/V of the group's span rows vs the spliced ones, then select
    per matched run; fills ``group.selected`` and each run's ``ChunkUse``."""
    cfg, rows = group.cfg, group.rows
    n = rows.numel()
    deviation = group.context if cfg.ranks_context else None  # scores recorded with the span
    if cfg.probes:  # a probing group's scores came from the probe (the TP group's already)
        deviation = group.probed
    if cfg.detects:
        hs = gather_rows(h, rows)
        if r is None:
            x = layer.input_layernorm(hs)
        else:
            x = layer.input_layernorm(hs, gather_rows(r, rows))[0]
        with rows_swapped(lora, rows):
            _, k, v = qkv(layer.self_attn, fb.positions[rows], x)
        ra = layer.self_attn.attn
        loc = fb.out_cache_loc[rows]
        if cfg.signal == "key":
            buf = pool.get_key_buffer(ra.layer_id)
            new = k.reshape(n, ra.tp_k_head_num, ra.qk_head_dim)
        else:
            buf = pool.get_value_buffer(ra.layer_id)
            new = v.reshape(n, ra.tp_v_head_num, ra.v_head_dim)
        old = gather_rows(buf.view(buf.shape[0], -1), loc).view(new.shape)
        deviation = kv_deviation(new, old)
        write_kv(pool, ra, loc, k, v)  # fresh K/V at l_det for every span token
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


def relay_extend(
    model, input_ids, positions, fb, plan: BatchPlan, ledger: SlotLedger, capture_layer=None
):
    """The relay forward of an extend batch; returns final-norm hidden states ``[N, H]``.
    Per-run selected counts land in the plan's ``ChunkUse`` objects. Stamps the batch's
    slots: normal rows (computed exactly, e.g. the decode rows of a mixed batch) with their
    hidden state at ``capture_layer`` stored, span rows without."""
    ledger.stamp(fb.out_cache_loc[plan.span_rows], with_hidden=False)
    ledger.stamp(fb.out_cache_loc[plan.normal_rows], with_hidden=capture_layer is not None)
    splice(fb, model, plan)
    plan.attention.reset()
    h = model.embed_tokens(input_ids)
    r = None
    normal_rows, pre_r = plan.normal_rows, None
    if plan.probes:  # the rows before the first spans are final after the probe
        pre_r = run_probe(model, positions, fb, plan, h, ledger, capture_layer)
        if plan.probe_pre is not None and plan.probe_pre.numel():
            normal_rows = normal_rows[~torch.isin(normal_rows, plan.probe_pre)]
    normal_loc = fb.out_cache_loc[normal_rows]
    last_phase = rows = handle = row_pos = lora_info = None
    for lid, layer in enumerate(model.layers):
        if lid == capture_layer and normal_rows.numel():
            rows_h = gather_rows(h, normal_rows)
            ledger.store_hidden(normal_loc, stream(rows_h, gather_rows(r, normal_rows)))
        for g in plan.groups:
            if lid == g.sched.l_start and lid > 0 and g.sched.needs_hidden():
                if r is None:  # no row ran yet (a chunk made of span rows only)
                    r = torch.zeros_like(h)
                scatter_rows(h, g.rows, gather_rows(ledger.hidden, g.src))
                r[g.rows] = 0  # the stored stream is h + r: carry it in h
            if lid == g.sched.l_det and lid <= g.sched.l_end:
                detect_and_select(
                    fb, plan.kv_pool, layer, g, h, r, ledger.influence, plan.tp, plan.lora
                )
        phase = tuple(_phase(g, lid) for g in plan.groups)
        if phase != last_phase:  # the active rows change at group boundaries only
            last_phase = phase
            parts = [normal_rows]
            for g, ph in zip(plan.groups, phase, strict=True):
                if ph == "dense":
                    parts.append(g.rows)
                elif ph == "selected":
                    parts.append(g.selected)
            rows = torch.cat(parts).sort().values if len(parts) > 1 else parts[0]
            row_pos = positions[rows]
            handle = plan.attention.plan(plan.batch, rows.cpu(), row_pos) if rows.numel() else None
            lora_info = info_for(plan.lora, rows)  # a LoRA server: each row's own adapter
        if handle is None:
            continue
        ra = layer.self_attn.attn

        def attend(q, k, v, rows=rows, handle=handle, ra=ra):
            write_kv(plan.kv_pool, ra, fb.out_cache_loc[rows], k, v)
            kbuf = plan.kv_pool.get_key_buffer(ra.layer_id)
            vbuf = plan.kv_pool.get_value_buffer(ra.layer_id)
            out = plan.attention.run(
                handle, q.reshape(-1, ra.tp_q_head_num, ra.qk_head_dim), kbuf, vbuf, ra.scaling
            )
            return out.reshape(q.shape[0], -1)

        # gather / scatter of the active rows: Triton on CUDA, plain indexing elsewhere
        r_in = None if r is None else gather_rows(r, rows)
        with installed(plan.lora, lora_info):
            h_out, r_out = run_layer(layer, row_pos, gather_rows(h, rows), r_in, fb, attend)
        if r is None:
            r = torch.zeros_like(h)
        scatter_rows(h, rows, h_out)
        scatter_rows(r, rows, r_out)
    if r is None:  # no row was active anywhere: a chunk of span rows with nothing selected
        r = torch.zeros_like(h)
    if pre_r is not None:
        scatter_rows(r, plan.probe_pre, pre_r)
    out, _ = model.norm(h, r)
    return out
