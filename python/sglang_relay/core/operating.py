"""Operating points: a reuse target -> the relay config that runs at it.

Time to first token is almost linear in what is recomputed, so the one knob a user needs is
the reuse they buy (METHOD.md's token-layer reuse, ``1 - recomputed / (|S| * L)``). A
profile's ``frontier`` lists, per reuse target, the rule that had the lowest first-token KL
on the calibration relays at that target (:mod:`sglang_relay.profiler`); every point's
``max_ratio`` caps the selection so that the reuse is at least the target by construction,
per span or, with ``budget="request"``, per request (all its spans in a prefill chunk). A
request's target maps to the point with the smallest profiled target at or above it
(never less reuse than asked); above the last point, and on a model without a profiled
frontier, the cap is solved from the reuse formula for the base rule.

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


def at_target(cfg: RelayConfig, num_layers: int, target: float) -> RelayConfig:
    """``cfg`` with its cap solved for ``target``; ValueError if the rule's dense layers
    alone recompute more than ``1 - target``."""
    cap = reuse_cap(cfg, num_layers, target)
    if cap is None:
        sched = cfg.schedule(num_layers)
        raise ValueError(
            f"reuse {target:.3f} is out of reach for this rule: its {sched.dense_layers} dense "
            f"layer(s) of {num_layers} alone recompute more"
        )
    return replace(cfg, max_ratio=cap)


def rule_name(cfg: RelayConfig) -> str:
    """``"deviation"``, ``"context"`` or ``"first_k"``: what selects the tokens."""
    if cfg.detects:
        return "deviation"
    return "context" if cfg.ranks_context else "first_k"


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """The config a request runs with for reuse ``target``. ``profiled``: the frontier
    point's target (``None``: cap solved from the formula); ``rule``: ``"deviation"``
    (detection at ``l_det``), ``"context"`` (recorded context mass) or ``"first_k"``
    (position only)."""

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

    def point(self, base: RelayConfig, target: float, num_layers: int) -> OperatingPoint:
        """The config for ``target``: the profiled point with the smallest target >= it,
        else ``base`` (or the last point's rule) with the cap solved for ``target``."""
        for profiled, cfg in self.points:
            if profiled >= target - 1e-9:
                return OperatingPoint(target, cfg, profiled)
        rule = self.points[-1][1] if self.points else base
        return OperatingPoint(target, at_target(rule, num_layers, target), None)
