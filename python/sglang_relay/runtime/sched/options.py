"""Per-request relay options -> the RelayConfig a request runs with (None: standard).

The one function that turns "server config + method + per-request overrides" into a
config: the server default comes from the profile (:mod:`.settings`); baselines keep their
fixed settings under any profile (``RelayConfig.for_method``); overrides apply last.

Per-request option ``sampling_params.custom_params["relay"]``: a method name (``"off"``
= standard) or ``{"method": name, "config": {RelayConfig fields}, "reuse": target}``
(``reuse``: a number in (0, 1) or a level name, method relay only; it picks the operating
point on the profile's frontier, :mod:`sglang_relay.core.operating`, and overrides the
server's ``SGLANG_RELAY_REUSE``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_relay.core.config import METHODS, RelayConfig
from sglang_relay.core.operating import OperatingPoint, answer_cap, parse_target
from sglang_relay.runtime.config.settings import RelaySettings

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import Req, TokenizedGenerateReqInput

OPTION_KEYS = {"method", "config", "reuse", "key", "store"}


def resolve_config(
    settings: RelaySettings,
    option: Any,
    *,
    num_layers: int,
    capture_layer: int | None,
    context_layer: int | None = None,
) -> tuple[RelayConfig | None, OperatingPoint | None]:
    """The config for one request and, for method relay at a reuse target, the operating
    point it maps to; raises ValueError (with the reason) on bad options.

    ``capture_layer``: the layer whose hidden states this server stores (None: none), the
    only ``l_start > 0`` a request may ask for; ``context_layer``: the layer of the context
    masses its spans carry (None: none), the only ``l_ctx`` a context rule may use."""
    server = settings.config
    overrides: dict[str, Any] = {}
    reuse: Any = None
    if option is None:
        method = server.method
    elif isinstance(option, str):
        method = option
    elif isinstance(option, dict) and set(option) <= OPTION_KEYS:
        method = option.get("method", server.method if "reuse" not in option else "relay")
        overrides = option.get("config") or {}
        reuse = option.get("reuse")
        if not isinstance(method, str) or not isinstance(overrides, dict):
            raise ValueError("relay option: method must be a string, config an object")
    else:
        raise ValueError(
            "custom_params.relay must be a method name or an object with "
            + ", ".join(sorted(OPTION_KEYS))
        )
    if method == "off":
        method = "standard"
    if method not in METHODS:
        raise ValueError(f"unknown relay method {method!r} (allowed: off, {', '.join(METHODS)})")
    if reuse is not None and method != "relay":
        raise ValueError(f"a reuse target applies to method relay, not {method}")
    if method == "standard":
        return None, None
    point = None
    if method == "relay":
        target = parse_target(reuse) if reuse is not None else settings.reuse_target
        if target is not None:
            point = settings.point(target, num_layers)
            if point.profiled is not None:  # a formula point was solved from the server's
                # rule with its overrides in; applied again they could undo the cap or the
                # position rule that replaced it
                overrides = {**dict(settings.overrides), **overrides}
    base = point.config if point is not None else server
    if method in ("cacheblend", "epic"):
        base = server.for_method(method)
    cfg = RelayConfig.from_dict({**base.to_dict(), **overrides, "method": method})
    if method == "relay" and "answer_max_ratio" not in overrides:
        cfg = answer_cap(cfg, num_layers, settings.reasoning_reuse)
    sched = cfg.schedule(num_layers)
    if sched.needs_hidden() and 0 < sched.l_start < num_layers and sched.l_start != capture_layer:
        stored = "0" if capture_layer is None else f"0 or {capture_layer}"
        raise ValueError(
            f"l_start must be {stored} (the layer whose hidden states this server stores)"
        )
    if cfg.ranks_context and cfg.context_layer(num_layers) != context_layer:
        raise ValueError(
            "signal context needs the context masses the server records with its spans: "
            + (
                "this server records none (its profile has no context rule)"
                if context_layer is None
                else f"l_ctx must be {context_layer}"
            )
        )
    return cfg, point


def check_option_fields(option: Any) -> None:
    """ValueError naming the field and what it accepts, for a relay option whose fields
    have the wrong types (``resolve_config`` checks what they mean)."""
    if isinstance(option, str):
        return
    if not isinstance(option, dict):
        raise ValueError(
            "custom_params.relay must be a method name (off, "
            + ", ".join(METHODS)
            + ") or an object with "
            + ", ".join(sorted(OPTION_KEYS))
            + f"; got {type(option).__name__}"
        )
    unknown = sorted(str(k) for k in option if k not in OPTION_KEYS)
    if unknown:
        raise ValueError(
            f"custom_params.relay has unknown fields {', '.join(unknown)} "
            f"(allowed: {', '.join(sorted(OPTION_KEYS))})"
        )
    if "method" in option and not isinstance(option["method"], str):
        raise ValueError(f"custom_params.relay.method must be one of off, {', '.join(METHODS)}")
    if "config" in option and not isinstance(option["config"], dict | type(None)):
        raise ValueError("custom_params.relay.config must be an object of RelayConfig fields")
    if "store" in option and not isinstance(option["store"], bool):
        raise ValueError("custom_params.relay.store must be true or false")


def request_option(req: Req | TokenizedGenerateReqInput) -> Any:
    """The raw ``custom_params["relay"]`` of a request, in the scheduler or the DP
    controller (None when absent)."""
    params = getattr(req.sampling_params, "custom_params", None)
    return params.get("relay") if isinstance(params, dict) else None


def relay_key(option: Any) -> str | None:
    """The request's relay key (``custom_params.relay.key``), a non-empty string or None."""
    key = option.get("key") if isinstance(option, dict) else None
    if key is not None and (not isinstance(key, str) or not key or len(key) > 256):
        raise ValueError("relay key must be a non-empty string of at most 256 characters")
    return key


