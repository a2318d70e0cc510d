"""The relay forward: a Llama-family layer loop with per-layer active token sets.

For an extend batch that carries relay plans, every row is one extend token. Normal rows
(new tokens, whole plain requests) run every layer as usual. Span rows (tokens whose KV is
spliced from a recorded span) run only where their group's schedule says: densely in
``[l_start, l_det)`` starting from the span's stored hidden state at ``l_start``, and, if
selected at ``l_det``, in ``[l_det, l_end]``. Elsewhere their spliced, re-rotated KV
stands. Attention of the active rows runs over each request's whole context in the KV
pool, causal by position (:func:`~sglang_relay.core.attention.positional_causal_attention`),
so only the needed query rows are computed.

Decode batches run the same loop with all rows active when the stored hidden state must be
captured at ``l_start`` (one indexed copy per step); otherwise SGLang's stock forward runs.

Supported: the pre-norm decoder layers of SGLang's Llama and Qwen2 models (``input_layernorm``,
``self_attn.{qkv_proj,rotary_emb,attn,o_proj}``, ``post_attention_layernorm``, ``mlp``),
tensor parallel size 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_relay.core.attention import positional_causal_attention
from sglang_relay.core.config import LayerSchedule, RelayConfig
from sglang_relay.core.rope import delta_cos_sin
from sglang_relay.core.selection import kv_deviation, select_tokens
from sglang_relay.kernels import gather_rows, scatter_rows, splice_rerotate


@dataclass
class SpanGroup:
    """Span rows of the batch that share one config (one relay method)."""

    cfg: RelayConfig
    sched: LayerSchedule
    rows: torch.Tensor  # [S] int64 batch rows, ascending
    src: torch.Tensor  # [S] int64 source KV slots
    delta: torch.Tensor | None = None  # [S] int64 new position - old position
    segments: list[tuple[int, int, dict]] = field(default_factory=list)  # (lo, hi, stats)
    selected: torch.Tensor | None = None  # [<=S] int64 batch rows chosen at l_det
    seg_selected: list[int] | None = None  # selected count per segment


@dataclass
class BatchPlan:
    """Everything the relay forward needs for one extend batch."""

    groups: list[SpanGroup]
    span_rows: torch.Tensor  # [S_all] int64, all span rows (any group)
    span_src: torch.Tensor  # [S_all] int64
    span_delta: torch.Tensor  # [S_all] int64 new position - old position
    normal_rows: torch.Tensor  # [N - S_all] int64
    row_starts: list[int]  # per request, first batch row (CPU)
    seq_lens: list[int]  # per request, context length after this extend (CPU)
    num_rows: int
    kv_pool: Any  # SGLang's token_to_kv_pool (get_key_buffer / set_kv_buffer)
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32 slots by position
    attention: str = "torch"  # extend attention: torch | triton | flashinfer (kernels/)
    flashinfer: Any = None  # FlashInferExtend on CUDA with the flashinfer backend, else None
    planned: dict = field(default_factory=dict)  # FlashInfer plans of this batch, by row set


def qkv(attn_mod, positions: torch.Tensor, x: torch.Tensor):
    """q, k, v of a Llama/Qwen2 attention block (post-RoPE q and k), flat ``[n, heads*dim]``."""
    out, _ = attn_mod.qkv_proj(x)
    q, k, v = out.split([attn_mod.q_size, attn_mod.kv_size, attn_mod.kv_size], dim=-1)
    q, k = attn_mod.rotary_emb(positions, q, k)
    return q, k, v


def _write_kv(pool, radix_attn, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    from sglang_relay.runtime.compat import kv_write_loc

    k = k.reshape(-1, radix_attn.tp_k_head_num, radix_attn.qk_head_dim)
    v = v.reshape(-1, radix_attn.tp_v_head_num, radix_attn.v_head_dim)
    pool.set_kv_buffer(radix_attn, kv_write_loc(loc), k, v)


def _phase(g: SpanGroup, lid: int) -> str:
    """What a group's span rows do at layer ``lid``: ``dense``, ``selected`` or ``idle``."""
    if g.sched.l_start <= lid < g.sched.l_det:
        return "dense"
    if g.sched.l_det <= lid <= g.sched.l_end and g.selected is not None:
        return "selected"
    return "idle"


