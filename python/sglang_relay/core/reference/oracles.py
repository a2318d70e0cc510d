"""The reference executor's oracles: exact prefill (:func:`exact_prefill`), the exact KV of a
chosen selection (:func:`exact_kv_prefill`) and the value deviation a detector
approximates (:func:`true_value_deviation`)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise

import torch

from sglang_relay.core.reference.model import KVCache, RefModel, _run_layer
from sglang_relay.core.reference.relay import relay_prefill
from sglang_relay.core.reference.spans import (
    RelayResult,
    SpanOccurrence,
    _check_selection,
    _check_spans,
    _span_rows,
    _splice,
    _upstream_kv,
)
from sglang_relay.core.selection import (
    kv_deviation,
)


def true_value_deviation(
    ref: RefModel,
    spans: Sequence[SpanOccurrence],
    exact: RelayResult,
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """``[S]`` per span token (prompt order): value deviation of the reused upstream KV from
    the exact prefill's, averaged over ``layers`` (default: all). The ground truth a
    detector approximates."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    rows = _span_rows(spans, ref.device)
    _, src_v = _upstream_kv(spans)
    layers = range(ref.num_layers) if layers is None else layers
    return torch.stack([kv_deviation(src_v[lid], exact.cache.v[lid, rows]) for lid in layers]).mean(
        0
    )


def exact_kv_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    spans: Sequence[SpanOccurrence],
    exact: RelayResult,
    selection: torch.Tensor,
    *,
    forced: Sequence[int] = (),
) -> RelayResult:
    """Oracle: the spliced upstream KV, except the ``selection`` (``[S]`` bool, span tokens
    in prompt order) whose KV is the exact prefill's in every layer; only the non-span rows
    are computed. ``exact``: :func:`exact_prefill` of the same prompt and ``forced``.
    Reports the reuse of recomputing the selected tokens in every layer."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    _check_spans(prompt, spans)
    ids = list(prompt) + list(forced)
    total = len(ids)
    if exact.cache.length != total:
        raise ValueError("exact must be the exact prefill of the same prompt and forced tokens")
    cache = KVCache.empty(ref, total)
    hs = ref.embed(torch.tensor(ids, dtype=torch.long, device=ref.device))
    span_rows = _span_rows(spans, ref.device)
    _check_selection(selection, span_rows.numel())
    _splice(ref, cache, spans, span_rows)
    rows = span_rows[selection.to(span_rows.device)]
    cache.k[:, rows] = exact.cache.k[:, rows]
    cache.v[:, rows] = exact.cache.v[:, rows]
    normal = torch.ones(total, dtype=torch.bool, device=ref.device)
    normal[span_rows] = False
    normal_rows = torch.arange(total, device=ref.device)[normal]
    for lid in range(ref.num_layers):
        _run_layer(ref, lid, hs, normal_rows, cache, total)
    result = RelayResult(
        logits=ref.logits(hs[len(prompt) - 1 :]), cache=cache, prompt_len=len(prompt)
    )
    result.span_lengths = [s.length for s in spans]
    result.selected_mask = selection
    bounds = [0, *accumulate(result.span_lengths)]
    result.selected = [int(selection[lo:hi].sum()) for lo, hi in pairwise(bounds)]
    result.reuse_rate = 1.0 - float(selection.sum()) / span_rows.numel()
    return result


def exact_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    *,
    forced: Sequence[int] = (),
    capture_hidden: bool = False,
) -> RelayResult:
    """The exact full prefill (every row, every layer); ``forced`` as in :func:`relay_prefill`."""
    return relay_prefill(ref, prompt, [], None, forced=forced, capture_hidden=capture_hidden)
