"""The profiler's per-layer curves: on each calibration relay, the reused KV (decode-phase,
keys re-rotated) against the downstream exact prefill over the span tokens: key and value
cosine, the residual stream's relative deviation, the adjacent-layer rank correlation of
the per-token value deviation and how concentrated it is."""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from sglang_relay.core.reference import (
    RefModel,
    RelayResult,
)
from sglang_relay.core.rope import apply_rotation, delta_cos_sin
from sglang_relay.core.selection import kv_deviation

TOP_SHARE = 0.15


FIRST = 16


NOISE = 1e-5  # mean deviation below this is float noise (no curve value)


def span_rows_and_reused(
    ref: RefModel, relay: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Span rows of a relay and what reuse puts there: ``rows [S]``, keys re-rotated (as the
    reference's splice turns them) and values ``[L, S, H_kv, D]``, decode streams
    ``[L, S, hidden]``."""
    rows, ks, vs, hs, deltas = [], [], [], [], []
    for s in relay.spans:
        lo, hi = s.span_start, s.span_start + s.length
        rows.append(torch.arange(s.prompt_start, s.prompt_start + s.length))
        deltas.append(rows[-1] - (s.record.span_start_pos + torch.arange(lo, hi)))
        ks.append(s.record.k[:, lo:hi])
        vs.append(s.record.v[:, lo:hi])
        hs.append(s.record.hidden[lo:hi].transpose(0, 1))
    delta = torch.cat(deltas)
    k = torch.cat(ks, 1).clone()
    turn = ref.rot_slice  # the rotated columns (MLA: the latent's are not), each layer's table
    for lid in range(k.shape[0]):
        table = ref.cos_sin_cache(int(delta.abs().max()) + 1, lid)
        cos, sin = delta_cos_sin(table, delta)
        k[lid][..., turn] = apply_rotation(k[lid][..., turn], cos, sin, is_neox=ref.is_neox)
    return torch.cat(rows), k, torch.cat(vs, 1), torch.cat(hs, 1)


def relay_curves(ref: RefModel, relay: Any, exact: RelayResult) -> dict[str, list[float]]:
    """Per-layer comparison of reused vs exact KV over one relay's span tokens."""
    from scipy.stats import spearmanr

    rows, k_re, v_re, h_dec = span_rows_and_reused(ref, relay)
    k_ex, v_ex = exact.cache.k[:, rows], exact.cache.v[:, rows]
    h_ex = exact.hidden[:, rows]
    num_l = ref.num_layers
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "key_cos",
            "value_cos",
            "stream_rel_dev",
            "top15_share",
            "first16_ratio",
            "spearman_value",
            "spearman_key",
        )
    }
    dev_v, dev_k = [], []
    for lid in range(num_l):
        dk = kv_deviation(k_ex[lid], k_re[lid]).clamp_min(0)  # [S]
        dv = kv_deviation(v_ex[lid], v_re[lid]).clamp_min(0)
        dev_k.append(dk)
        dev_v.append(dv)
        out["key_cos"].append(float(1 - dk.mean()))
        out["value_cos"].append(float(1 - dv.mean()))
        rel = (h_dec[lid] - h_ex[lid]).norm(dim=-1) / h_ex[lid].norm(dim=-1)
        out["stream_rel_dev"].append(float(rel.mean()))
        top = max(1, round(TOP_SHARE * dv.numel()))
        total = float(dv.sum())
        noise = float(dv.mean()) < NOISE  # e.g. layer 0: context free, only float noise
        out["top15_share"].append(0.0 if noise else float(dv.topk(top).values.sum()) / total)
        first = torch.zeros_like(dv, dtype=torch.bool)
        for lo in _span_bounds(relay):
            first[lo : lo + FIRST] = True
        ratio = float(dv[first].mean()) / max(float(dv[~first].mean()), 1e-12)
        out["first16_ratio"].append(0.0 if noise else ratio)
    for lid in range(num_l - 1):
        out["spearman_value"].append(_spearman(spearmanr, dev_v[lid], dev_v[lid + 1]))
        out["spearman_key"].append(_spearman(spearmanr, dev_k[lid], dev_k[lid + 1]))
    return out


def _span_bounds(relay: Any) -> list[int]:
    starts, acc = [], 0
    for s in relay.spans:
        starts.append(acc)
        acc += s.length
    return starts


def _spearman(fn: Any, a: torch.Tensor, b: torch.Tensor) -> float:
    value = fn(a.numpy(), b.numpy()).statistic
    return float(value) if math.isfinite(value) else 0.0


def mean_curves(per_relay: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    return {
        key: [
            round(statistics.fmean(vals), 5)
            for vals in zip(*(c[key] for c in per_relay), strict=True)
        ]
        for key in per_relay[0]
    }
