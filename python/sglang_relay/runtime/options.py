"""Per-request relay options -> the RelayConfig a request runs with (None: standard).

The one function that turns "server config + method + per-request overrides" into a
config: the server default comes from the profile (:mod:`.settings`); baselines keep their
fixed settings under any profile (``RelayConfig.for_method``); overrides apply last.

Per-request option ``sampling_params.custom_params["relay"]``: a method name (``"off"``
= standard) or ``{"method": name, "config": {RelayConfig fields}}``.
"""

from __future__ import annotations

from typing import Any

from sglang_relay.core.config import METHODS, RelayConfig


def resolve_config(
    server: RelayConfig, option: Any, *, num_layers: int, capture_layer: int | None
) -> RelayConfig | None:
    """The config for one request; raises ValueError (with the reason) on bad options.

    ``capture_layer``: the layer whose hidden states this server stores (None: none), the
    only ``l_start > 0`` a request may ask for."""
    overrides: dict[str, Any] = {}
    if option is None:
        method = server.method
    elif isinstance(option, str):
        method = option
    elif isinstance(option, dict) and set(option) <= {"method", "config"}:
        method = option.get("method", server.method)
        overrides = option.get("config") or {}
        if not isinstance(method, str) or not isinstance(overrides, dict):
            raise ValueError("relay option: method must be a string, config an object")
    else:
        raise ValueError("custom_params.relay must be a method name or {method, config}")
    if method == "off":
        method = "standard"
    if method not in METHODS:
        raise ValueError(f"unknown relay method {method!r}")
    if method == "standard":
        return None
    base = server.for_method(method) if method in ("cacheblend", "epic") else server
    cfg = RelayConfig.from_dict({**base.to_dict(), **overrides, "method": method})
    sched = cfg.schedule(num_layers)
    if sched.needs_hidden() and 0 < sched.l_start < num_layers and sched.l_start != capture_layer:
        stored = "0" if capture_layer is None else f"0 or {capture_layer}"
        raise ValueError(
            f"l_start must be {stored} (the layer whose hidden states this server stores)"
        )
    return cfg


def request_option(req: Any) -> Any:
    """The raw ``custom_params["relay"]`` of a request (None when absent)."""
    params = getattr(req.sampling_params, "custom_params", None)
    return params.get("relay") if isinstance(params, dict) else None