def attend_rows(
    fb, plan: BatchPlan, radix_attn, q, k, v, rows: torch.Tensor, rows_cpu: torch.Tensor
) -> torch.Tensor:
    """Write the active rows' K/V, then attend them over their requests' contexts
    (``rows_cpu``: the same rows on the host)."""
    _write_kv(plan.kv_pool, radix_attn, fb.out_cache_loc[rows], k, v)
    hq, d, dv = radix_attn.tp_q_head_num, radix_attn.qk_head_dim, radix_attn.v_head_dim
    kbuf = plan.kv_pool.get_key_buffer(radix_attn.layer_id)
    vbuf = plan.kv_pool.get_value_buffer(radix_attn.layer_id)
    q3 = q.reshape(-1, hq, d)
    out = q.new_empty((q3.shape[0], hq, dv))
    bounds = torch.searchsorted(rows_cpu, torch.tensor(plan.row_starts + [plan.num_rows]))
    req_to_token = plan.req_to_token
    positions = fb.positions[rows]
    if plan.attention == "flashinfer":  # pragma: no cover - CUDA only
        return _attend_flashinfer(fb, plan, radix_attn, q3, rows_cpu, positions, bounds, kbuf, vbuf)
    if plan.attention == "triton":
        return _attend_triton(fb, plan, radix_attn, q3, rows_cpu, positions, bounds, kbuf, vbuf)
    for i in range(len(plan.row_starts)):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo == hi:
            continue
        seq_len = int(plan.seq_lens[i])
        slots = req_to_token[fb.req_pool_indices[i], :seq_len]
        out[lo:hi] = positional_causal_attention(
            q3[lo:hi], kbuf[slots], vbuf[slots], positions[lo:hi], radix_attn.scaling
        )
    return out.reshape(q3.shape[0], hq * dv)


def _cached(plan: BatchPlan, rows_cpu: torch.Tensor, build):
    """``build()`` once per active-row set of this batch (the layers of a group share it)."""
    key = hash(rows_cpu.numpy().tobytes())
    known = plan.planned.get(key)
    if known is None or not torch.equal(known[0], rows_cpu):
        known = plan.planned[key] = (rows_cpu, build(key))
    return known[1]


def _attend_triton(fb, plan, radix_attn, q3, rows_cpu, positions, bounds, kbuf, vbuf):
    """The same attention as the torch loop, as one Triton launch over all active rows."""
    from sglang_relay.kernels.attention import make_tiles, positional_attention_triton

    def build(_key):
        n_req = len(plan.row_starts)
        counts = torch.tensor([int(bounds[i + 1] - bounds[i]) for i in range(n_req)])
        offsets = torch.tensor([0, *plan.seq_lens[:-1]]).cumsum(0)
        kv_indices = torch.cat(
            [plan.req_to_token[fb.req_pool_indices[i], : plan.seq_lens[i]] for i in range(n_req)]
        )
        kv_start = offsets.repeat_interleave(counts)  # host
        return kv_indices, kv_start.to(q3.device), make_tiles(kv_start, device=q3.device)

    kv_indices, kv_start, tiles = _cached(plan, rows_cpu, build)
    out = positional_attention_triton(
        q3, kbuf, vbuf, positions, kv_start, kv_indices, radix_attn.scaling, tiles=tiles
    )
    return out.reshape(q3.shape[0], -1)


