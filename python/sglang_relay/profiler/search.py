"""The profiler's search over relay configs: every candidate measured on every calibration
relay (first-token KL, top-1, teacher-forced top-1, greedy prefix, reuse), with the
``max_ratio`` cap that keeps its reuse at ``--min-reuse``; the layer range first, then the
selection rule by coordinate descent; the choice (:func:`choose`)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from typing import Any

from sglang_relay.bench.intervals import paired_ci
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.operating import reuse_cap
from sglang_relay.core.reference import (
    RefModel,
    RelayResult,
    fidelity,
    relay_prefill,
)

KL_TIE = 0.02  # candidates within 2 % of the best KL count as tied


# The measures a user sees beside KL: a candidate whose first-token top-1 or
# greedy prefix is worse than the best eligible candidate's beyond the paired 95 %
# bootstrap interval over the calibration relays (the evaluation's verdict rule) is not
# chosen, whatever its KL. Candidates logged without per-relay values (older profiles)
# are held to a fixed slack instead: this many relays' worth (1/n each, n relays)
MEASURE_SLACK_RELAYS = 1


BAR_MEASURES = ("top1", "greedy_prefix")


def with_cap(cfg: RelayConfig, num_layers: int, min_reuse: float, scale: float = 1.0):
    cap = reuse_cap(cfg, num_layers, min_reuse)
    if cap is None:
        return None
    return replace(cfg, max_ratio=max(0.001, math.floor(1000 * cap * scale) / 1000))


def evaluate(
    ref: RefModel, relays: list[Any], exacts: list[RelayResult], cfg: RelayConfig
) -> dict[str, Any]:
    """Calibration metrics of one candidate (``per_relay``: the bar's measures per relay)."""
    kls, tfs, top1s, prefixes, reuses, spans, sel = [], [], [], [], [], 0, 0
    for relay, exact in zip(relays, exacts, strict=True):
        res = relay_prefill(ref, relay.prompt, relay.spans, cfg, forced=relay.continuation[:-1])
        f = fidelity(exact.logits, res.logits, relay.continuation)
        kls.append(f["first_token_kl"])
        tfs.append(f["tf_top1"])
        top1s.append(f["top1"])
        prefixes.append(f["greedy_prefix"])
        reuses.append(res.reuse_rate)
        spans += sum(res.span_lengths)
        sel += sum(res.selected)
    return {
        "per_relay": {"top1": top1s, "greedy_prefix": prefixes},
        "first_token_kl": statistics.fmean(kls),
        "first_token_kl_median": statistics.median(kls),
        "tf_top1": statistics.fmean(tfs),
        "top1": statistics.fmean(top1s),
        "greedy_prefix": statistics.fmean(prefixes),
        "relays": len(kls),
        "reuse_min": min(reuses),
        "reuse_mean": statistics.fmean(reuses),
        "selected_fraction": sel / spans if spans else 0.0,
    }


def rank_key(entry: dict[str, Any], best_kl: float) -> tuple:
    """The selection rule's order (lower is better) among eligible candidates."""
    m = entry["metrics"]
    tied = m["first_token_kl"] <= best_kl * (1 + KL_TIE)
    return (0 if tied else 1, -m["tf_top1"] if tied else m["first_token_kl"], -m["reuse_mean"])


def _behind(entry: dict[str, Any], leader: dict[str, Any], measure: str, slack: float) -> bool:
    """Whether ``entry`` is worse than ``leader`` on ``measure``: beyond the paired 95 %
    interval over the relays when both carry per-relay values, else by more than
    ``slack``. A candidate lacking the measure (logged by an older profiler) is not."""
    if measure not in entry["metrics"]:
        return False
    mine = entry.get("per_relay", {}).get(measure)
    best = leader.get("per_relay", {}).get(measure)
    if mine is not None and best is not None and len(mine) == len(best) > 0:
        return paired_ci(mine, best)[1] < 0
    return entry["metrics"][measure] < leader["metrics"][measure] - slack


def user_measure_bar(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates no worse than the best one on first-token top-1, then, among those,
    on greedy prefix (:func:`_behind`: the paired interval, or :data:`MEASURE_SLACK_RELAYS`
    relays' worth for candidates without per-relay values). Bars apply in that order, each
    among the survivors of the one before, so the result is never empty (the leader of
    each bar passes it)."""
    n = max((int(c["metrics"].get("relays", 0)) for c in candidates), default=0)
    if n == 0:
        return candidates
    slack = MEASURE_SLACK_RELAYS / n + 1e-6  # metrics are rounded to 6 decimals
    kept = candidates
    for measure in BAR_MEASURES:
        rated = [c for c in kept if measure in c["metrics"]]
        if rated:
            leader = max(rated, key=lambda c: c["metrics"][measure])
            kept = [c for c in kept if not _behind(c, leader, measure, slack)]
    return kept


def choose(search: list[dict[str, Any]], min_reuse: float) -> dict[str, Any] | None:
    """The candidate a profile keeps: reuse >= ``min_reuse`` on every relay, first-token top-1
    and then greedy prefix no worse than the best such candidate's beyond the paired
    interval (:func:`user_measure_bar`, the constraint form of a multi-measure
    objective),
    then the lowest mean first-token KL (:func:`rank_key`: near-ties by teacher-forced top-1,
    then reuse)."""
    eligible = [e for e in search if e["metrics"]["reuse_min"] >= min_reuse - 1e-9]
    if not eligible:
        return None
    kept = user_measure_bar(eligible)
    best_kl = min(e["metrics"]["first_token_kl"] for e in kept)
    return min(kept, key=lambda e: rank_key(e, best_kl))


class Search:
    """Evaluates candidates once each (by config) and keeps the log."""

    def __init__(self, ref, relays, exacts, min_reuse: float, bar: Any) -> None:
        self.ref, self.relays, self.exacts = ref, relays, exacts
        self.min_reuse = min_reuse
        self.log: list[dict[str, Any]] = []
        self._seen: dict[RelayConfig, dict[str, Any]] = {}
        self.bar = bar
        self.context_layers: dict[str, Any] = {}  # pick_context_layer's table

    def run(self, cfg: RelayConfig | None, stage: str) -> dict[str, Any] | None:
        if cfg is None:
            return None
        if cfg in self._seen:
            return self._seen[cfg]
        t0 = time.perf_counter()
        metrics = evaluate(self.ref, self.relays, self.exacts, cfg)
        per_relay = metrics.pop("per_relay")
        entry = {
            "stage": stage,
            "config": cfg.to_dict(),
            "metrics": {k: round(v, 6) for k, v in metrics.items()},
            "per_relay": {k: [round(x, 4) for x in v] for k, v in per_relay.items()},
            "seconds": round(time.perf_counter() - t0, 2),
        }
        self._seen[cfg] = entry
        self.log.append(entry)
        self.bar.update(1)
        self.bar.set_postfix_str(
            f"{describe(cfg)} KL={metrics['first_token_kl']:.4f} TF={metrics['tf_top1']:.3f}"
        )
        return entry

    def best(self, entries: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        return choose([e for e in entries if e is not None], self.min_reuse)


def describe(cfg: RelayConfig) -> str:
    ctx = f" l_ctx={cfg.l_ctx}" if cfg.ranks_context else ""
    ctx += f" probe={cfg.probe}" if cfg.probes else ""
    return (
        f"({cfg.l_start},{cfg.l_det},{cfg.l_end}) {cfg.signal[0]}{ctx} tau={cfg.tau_dev} "
        f"k={cfg.first_k} suf={cfg.l_suf} cap={cfg.max_ratio}"
    )


def layer_ranges(num_layers: int, quick: bool) -> list[tuple[int, int, int]]:
    """Stage 1 candidates ``(l_start, l_det, l_end)``: detection after one or two dense
    layers at several depths, rectification through the last layer (and two shorter ends)."""
    last = num_layers - 1
    if quick:
        pairs = [(0, 1), (1, 2), (3, 4), (6, 7)]
        return [(s, d, last) for s, d in pairs if d < num_layers]
    pairs = [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (2, 4), (4, 5), (6, 7), (9, 10)]
    ranges = [(s, d, last) for s, d in pairs if d < num_layers]
    ranges += [(3, 4, last - 2), (3, 4, last - 4)]
    return ranges


# the rule stage 1 uses: METHOD.md's deviation threshold plus the first tokens of each span
# (they deviate most behind a new prefix)
STAGE1_RULE = RelayConfig(tau_dev=1.5, l_suf=0, first_k=16, signal="value")


AXES: list[tuple[str, list[Any]]] = [
    ("first_k", [0, 8, 16, 24, 32, 40]),
    ("tau_dev", [1.0, 1.5, 2.0, 3.0]),
    ("l_suf", [0, 4, 10]),
    ("signal", ["value", "key"]),
    ("tau_inf", [None, 1.0, 1.45, 2.0]),
]


QUICK_AXES: list[tuple[str, list[Any]]] = [("first_k", [0, 16, 32]), ("tau_dev", [1.0, 1.5])]


def run_search(search: Search, num_layers: int, quick: bool) -> dict[str, Any] | None:
    """Stage 1: layer ranges with :data:`STAGE1_RULE`; stage 2: coordinate descent over
    the selection rule (:data:`AXES`, two rounds) from the best two ranges, then a tighter
    cap. Returns the candidate :func:`choose` picks among everything evaluated."""
    min_reuse = search.min_reuse
    stage1 = []
    for s, d, e in layer_ranges(num_layers, quick):
        cfg = replace(STAGE1_RULE, l_start=s, l_det=d, l_end=e)
        stage1.append(search.run(with_cap(cfg, num_layers, min_reuse), "layer range"))
    ranked = sorted(
        (x for x in stage1 if x is not None),
        key=lambda x: x["metrics"]["first_token_kl"],
    )
    axes = QUICK_AXES if quick else AXES
    for start in ranked[: 1 if quick else 2]:
        current = start
        for _round in range(1 if quick else 2):
            for name, values in axes:
                trial = [current]
                for value in values:
                    cfg = replace(RelayConfig.from_dict(current["config"]), **{name: value})
                    trial.append(search.run(with_cap(cfg, num_layers, min_reuse), f"rule:{name}"))
                current = search.best(trial) or current
        cfg = RelayConfig.from_dict(current["config"])
        search.run(with_cap(cfg, num_layers, min_reuse, 0.8), "rule:cap")
    return search.best(search.log)
