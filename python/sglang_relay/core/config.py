"""Relay configuration: one frozen dataclass, the method table, the layer schedule.

Every method of METHOD.md is a point in the same space (layer range + selection rule):

| method     | L_start | L_det | L_end | selection                                   |
|------------|---------|-------|-------|---------------------------------------------|
| standard   | -       | -     | -     | no reuse (relay path off)                   |
| naive      | L       | L     | L-1   | nothing recomputed                          |
| cacheblend | 0       | 1     | L-1   | top ``top_ratio`` by key deviation          |
| epic       | 0       | 0     | L-1   | first ``first_k`` tokens of each span       |
| relay      | profile | profile | profile | deviation U influence U suffix (U first k) |

Span tokens are computed densely in layers ``[l_start, l_det)``, the selected ones in
``[l_det, l_end]``; everywhere else their reused (re-rotated) KV stands.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

METHODS = ("standard", "naive", "cacheblend", "epic", "relay")
SIGNALS = ("value", "key", "none", "context")
BUDGETS = ("span", "request")


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """What the relay path does. Layer indices may be negative (counted from the end).

    Attributes:
        method: one of :data:`METHODS`.
        l_start, l_det, l_end: relay's layer range (see the module docstring).
        tau_dev: select tokens whose deviation is >= ``tau_dev`` x the span's mean.
        tau_inf: select tokens whose influence is >= ``tau_inf`` x the span's mean
            (``None``: influence unused).
        l_suf: always select the last ``l_suf`` tokens of each span.
        first_k: always select the first ``first_k`` tokens of each span (EPIC's rule; the
            first tokens behind a new prefix deviate most).
        top_ratio: select the top fraction by deviation (CacheBlend's rule) instead of the
            threshold, if set.
        max_ratio: cap on the selected fraction of a span (``None``: no cap); the cap keeps
            the highest-deviation tokens.
        signal: which deviation detects: ``"value"`` (RelayCaching), ``"key"``, or
            ``"none"``: no detection, only the forced first/last tokens (and the cap) select,
            so the rule needs no deviation pass (EPIC's rule inside relay's config space),
            or ``"context"``: no detection either; tokens are ranked by their *context
            mass*, the attention their own decode query put on the upstream prompt at layer
            ``l_ctx`` (computed once when the span is recorded): a token that looked at the
            context the relay replaces is the one whose KV changes.
        l_ctx: the layer of the context mass (``signal="context"`` only; the stream
            entering it is what the server stores per output token).
        min_span: shortest token run worth relaying.
        budget: what the ``max_ratio`` cap bounds: ``"span"``, each span (every span keeps
            the reuse target), or ``"request"``, all the spans a request relays in one
            prefill chunk together (the request keeps it; the tokens with the highest
            scores are chosen wherever they are).
        probe: ``signal="context"`` with ``budget="request"`` only: rank by the context
            mass times ``a ** probe``, where ``a`` is the attention the request's *last
            prompt row* gives a span token in a probe pass over the spliced KV (mean over
            heads and the upper half of the layers). The probe row knows the downstream
            query; it is charged to the request's cap (one token fewer selected).
            ``None``: no probe.
        answer_max_ratio: the cap for the tokens of a reasoning model's *answer* (a span
            stored with the model's reasoning before it: its KV was decoded with that
            reasoning in context, which a downstream prompt pasting the answer alone
            lacks, so it needs more recompute; docs/fidelity.md "Reasoning answers").
            Answer runs are capped apart from the request's other runs (with
            ``budget="request"``: one pool each). ``None``: ``max_ratio`` for them too.
    """

    method: str = "relay"
    l_start: int = 3
    l_det: int = 4
    l_end: int = -1
    tau_dev: float = 1.5
    tau_inf: float | None = None
    l_suf: int = 10
    first_k: int = 0
    top_ratio: float | None = None
    max_ratio: float | None = None
    signal: str = "value"
    min_span: int = 32
    l_ctx: int | None = None
    budget: str = "span"
    probe: float | None = None
    answer_max_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("l_start", "l_det", "l_end", "l_suf", "first_k", "min_span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer; got {value!r}")
        for name in ("tau_dev", "tau_inf", "top_ratio", "max_ratio", "probe", "answer_max_ratio"):
            value = getattr(self, name)
            optional = name != "tau_dev"
            if (value is None and not optional) or (
                value is not None
                and (isinstance(value, bool) or not isinstance(value, int | float))
            ):
                raise ValueError(f"{name} must be a number{' or null' * optional}; got {value!r}")
        if not isinstance(self.method, str) or not isinstance(self.signal, str):
            raise ValueError(
                f"method and signal must be strings; got {self.method!r}, {self.signal!r}"
            )
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}; got {self.signal!r}")
        for name in ("tau_dev", "tau_inf", "probe"):
            value = getattr(self, name)
            try:
                finite = value is None or math.isfinite(value)
            except OverflowError:  # an int too large for a float
                finite = False
            if value is not None and (not finite or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0; got {value}")
        for name in ("top_ratio", "max_ratio", "answer_max_ratio"):
            value = getattr(self, name)
            if value is not None and not (0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1]; got {value}")
        for name in ("l_suf", "first_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.l_ctx is not None and (
            isinstance(self.l_ctx, bool) or not isinstance(self.l_ctx, int)
        ):
            raise ValueError(f"l_ctx must be an integer or null; got {self.l_ctx!r}")
        if self.signal == "context" and self.l_ctx is None:
            raise ValueError('signal "context" needs l_ctx (the layer of the context mass)')
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}; got {self.budget!r}")
        if self.probe is not None and (self.signal != "context" or self.budget != "request"):
            raise ValueError('probe needs signal "context" and budget "request"')
        if self.min_span < 2:
            raise ValueError(f"min_span must be >= 2; got {self.min_span}")

    @property
    def detects(self) -> bool:
        """Whether selection needs the deviation pass at ``l_det`` (EPIC and the
        ``signal="none"`` rule select by position only, ``"context"`` by recorded scores)."""
        return self.method not in ("epic", "standard", "naive") and self.signal in ("value", "key")

    @property
    def ranks_context(self) -> bool:
        """Whether selection ranks tokens by their recorded context mass (no deviation
        pass; the span must carry context masses at ``l_ctx``)."""
        return self.method == "relay" and self.signal == "context"

    @property
    def probes(self) -> bool:
        """Whether selection needs the last-prompt-row probe pass (:attr:`probe`)."""
        return self.ranks_context and self.probe is not None

    def context_layer(self, num_layers: int) -> int | None:
        """``l_ctx`` resolved for a model with ``num_layers`` layers (``None``: unused);
        ValueError if out of range."""
        if not self.ranks_context:
            return None
        assert self.l_ctx is not None
        layer = self.l_ctx + num_layers if self.l_ctx < 0 else self.l_ctx
        if not 0 <= layer < num_layers:
            raise ValueError(f"l_ctx {self.l_ctx} is out of range for {num_layers} layers")
        return layer

    def stored_layer(self, num_layers: int) -> int | None:
        """The layer whose entering stream this rule needs per output token: ``l_start``
        (recomputation starts from it) or, for ``signal="context"``, ``l_ctx`` (the
        context mass is computed from it when a span is recorded); ``None`` for layer 0
        (the embeddings) or nothing."""
        relay = self if self.method == "relay" else replace(self, method="relay")
        if relay.ranks_context:
            layer = relay.context_layer(num_layers)
        else:
            layer = relay.schedule(num_layers).l_start
        return layer if layer is not None and 0 < layer < num_layers else None

    def for_method(self, method: str) -> RelayConfig:
        """This config with ``method`` switched and the method's fixed settings applied
        (CacheBlend: top 15 % by key deviation at layer 1; EPIC: first 16 tokens). Apply
        user overrides after this call."""
        if method == "cacheblend":
            return replace(
                self,
                method=method,
                l_start=0,
                l_det=1,
                l_end=-1,
                signal="key",
                top_ratio=0.15,
                first_k=0,
                l_suf=0,
                tau_inf=None,
                max_ratio=None,
                probe=None,
            )
        if method == "epic":
            return replace(
                self,
                method=method,
                l_start=0,
                l_det=0,
                l_end=-1,
                first_k=16,
                l_suf=0,
                top_ratio=None,
                tau_inf=None,
                max_ratio=None,
                probe=None,
            )
        return replace(self, method=method)

    def schedule(self, num_layers: int) -> LayerSchedule:
        """Resolve the layer range for a model with ``num_layers`` layers."""
        if self.method == "standard":
            raise ValueError("the standard method reuses nothing and has no schedule")
        if self.method == "naive":
            return LayerSchedule(num_layers, num_layers, num_layers - 1, num_layers)

        def norm(i: int) -> int:
            return i + num_layers if i < 0 else i

        s, d, e = norm(self.l_start), norm(self.l_det), norm(self.l_end)
        if not (0 <= s <= d <= e + 1 <= num_layers):
            raise ValueError(
                f"need 0 <= l_start <= l_det <= l_end + 1 <= {num_layers}; got "
                f"l_start={self.l_start}, l_det={self.l_det}, l_end={self.l_end}"
            )
        return LayerSchedule(s, d, e, num_layers)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["l_ctx"] is None:  # only context rules have one: older profiles stay equal
            del out["l_ctx"]
        if out["budget"] == "span":  # the default: older profiles stay equal
            del out["budget"]
        for name in ("probe", "answer_max_ratio"):
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RelayConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown relay config fields: {', '.join(unknown)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class LayerSchedule:
    """Resolved layer plan: dense in ``[l_start, l_det)``, selected in ``[l_det, l_end]``."""

    l_start: int
    l_det: int
    l_end: int
    num_layers: int

    @property
    def dense_layers(self) -> int:
        return self.l_det - self.l_start

    @property
    def sparse_layers(self) -> int:
        return max(0, self.l_end - self.l_det + 1)

    def needs_hidden(self) -> bool:
        """Whether span tokens need their stored hidden state entering ``l_start``."""
        return self.l_start < self.num_layers and (self.dense_layers + self.sparse_layers) > 0

    def reuse_rate(self, span_tokens: int, selected_tokens: int) -> float:
        """METHOD.md's token-layer reuse: 1 - recomputed token-layers / (|S| * L)."""
        if span_tokens <= 0:
            return 0.0
        recomputed = span_tokens * self.dense_layers + selected_tokens * self.sparse_layers
        return 1.0 - recomputed / (span_tokens * self.num_layers)


def load_profile(path: str | Path) -> tuple[RelayConfig, dict[str, Any]]:
    """Read a profile JSON: ``{"config": {...RelayConfig fields}, ...measurements}``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read relay profile {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise ValueError(f"relay profile {path} has no 'config' object")
    return RelayConfig.from_dict(data["config"]), data
