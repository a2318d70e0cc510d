"""Span occurrences in a downstream prompt of the reference executor (:class:`SpanOccurrence`),
what a relay prefill returns (:class:`RelayResult`), and the pieces every relay pass shares:
the checks of spans and selections, the span rows, the upstream KV and its splice with keys
re-rotated to their new positions, the influence scores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sglang_relay.core.reference.model import KVCache, RefModel
from sglang_relay.core.reference.record import UpstreamRecord
from sglang_relay.core.rope import apply_rotation, delta_cos_sin


@dataclass(frozen=True)
class SpanOccurrence:
    """``prompt[prompt_start : prompt_start + length]`` reuses
    ``record.span_tokens[span_start : span_start + length]``. ``answer``: the run is a
    reasoning model's answer (capped at ``answer_max_ratio``, as the server caps a run
    of a span stored with reasoning before its answer)."""

    prompt_start: int
    record: UpstreamRecord
    span_start: int
    length: int
    answer: bool = False


@dataclass
class RelayResult:
    """Outcome of :func:`relay_prefill`.

    Attributes:
        logits: ``[1 + m, vocab]`` float32: the last prompt row, then one row per forced token.
        cache: final KV of the prompt and the forced tokens, ``[L, T + m, H_kv, D]``.
        prompt_len: ``T``.
        span_lengths, selected: per span occurrence (prompt order), tokens and selected ones.
        reuse_rate: METHOD.md's token-layer reuse over all spans (0 for standard).
        deviation: ``[S]`` detection scores over the span tokens in prompt order,
            ``S = sum(span_lengths)`` (``None`` if none computed).
        selected_mask: ``[S]`` bool, the span tokens selected at ``l_det``.
        hidden: ``[L, T + m, hidden]`` stream entering each layer if captured.
    """

    logits: torch.Tensor
    cache: KVCache
    prompt_len: int
    span_lengths: list[int] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)
    reuse_rate: float = 0.0
    deviation: torch.Tensor | None = None
    selected_mask: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def recomputed_fraction(self) -> float:
        """Recomputed span token-layers over all span token-layers (``1 - reuse``)."""
        return 1.0 - self.reuse_rate if self.span_lengths else 0.0

    @property
    def selected_fraction(self) -> float:
        """Selected span tokens over all span tokens."""
        total = sum(self.span_lengths)
        return sum(self.selected) / total if total else 0.0


def _check_spans(prompt: Sequence[int], spans: Sequence[SpanOccurrence]) -> None:
    end = 0
    for s in spans:
        if s.length <= 0 or s.prompt_start < end:
            raise ValueError("span occurrences must be non-empty, sorted and non-overlapping")
        if s.prompt_start + s.length > len(prompt) - 1:
            raise ValueError("the last prompt token must not be part of a span")
        if s.record.k is None or s.span_start + s.length > s.record.k.shape[1]:
            raise ValueError("span occurrence exceeds the upstream record's KV")
        want = s.record.span_tokens[s.span_start : s.span_start + s.length]
        if list(prompt[s.prompt_start : s.prompt_start + s.length]) != list(want):
            raise ValueError(f"prompt tokens at {s.prompt_start} differ from the span tokens")
        end = s.prompt_start + s.length


def _check_selection(selection: torch.Tensor, n: int) -> None:
    if selection.dtype != torch.bool or selection.shape != (n,):
        raise ValueError(f"selection must be a bool tensor of shape [{n}] (the span tokens)")


def _span_rows(spans: Sequence[SpanOccurrence], device: torch.device) -> torch.Tensor:
    return torch.cat(
        [torch.arange(s.prompt_start, s.prompt_start + s.length, device=device) for s in spans]
    )


def _upstream_kv(spans: Sequence[SpanOccurrence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode-phase ``(K, V)`` ``[L, S, H_kv, D]`` of ``spans``, concatenated in order."""
    k = torch.cat([s.record.k[:, s.span_start : s.span_start + s.length] for s in spans], 1)
    v = torch.cat([s.record.v[:, s.span_start : s.span_start + s.length] for s in spans], 1)
    return k, v


def _splice(
    ref: RefModel, cache: KVCache, spans: Sequence[SpanOccurrence], span_rows: torch.Tensor
) -> None:
    """Upstream KV of ``spans`` (prompt order) into ``cache`` at ``span_rows`` in every
    layer, keys re-rotated by new - old position (only the columns ``ref.rot_slice`` in
    ``ref.is_neox``'s layout: MLA's latent is copied bit for bit)."""
    src_k, src_v = _upstream_kv(spans)
    old_pos = torch.cat(
        [
            s.record.span_start_pos + torch.arange(s.span_start, s.span_start + s.length)
            for s in spans
        ]
    ).to(span_rows.device)
    delta = span_rows - old_pos
    rotations = {}  # per RoPE table (one, or one per layer type)
    for lid in range(ref.num_layers):
        kind = ref.rope_kind[lid]
        if kind not in rotations:
            table = ref.cos_sin_cache(int(delta.abs().max()) + 1, lid)
            rotations[kind] = delta_cos_sin(table, delta)
        cos, sin = rotations[kind]
        # stored keys rotated in float32, then rounded once more into the engine's pool
        k, turn = src_k[lid].clone(), ref.rot_slice
        k[..., turn] = apply_rotation(k[..., turn], cos, sin, is_neox=ref.is_neox)
        cache.k[lid, span_rows] = ref.stored(k)
        cache.v[lid, span_rows] = src_v[lid]


def _influence(spans: Sequence[SpanOccurrence], lid: int) -> torch.Tensor | None:
    """``[S]`` influence at layer ``lid`` of the span tokens (``None`` if any span has none;
    then selection ignores influence, as the runtime does without scores)."""
    if any(s.record.influence is None for s in spans):
        return None
    return torch.cat(
        [s.record.influence[s.span_start : s.span_start + s.length, lid] for s in spans]
    )
