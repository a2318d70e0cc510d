"""The profiler's operating points: for each reuse target, the candidate rules (EPIC-style
first-k, the context rule at a stored layer, the probe rule, each with a head floor) measured
by the search, and the frontier a server maps a request's target through
(:mod:`sglang_relay.core.operating`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.operating import reuse_cap, rule_name
from sglang_relay.profiler.search import Search, choose, with_cap

FRONTIER_TARGETS = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 0.98)


QUICK_FRONTIER_TARGETS = (0.80, 0.90, 0.95)  # --quick: a request's target maps to the next one up


def first_k_rule(num_layers: int, target: float, mean_span: float) -> RelayConfig | None:
    """The detection-free rule at ``target``: the first tokens of each span in every layer
    (EPIC's rule in relay's config space, ``signal="none"``), as many as the budget allows
    at the calibration's mean span length, capped per span so that short spans keep the
    target too. Needs no hidden state and no deviation pass."""
    rule = RelayConfig(
        method="relay", l_start=0, l_det=0, l_end=-1, signal="none", l_suf=0, first_k=1
    )
    cap = reuse_cap(rule, num_layers, target)
    if cap is None:
        return None
    return replace(rule, first_k=max(1, round(cap * mean_span)), max_ratio=cap)


def context_rule(num_layers: int, target: float, l_ctx: int) -> RelayConfig | None:
    """The context-mass rule at ``target``: the tokens with the highest context mass at
    ``l_ctx`` (``signal="context"``) among all the spans a request relays, recomputed in
    every layer; one cap per request (``budget="request"``: on the calibration relays it
    beat a cap per span at every target, 0.70-0.98, e.g. KL 0.0198 vs 0.0263 at 0.95).
    Needs no deviation pass; stores the stream entering ``l_ctx`` per output token."""
    rule = RelayConfig(
        method="relay",
        l_start=0,
        l_det=0,
        l_end=-1,
        signal="context",
        l_ctx=l_ctx,
        tau_dev=0.0,
        l_suf=0,
        first_k=0,
        budget="request",
    )
    cap = reuse_cap(rule, num_layers, target)
    return None if cap is None else replace(rule, max_ratio=cap)


# the power of the last-row probe's attention (``cfg.probe``): chosen on the calibration
# relays (research/studies/selection_study.py --kl-oracle, 8 relays at 0.90: 0.0098 at 0.25,
# 0.0110 at 0.5, 0.0141 without a probe)
PROBE_POWER = 0.25


def probe_rule(num_layers: int, target: float, l_ctx: int) -> RelayConfig | None:
    """:func:`context_rule` with the last-row probe: the context mass times the attention
    the request's last prompt row gives each span token in a probe pass (``probe``), its
    row charged to the cap. Knows the downstream query; costs one row of every layer."""
    rule = context_rule(num_layers, target, l_ctx)
    return None if rule is None else replace(rule, probe=PROBE_POWER)


def with_head(rule: RelayConfig | None, head: int) -> RelayConfig | None:
    """``rule`` with each span's first ``head`` tokens forced (inside the same cap)."""
    return None if rule is None else replace(rule, first_k=head)