def _attend_flashinfer(fb, plan, radix_attn, q3, rows_cpu, positions, bounds, kbuf, vbuf):
    """The same attention as the torch loop above, as one FlashInfer paged prefill with a
    custom mask (layout: :mod:`sglang_relay.kernels.flashinfer_extend`). One plan per
    active-row set, reused by every layer of its group."""
    from sglang_relay.kernels.flashinfer_extend import build_extend_plan

    def build(key):
        if not plan.planned:
            plan.flashinfer.reset()
        counts = [int(bounds[i + 1] - bounds[i]) for i in range(len(plan.row_starts))]
        slots = [
            plan.req_to_token[fb.req_pool_indices[i], : plan.seq_lens[i]]
            for i in range(len(plan.row_starts))
        ]
        layout = build_extend_plan(counts, positions, plan.seq_lens, slots)
        heads = (
            radix_attn.tp_q_head_num,
            radix_attn.tp_k_head_num,
            radix_attn.qk_head_dim,
            radix_attn.v_head_dim,
        )
        plan.flashinfer.plan(key, layout, heads, radix_attn.scaling, q3.dtype, kbuf.dtype)
        return key

    key = _cached(plan, rows_cpu, build)
    out = plan.flashinfer.run(key, q3, kbuf, vbuf)
    return out.reshape(q3.shape[0], -1)


def _layer(layer, positions, h, r, fb, attend):
    """One pre-norm decoder layer on the given rows; ``attend(q, k, v)`` does attention."""
    if r is None:
        r = h
        x = layer.input_layernorm(h)
    else:
        x, r = layer.input_layernorm(h, r)
    q, k, v = qkv(layer.self_attn, positions, x)
    o = attend(q, k, v)
    h, _ = layer.self_attn.o_proj(o)
    x, r = layer.post_attention_layernorm(h, r)
    return layer.mlp(x, forward_batch=fb), r


def splice(fb, model, plan: BatchPlan) -> None:
    """Copy every span's KV into the request's slots, keys re-rotated, in all layers."""
    if plan.span_rows.numel() == 0:
        return
    rope = model.layers[0].self_attn.rotary_emb
    cos, sin = delta_cos_sin(rope.cos_sin_cache, plan.span_delta)
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


def _detect_and_select(fb, pool, layer, group: SpanGroup, h, r, influence=None) -> None:
    """At ``l_det``: fresh K/V of the group's span rows vs the spliced ones, then select."""
    cfg, rows = group.cfg, group.rows
    n = rows.numel()
    deviation = None
    if cfg.method != "epic":
        hs = gather_rows(h, rows)
        if r is None:
            x = layer.input_layernorm(hs)
        else:
            x = layer.input_layernorm(hs, gather_rows(r, rows))[0]
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
        _write_kv(pool, ra, loc, k, v)  # fresh K/V at l_det for every span token
    keep, counts = [], []
    for lo, hi, _ in group.segments:
        scores = None if influence is None else influence[group.src[lo:hi]]
        dev = None if deviation is None else deviation[lo:hi]
        mask = select_tokens(cfg, hi - lo, dev, scores)
        keep.append(rows[lo:hi][mask.to(rows.device)])
        counts.append(int(keep[-1].numel()))
    group.selected = torch.cat(keep) if keep else rows[:0]
    group.seg_selected = counts


