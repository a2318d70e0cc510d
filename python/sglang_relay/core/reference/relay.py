"""The relay prefill of the reference executor (:mod:`sglang_relay.core.reference`).

:func:`relay_prefill` computes a downstream prompt whose span occurrences
(:class:`SpanOccurrence`) reuse upstream KV (an :class:`~.record.UpstreamRecord`) under a
:class:`RelayConfig` (any of the five methods; ``standard`` is the exact full prefill,
also :func:`~.oracles.exact_prefill`) and returns a :class:`RelayResult`. Optional teacher-forced
tokens after the prompt run as normal rows in the same pass, which equals prefilling and
then extending with them. Beside it: the splice of upstream KV, detection and selection
at ``l_det``, the selection signals (influence, the context masses of
:func:`record_context_mass` / :func:`span_context_mass` from the span tokens' decode
queries, the probe of :func:`last_row_probe`). The spans and the splice are in
:mod:`.spans`, the oracles (:func:`~.oracles.exact_kv_prefill`: exact KV for a chosen
selection, :func:`~.oracles.true_value_deviation`: the deviation a detector approximates)
in :mod:`.oracles`.

Semantics (identical to the runtime): span rows first get the upstream KV in all layers,
keys re-rotated by ``new_pos - old_pos``. At ``l_start`` (if ``0 < l_start < L`` and the
schedule recomputes anything) their stream is replaced by the stored one; at ``l_det`` (if
``l_det <= l_end``) their fresh K/V are compared with the stored K/V (value or key
deviation), written into that layer, and tokens are selected per span occurrence
(deviation, influence at ``l_det`` if ``tau_inf`` is set, first/last tokens, cap). Active
rows per layer: normal rows, all span rows in ``[l_start, l_det)``, the selected span rows
in ``[l_det, l_end]``. Active rows write their K/V, then attend over all positions, causal
by position. The last prompt token is always a normal row.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from sglang_relay.core.attention import attention_probs, visible
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference.model import KVCache, RefModel, _run_layer
from sglang_relay.core.reference.record import UpstreamRecord
from sglang_relay.core.reference.spans import (
    RelayResult,
    SpanOccurrence,
    _check_selection,
    _check_spans,
    _influence,
    _span_rows,
    _splice,
)
from sglang_relay.core.selection import (
    context_mass,
    kv_deviation,
    probe_layers,
    probe_pays,
    probed_mass,
    select_runs,
)

__all__ = [
    "last_row_probe",
    "record_context_mass",
    "record_decode_queries",
    "relay_prefill",
    "span_context_mass",
]


@torch.no_grad()
def relay_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    spans: Sequence[SpanOccurrence],
    cfg: RelayConfig | None,
    *,
    forced: Sequence[int] = (),
    capture_hidden: bool = False,
    selection: torch.Tensor | None = None,
) -> RelayResult:
    """Prefill ``prompt`` (``T`` tokens) reusing upstream KV for ``spans`` under ``cfg``.

    ``cfg`` ``None`` or method ``standard``: exact full prefill (spans ignored). ``forced``
    tokens (``m``) follow the prompt as normal rows, all layers, in the same pass; that
    equals a prefill followed by an extend with them (the cache at each layer is final
    once that layer ran). ``selection`` (``[S]`` bool over the span tokens in prompt
    order) replaces the rule's choice at ``l_det`` (oracle studies); the detection still
    runs and writes its fresh K/V. See the module docstring for the semantics.
    """
    spans = sorted(spans, key=lambda s: s.prompt_start)
    use_spans = cfg is not None and cfg.method != "standard" and len(spans) > 0
    if use_spans:
        _check_spans(prompt, spans)
    ids = list(prompt) + list(forced)
    total = len(ids)
    num_l = ref.num_layers
    dev = ref.device
    cache = KVCache.empty(ref, total)
    hs = ref.embed(torch.tensor(ids, dtype=torch.long, device=dev))  # [T + m, hidden]
    hidden = torch.empty(num_l, total, ref.hidden_size, dtype=ref.dtype) if capture_hidden else None
    all_rows = torch.arange(total, device=dev)
    result = RelayResult(logits=torch.empty(0), cache=cache, prompt_len=len(prompt))

    if not use_spans:
        for lid in range(num_l):
            if hidden is not None:
                hidden[lid] = hs
            _run_layer(ref, lid, hs, all_rows, cache, total)
        result.logits = ref.logits(hs[len(prompt) - 1 :])
        result.hidden = hidden
        return result

    assert cfg is not None
    sched = cfg.schedule(num_l)
    span_rows = _span_rows(spans, dev)  # [S] ascending
    bounds = [0]
    for s in spans:
        bounds.append(bounds[-1] + s.length)
    normal = torch.ones(total, dtype=torch.bool, device=dev)
    normal[span_rows] = False
    normal_rows = all_rows[normal]

    _splice(ref, cache, spans, span_rows)
    probing = probe_pays(cfg, span_rows.numel())  # the last-row probe runs (cfg.probe)

    selected_rows = span_rows[:0]
    counts = [0] * len(spans)
    for lid in range(num_l):
        if lid == sched.l_start and lid > 0 and sched.needs_hidden():
            stored = [s.record.hidden for s in spans]
            if any(h is None for h in stored):
                raise ValueError("this schedule needs the upstream hidden states")
            hs[span_rows] = torch.cat(
                [s.record.hidden[s.span_start : s.span_start + s.length, lid] for s in spans]
            ).to(hs.dtype)
        if lid == sched.l_det and sched.l_det <= sched.l_end:
            infl = _influence(spans, lid) if cfg.tau_inf is not None else None
            if cfg.ranks_context:
                ctx = span_context_mass(ref, spans, cfg.context_layer(num_l))
            else:
                ctx = None
            if probing:
                att = last_row_probe(ref, prompt, spans)[list(probe_layers(num_l))].mean(0)
                ctx = probed_mass(ctx, att, cfg.probe)
            mask, counts, result.deviation = _detect(
                ref,
                cfg,
                lid,
                hs,
                span_rows,
                bounds,
                cache,
                infl,
                ctx,
                reserve=int(probing),
                answers=[s.answer for s in spans],
            )
            if selection is not None:
                _check_selection(selection, span_rows.numel())
                mask = selection.to(mask.device)
                counts = [int(mask[lo:hi].sum()) for lo, hi in pairwise(bounds)]
            selected_rows = span_rows[mask]
            result.selected_mask = mask
        if hidden is not None:
            hidden[lid] = hs
        parts = [normal_rows]
        if sched.l_start <= lid < sched.l_det:
            parts.append(span_rows)
        elif sched.l_det <= lid <= sched.l_end:
            parts.append(selected_rows)
        rows = torch.cat(parts).sort().values
        _run_layer(ref, lid, hs, rows, cache, total)

    recomputed = sum(
        n * sched.dense_layers + c * sched.sparse_layers
        for n, c in zip([s.length for s in spans], counts, strict=True)
    )
    if probing:  # the probe's row, charged to the request's cap
        recomputed += num_l
    span_total = sum(s.length for s in spans)
    result.logits = ref.logits(hs[len(prompt) - 1 :])
    result.span_lengths = [s.length for s in spans]
    result.selected = counts
    result.reuse_rate = 1.0 - recomputed / (span_total * num_l)
    result.hidden = hidden
    return result


@torch.no_grad()
def last_row_probe(
    ref: RefModel, prompt: Sequence[int], spans: Sequence[SpanOccurrence], *, heads: bool = False
) -> torch.Tensor:
    """``[L, S]``: the attention (mean over query heads) the last prompt row gives each span
    token (prompt order) in a *probe* pass, in every layer: the span KV spliced as is, and
    only the rows before the first span (their KV does not depend on the spans, so it is
    final) and the last prompt row computed; the rows between are left out of the probe's
    attention (``cfg.probe``). ``heads``: ``[L, H_q, S]``, per query head (studies)."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    span_rows = _span_rows(spans, ref.device)
    total = len(prompt)
    if int(span_rows.max()) >= total - 1:
        raise ValueError("the last prompt row must come after the spans")
    cache = KVCache.empty(ref, total)
    _splice(ref, cache, spans, span_rows)
    dev = ref.device
    first = int(span_rows.min())
    rows = torch.cat([torch.arange(first, device=dev), torch.tensor([total - 1], device=dev)])
    known = torch.zeros(total, dtype=torch.bool, device=dev)
    known[span_rows] = known[rows] = True
    h = ref.embed(torch.tensor(list(prompt), dtype=torch.long, device=dev)[rows])
    out = []
    for lid, layer in enumerate(ref.layers):
        q, k, v = ref.qkv(layer, layer.input_layernorm(h), rows)
        cache.k[lid, rows], cache.v[lid, rows] = ref.stored(k), ref.stored(v)
        seen = visible(rows, total, ref.window[lid]) & known[None, :]
        keys, values = ref.expand(lid, cache.k[lid], cache.v[lid])
        probs = attention_probs(q, keys, seen, ref.scale, ref.sinks[lid])  # [n, G, R, T]
        last = probs[-1][..., span_rows]  # [G, R, S]
        out.append(last.reshape(-1, span_rows.numel()) if heads else last.mean((0, 1)))
        o = torch.einsum("ngrt,tgd->ngrd", probs, values).reshape(rows.numel(), -1)
        h = ref.finish(layer, h, o)
    return torch.stack(out)