def context_layers(num_layers: int, quick: bool) -> list[int]:
    """Candidate layers of the context mass: evenly over the stack (layer 0 included: its
    queries need no stored stream)."""
    step = max(1, num_layers // (5 if quick else 10))
    return list(range(0, num_layers - 1, step))


# targets at which the context layer is chosen (mean of the calibration KLs)
CONTEXT_PICK_TARGETS = (0.80, 0.90)


def pick_context_layer(search: Search, num_layers: int, quick: bool) -> int:
    """The candidate layer whose context rule has the lowest calibration KL, summed over
    :data:`CONTEXT_PICK_TARGETS` (one layer per server: it stores one stream). The KLs per
    layer are kept in ``search.context_layers`` (written into the profile)."""
    table: dict[int, list[float]] = {}
    for layer in context_layers(num_layers, quick):
        runs = [
            search.run(context_rule(num_layers, t, layer), f"context layer {layer}")
            for t in CONTEXT_PICK_TARGETS
        ]
        table[layer] = [r["metrics"]["first_token_kl"] for r in runs if r is not None]
    search.context_layers = {
        "targets": list(CONTEXT_PICK_TARGETS),
        "first_token_kl": {str(k): v for k, v in table.items()},
    }
    return min(table, key=lambda layer: sum(table[layer]))


def run_frontier(
    search: Search,
    rule: RelayConfig,
    num_layers: int,
    mean_span: float,
    targets,
    *,
    quick: bool = False,
    head_floors: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Per reuse target, the best of the profiled deviation rule (its cap solved for the
    target), :func:`first_k_rule`, :func:`context_rule` and :func:`probe_rule` (at the
    layer :func:`pick_context_layer` chose), the last two also with each head floor of
    ``head_floors`` (``--head-floors``; :func:`with_head`), on the calibration relays:
    :func:`choose` among
    those whose reuse is >= the target on every relay (the user-measure bar, then the lowest
    mean first-token KL). A server stores one stream
    per output token, so when the deviation rule and the context rule need different
    layers, the points come from one family (deviation + first-k, or context + first-k):
    the one with the lower KL summed over the targets. The runtime maps a requested target
    to these points (:mod:`sglang_relay.core.operating`)."""
    l_ctx = pick_context_layer(search, num_layers, quick)
    context_names = ["context", "probe"]
    context_names += [f"{n}+head{h}" for h in head_floors for n in ("context", "probe")]
    per_target = []
    for target in targets:
        label = f"frontier {target:.2f}"
        ctx = context_rule(num_layers, target, l_ctx)
        probe = probe_rule(num_layers, target, l_ctx)
        cands = {
            "deviation": with_cap(rule, num_layers, target),
            "first_k": first_k_rule(num_layers, target, mean_span),
            "context": ctx,
            "probe": probe,
        }
        for h in head_floors:
            cands[f"context+head{h}"] = with_head(ctx, h)
            cands[f"probe+head{h}"] = with_head(probe, h)
        per_target.append((target, {k: search.run(c, label) for k, c in cands.items()}))
    families = [("deviation", "first_k", *context_names)]
    if rule.stored_layer(num_layers) != context_rule(num_layers, 0.5, l_ctx).stored_layer(
        num_layers
    ):
        families = [("deviation", "first_k"), ("first_k", *context_names)]

    def family_points(family) -> list[tuple[float, dict, list]]:
        out = []
        for target, cands in per_target:
            allowed = [cands[name] for name in family if cands[name] is not None]
            best = choose(allowed, target)
            if best is not None:
                out.append((target, best, allowed))
        return out

    def family_kl(family) -> float:
        pts = family_points(family)
        return sum(b["metrics"]["first_token_kl"] for _, b, _ in pts) + 1e9 * (
            len(targets) - len(pts)
        )

    family = min(families, key=family_kl)
    points = []
    for target, best, cands in family_points(family):
        cfg = RelayConfig.from_dict(best["config"])
        points.append(
            {
                "target": target,
                "config": best["config"],
                "rule": rule_name(cfg),
                "metrics": best["metrics"],
                "candidates": [
                    {k: c[k] for k in ("config", "metrics", "per_relay") if k in c}
                    for c in cands
                    if c
                ],
            }
        )
    return points


def consistent_base(
    config: RelayConfig, frontier: list[dict[str, Any]], num_layers: int, min_reuse: float
) -> RelayConfig:
    """The profile's base rule (what a server runs without a reuse target): ``config``, or,
    when it would need a different stored layer than the operating points (a server stores
    one), the frontier's point for ``min_reuse``."""
    layers = {RelayConfig.from_dict(p["config"]).stored_layer(num_layers) for p in frontier}
    if not frontier or layers <= {config.stored_layer(num_layers), None}:
        return config
    up = [p for p in frontier if p["target"] >= min_reuse - 1e-9] or frontier[-1:]
    return RelayConfig.from_dict(min(up, key=lambda p: p["target"])["config"])
