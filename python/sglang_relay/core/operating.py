"""Operating points: a reuse target -> the relay config that runs at it.

Time to first token is almost linear in what is recomputed, so the one knob a user needs is
the reuse they buy (METHOD.md's token-layer reuse, ``1 - recomputed / (|S| * L)``). A
profile's ``frontier`` lists, per reuse target, the rule that had the lowest first-token KL
on the calibration relays at that target (:mod:`sglang_relay.profiler`); every point's
``max_ratio`` caps the selection so that the reuse is at least the target by construction,
per span or, with ``budget="request"``, per request (all its spans in a prefill chunk). A
request's target maps to the point with the smallest profiled target at or above it
(never less reuse than asked); above the last point, and on a model without a profiled
frontier, the cap is solved from the reuse formula for the base rule, unless that rule's
dense layers would take more than a fifth of the target's recompute budget: then the
first tokens of each span are recomputed instead (:func:`position_rule`).

Targets are numbers in (0, 1) or the names of :data:`LEVELS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from sglang_relay.core.config import RelayConfig

LEVELS = {"fidelity": 0.80, "balanced": 0.90, "speed": 0.95}


def parse_target(value: Any) -> float:
    """A reuse target from a number or a level name; ValueError names what is accepted."""
    if isinstance(value, str):
        if value in LEVELS:
            return LEVELS[value]
        try:
            value = float(value)
        except ValueError:
            raise ValueError(
                f"reuse target must be a number in (0, 1) or one of {', '.join(LEVELS)}; "
                f"got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(
            f"reuse target must be a number in (0, 1) or one of {', '.join(LEVELS)}; got {value!r}"
        )
    return float(value)


def reuse_cap(cfg: RelayConfig, num_layers: int, min_reuse: float) -> float | None:
    """Largest ``max_ratio`` (3 decimals, rounded down) that guarantees ``min_reuse`` on
    every span (per request with ``budget="request"``) for ``cfg``'s layer range; ``None``
    if even selecting nothing is not enough:
    ``dense + max_ratio * sparse <= (1 - min_reuse) * L`` token-layers per span token."""
    sched = cfg.schedule(num_layers)
    budget = num_layers * (1.0 - min_reuse) - sched.dense_layers
    if sched.sparse_layers == 0:
        return 1.0 if budget >= 0 else None
    cap = math.floor(1000 * budget / sched.sparse_layers - 1e-9) / 1000
    if cap <= 0:
        return None
    return min(cap, 1.0)


def answer_cap(cfg: RelayConfig, num_layers: int, target: float | None) -> RelayConfig:
    """``cfg`` with reasoning answers capped for reuse ``target`` (None: like the other
    runs) where that cap is above ``cfg``'s own (a request at or below ``target`` keeps
    one cap for all; a rule whose dense layers alone recompute more than ``1 - target``
    keeps its own cap too)."""
    cap = None
    if target is not None and cfg.max_ratio is not None:
        cap = reuse_cap(cfg, num_layers, target)  # None: the rule cannot reach it
    if cap is not None and cap <= cfg.max_ratio:
        cap = None
    return cfg if cfg.answer_max_ratio == cap else replace(cfg, answer_max_ratio=cap)


def at_target(cfg: RelayConfig, num_layers: int, target: float) -> RelayConfig:
    """``cfg`` with its cap solved for ``target``; ValueError if the rule's dense layers
    alone recompute more than ``1 - target``."""
    cap = reuse_cap(cfg, num_layers, target)
    if cap is None:
        sched = cfg.schedule(num_layers)
        why = (
            f"its {sched.dense_layers} dense layer(s) of {num_layers} alone recompute more"
            if sched.dense_layers >= (1.0 - target) * num_layers
            else "its cap would keep less than one token in a thousand"
        )
        raise ValueError(f"reuse {target:.3f} is out of reach for this rule: {why}")
    return replace(cfg, max_ratio=cap)


def rule_name(cfg: RelayConfig) -> str:
    """``"deviation"``, ``"context"``, ``"context+probe"`` or ``"first_k"``: what selects
    the tokens; a context rule that also forces each span's first tokens ends in
    ``"+head"``."""
    if cfg.detects:
        return "deviation"
    if not cfg.ranks_context:
        return "first_k"
    name = "context+probe" if cfg.probes else "context"
    return f"{name}+head" if cfg.first_k else name


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """The config a request runs with for reuse ``target``. ``profiled``: the frontier
    point's target (``None``: cap solved from the formula); ``rule``: ``"deviation"``
    (detection at ``l_det``), ``"context"`` (recorded context mass), ``"context+probe"``
    (times the last prompt row's attention in a probe pass) or ``"first_k"`` (position
    only)."""

    target: float
    config: RelayConfig
    profiled: float | None

    @property
    def rule(self) -> str:
        return rule_name(self.config)

    def to_dict(self) -> dict[str, Any]:
        return {"reuse_target": self.target, "profiled": self.profiled, "rule": self.rule}


@dataclass(frozen=True, slots=True)
class Frontier:
    """A profile's operating points, ``(target, config)`` sorted by target."""

    points: tuple[tuple[float, RelayConfig], ...] = ()

    @classmethod
    def from_profile(cls, data: dict[str, Any] | None) -> Frontier:
        rows = (data or {}).get("frontier") or []
        if not isinstance(rows, list):
            raise ValueError("profile 'frontier' must be a list")
        points = []
        for row in rows:
            try:
                target = parse_target(row["target"])
                cfg = RelayConfig.from_dict(row["config"])
            except (KeyError, TypeError) as exc:
                raise ValueError(f"bad profile frontier point {row!r}: {exc}") from exc
            if cfg.method != "relay" or cfg.max_ratio is None:
                raise ValueError(f"frontier point at {target} must be a capped relay config")
            points.append((target, cfg))
        return cls(tuple(sorted(points, key=lambda p: p[0])))

    def l_starts(self) -> set[int]:
        return {cfg.l_start for _, cfg in self.points}

    def configs(self) -> list[RelayConfig]:
        return [cfg for _, cfg in self.points]

    def point(
        self, base: RelayConfig, target: float, num_layers: int, *, position_fallback: bool = True
    ) -> OperatingPoint:
        """The config for ``target``: the profiled point with the smallest target >= it,
        else ``base`` (or the last point's rule) with the cap solved for ``target`` - or,
        with ``position_fallback``, where that rule's dense layers would take more than
        :data:`MAX_DENSE_SHARE` of the recompute budget, the position rule
        (:func:`position_rule`) at ``target``."""
        for profiled, cfg in self.points:
            if profiled >= target - 1e-9:
                return OperatingPoint(target, cfg, profiled)
        rule = self.points[-1][1] if self.points else base
        dense = rule.schedule(num_layers).dense_layers
        if position_fallback and dense > MAX_DENSE_SHARE * (1.0 - target) * num_layers:
            rule = position_rule(rule)
        return OperatingPoint(target, at_target(rule, num_layers, target), None)


# A rule whose dense layers (all span tokens, to detect deviations in the next layer) take
# more than this share of the recompute budget leaves too little for the tokens it
# detects. Chosen on the calibration relays (embedded model): the unprofiled rule (layer 0
# dense, 1/30) beats the first tokens of each span at 0.80 (dense share 1/6; KL 0.0201 vs
# 0.0241) and loses from 0.85 on (share 0.22: 0.0379 vs 0.0272); docs/fidelity.md
# "Models without a profile" has the evaluation workloads.
MAX_DENSE_SHARE = 0.2

# first_k that makes every span token a forced candidate: the cap then keeps the earliest
ALL_TOKENS = 1 << 30


def position_rule(rule: RelayConfig) -> RelayConfig:
    """``rule``'s position-only counterpart: the first ``floor(max_ratio * n)`` tokens of
    each span in every layer (EPIC's choice, sized per span), no detection pass, no stored
    state; ``max_ratio`` is left for :func:`at_target`."""
    return replace(
        rule, l_start=0, l_det=0, l_end=-1, signal="none", tau_inf=None, top_ratio=None,
        first_k=ALL_TOKENS, l_suf=0, budget="span", max_ratio=None,
    )  # fmt: skip