def _detect(
    ref: RefModel,
    cfg: RelayConfig,
    lid: int,
    hs: torch.Tensor,
    span_rows: torch.Tensor,
    bounds: list[int],
    cache: KVCache,
    influence: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
    *,
    reserve: int = 0,
    answers: list[bool] | None = None,
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Detection at ``l_det``: deviation of fresh vs stored K/V of the span rows (``[S]``),
    fresh K/V written into layer ``lid``, selection per span occurrence (``bounds``: segment
    offsets into ``span_rows``; ``influence``: ``[S]`` scores or ``None``). With
    ``signal="context"`` the ``[S]`` recorded ``context`` masses rank instead (no pass).
    ``reserve``: tokens of the cap spent on the probe row; ``answers``: which occurrences
    are reasoning answers (:func:`~sglang_relay.core.selection.select_runs`).
    Returns the ``[S]`` selection mask, counts per span and the scores."""
    deviation = context
    if cfg.detects:
        x = ref.layers[lid].input_layernorm(hs[span_rows])
        _, k, v = ref.qkv(ref.layers[lid], x, span_rows)
        if cfg.signal == "key":
            deviation = kv_deviation(k, cache.k[lid, span_rows])
        else:
            deviation = kv_deviation(v, cache.v[lid, span_rows])
        cache.k[lid, span_rows] = ref.stored(k)
        cache.v[lid, span_rows] = ref.stored(v)
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    masks = select_runs(cfg, lengths, deviation, influence, reserve=reserve, answers=answers)
    keep = [m.to(span_rows.device) for m in masks]
    return torch.cat(keep), [int(m.sum()) for m in keep], deviation


def record_context_mass(ref: RefModel, rec: UpstreamRecord, layer: int) -> torch.Tensor:
    """``[n]`` context mass of the span tokens at ``layer`` (:func:`~sglang_relay.core.
    selection.context_mass`): their decode queries (from the stored stream entering
    ``layer``) over the upstream prompt's KV and the span's own, as the runtime computes it
    when it records the span. Cached on the record."""
    if layer not in rec.context:
        q, keys, pos = record_decode_queries(ref, rec, layer)
        rec.context[layer] = context_mass(
            q, keys, pos, len(rec.prompt), ref.scale, window=ref.window[layer],
            sinks=ref.sinks[layer],
        )  # fmt: skip
    return rec.context[layer]


def span_context_mass(ref: RefModel, spans: Sequence[SpanOccurrence], layer: int) -> torch.Tensor:
    """``[S]``: :func:`record_context_mass` of the span occurrences' tokens, in ``spans``'
    order."""
    return torch.cat(
        [
            record_context_mass(ref, s.record, layer)[s.span_start : s.span_start + s.length]
            for s in spans
        ]
    )


def record_decode_queries(
    ref: RefModel, rec: UpstreamRecord, layer: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [n, H_q, D], keys [P + n, H_kv, D], positions [n])`` at ``layer``: the span
    tokens' decode queries rebuilt from the stored stream entering ``layer``, and the keys
    of the upstream prompt and the span they attended to (MLA: the cached rows up-projected
    per head, ``[P + n, H, c + p]``, :meth:`~.model.RefModel.expand_keys`)."""
    if rec.hidden is None or rec.k is None:
        raise ValueError("the context mass needs the upstream record's hidden states and KV")
    p, n = len(rec.prompt), rec.k.shape[1]
    if rec.prompt_k is not None:  # the decode attended to a relayed prompt
        prompt_k = rec.prompt_k[layer]
    else:
        prompt_k = relay_prefill(ref, rec.prompt, [], None).cache.k[layer, :p]
    keys = ref.expand_keys(layer, torch.cat((prompt_k, rec.k[layer])))
    pos = torch.arange(p, p + n, device=ref.device)
    lyr = ref.layers[layer]
    q, _, _ = ref.qkv(lyr, lyr.input_layernorm(rec.hidden[:, layer].to(ref.dtype)), pos)
    return q, keys, pos