def relay_extend(model, input_ids, positions, fb, plan: BatchPlan, hidden_store, influence=None):
    """The relay forward of an extend batch; returns final-norm hidden states ``[N, H]``."""
    splice(fb, model, plan)
    h = model.embed_tokens(input_ids)
    r = None
    last_phase = rows = rows_cpu = row_pos = None
    for lid, layer in enumerate(model.layers):
        for g in plan.groups:
            if lid == g.sched.l_start and lid > 0 and g.sched.needs_hidden() and g.rows.numel():
                scatter_rows(h, g.rows, gather_rows(hidden_store, g.src))
                r[g.rows] = 0
            if lid == g.sched.l_det and lid <= g.sched.l_end and g.rows.numel():
                _detect_and_select(fb, plan.kv_pool, layer, g, h, r, influence)
        phase = tuple(_phase(g, lid) for g in plan.groups)
        if phase != last_phase:  # the active rows change at group boundaries only
            last_phase = phase
            parts = [plan.normal_rows]
            for g, ph in zip(plan.groups, phase, strict=True):
                if ph == "dense":
                    parts.append(g.rows)
                elif ph == "selected":
                    parts.append(g.selected)
            rows = torch.cat(parts).sort().values if len(parts) > 1 else parts[0]
            rows_cpu = rows.cpu()  # one host sync per row set, not per layer
            row_pos = positions[rows]
        if rows.numel() == 0:
            continue

        def attend(q, k, v, rows=rows, rows_cpu=rows_cpu, layer=layer):
            return attend_rows(fb, plan, layer.self_attn.attn, q, k, v, rows, rows_cpu)

        # gather / scatter of the active rows: Triton on CUDA, plain indexing elsewhere
        r_in = None if r is None else gather_rows(r, rows)
        h_out, r_out = _layer(layer, row_pos, gather_rows(h, rows), r_in, fb, attend)
        if r is None:
            r = torch.zeros_like(h)
        scatter_rows(h, rows, h_out)
        scatter_rows(r, rows, r_out)
    out, _ = model.norm(h, r)
    return out


def capture_decode(
    model,
    input_ids,
    positions,
    fb,
    capture_layer: int | None,
    hidden_store: torch.Tensor | None,
    influence: torch.Tensor | None = None,
    influence_layer: int | None = None,
    req_to_token: torch.Tensor | None = None,
):
    """Stock-equivalent decode that also stores, per decoded token at its KV slot, the
    residual stream entering ``capture_layer`` and (if ``influence`` is given) accumulates
    the attention mass each context token receives at ``influence_layer``."""
    h = model.embed_tokens(input_ids)
    r = None
    if influence is not None:
        influence[fb.out_cache_loc] = 0.0  # fresh slots start with no influence
    for lid, layer in enumerate(model.layers):
        if lid == capture_layer and hidden_store is not None:
            stream = h if r is None else h + r
            hidden_store[fb.out_cache_loc] = stream.to(hidden_store.dtype)
        track = influence is not None and lid == influence_layer

        def attend(q, k, v, radix_attn=layer.self_attn.attn, track=track):
            out = radix_attn(q, k, v, fb)
            if track:
                accumulate_influence(fb, radix_attn, q, influence, req_to_token)
            return out

        h, r = _layer(layer, positions, h, r, fb, attend)
    out, _ = model.norm(h, r)
    return out


def accumulate_influence(fb, radix_attn, q, influence: torch.Tensor, req_to_token) -> None:
    """``influence[slot] += sum over heads of the attention probability`` that each decode
    query puts on each context token (after the query's own KV was written)."""
    hq, d = radix_attn.tp_q_head_num, radix_attn.qk_head_dim
    group = hq // radix_attn.tp_k_head_num
    pool = radix_attn_pool(radix_attn)
    keys = pool.get_key_buffer(radix_attn.layer_id)
    q3 = q.reshape(-1, hq, d).float()
    seq_lens = fb.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        slots = req_to_token[fb.req_pool_indices[i], :seq_len].long()
        k = keys[slots].float().repeat_interleave(group, dim=1)  # [T, Hq, D]
        logits = torch.einsum("hd,thd->ht", q3[i], k) * radix_attn.scaling
        influence.index_add_(0, slots, logits.softmax(dim=-1).sum(dim=0))


_POOLS: dict[int, object] = {}


def radix_attn_pool(radix_attn):
    """The KV pool registered for this attention layer (see :func:`bind_pool`)."""
    return _POOLS[id(radix_attn)]


def bind_pool(model, pool) -> None:
    """Remember the KV pool for the model's attention layers (decode reads keys from it)."""
    for layer in model.layers:
        _POOLS[id(layer.self_attn.attn)] = pool