def stores_spans(option: Any) -> bool:
    """Whether the request's output may become a span: relaying requests store; a request
    that opted out (``"standard"``/``"off"``) stores only with ``"store": true``."""
    if isinstance(option, dict):
        method = option.get("method")
        if "store" in option:
            return option["store"] is True
        return method not in ("standard", "off")
    return option not in ("standard", "off")


# the tenant a ``header:<Name>`` scope reads from the operator's header, filed by the
# request boundary (:mod:`.trust`) after a client's own private keys are stripped
TENANT_KEY = "__sglang_relay_tenant"


def request_tenant(req: Req | TokenizedGenerateReqInput) -> str | None:
    """The tenant the tokenizer manager filed ``req`` under from the operator's header
    (scope ``header:<Name>``: :mod:`.trust`), a non-empty string, or None. A private key:
    a client's own is stripped at the door."""
    params = getattr(req.sampling_params, "custom_params", None)
    tenant = params.get(TENANT_KEY) if isinstance(params, dict) else None
    return tenant if isinstance(tenant, str) and tenant else None


def namespace(scope: str, isolation: tuple, option: Any, tenant: str | None = None) -> tuple | None:
    """Who may reuse whose spans: SGLang's isolation keys (``isolation``: the request's
    ``extra_key``, LoRA adapter id and ``cache_salt``, :func:`.sglang.scheduling.request_isolation`)
    plus its relay key, and under scope ``header:<Name>`` the ``tenant`` the operator's
    header gave it (:func:`request_tenant`). ``None``: the request neither stores nor
    reuses spans (scope ``key`` without ``cache_salt`` or relay key; a header scope without
    the header). A bad key raises ValueError."""
    key = relay_key(option)
    if scope.startswith("header:"):
        return None if tenant is None else (*isolation, ("tenant", tenant), key)
    if scope == "key" and key is None and isolation[-1] in (None, ""):
        return None
    return (*isolation, key)
