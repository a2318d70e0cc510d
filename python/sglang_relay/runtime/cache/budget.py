"""Relay's side memory inside SGLang's KV budget.

SGLang turns a byte budget (``--mem-fraction-static`` of the device, or what is left after
graph capture) into a KV pool token count in ``KVCacheConfigurator.config_from_budget``
(:data:`.sglang.targets.KV_BUDGET_TARGET`), for the first pool and for the post-capture resize. The
relay runtime keeps side data per pool slot (:class:`~.side_data.SlotLedger`: an 8-byte
stamp, the hidden state entering ``l_start`` when the profile stores one, a 4-byte
influence score when ``tau_inf`` is set) and is built after the pool, so left alone it
would sit on top of the budget: ~6-12 % of the KV pool on 7-8B models.

The hook sizes the pool twice: once as SGLang would (``T0`` tokens, after the user's
``--max-total-tokens`` cap), then for the budget minus the side data of ``T0`` slots. The
second pool has ``T1 <= T0`` tokens, so ``T1 * kv_cell + side(T1) <= budget``: the KV pool
and relay's side data together never exceed what SGLang would have given the pool alone.
(Exactly solving ``T * (kv_cell + side) = budget`` would need SGLang's private cell size;
the two-pass bound gives away at most ``side / kv_cell`` of the side data, ~0.5 %.)
What was reserved is reported in ``get_server_info`` (``relay.kv_budget``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sglang_relay.core.config import RelayConfig
from sglang_relay.runtime.backend import serves_relay
from sglang_relay.runtime.config.settings import RelaySettings, server_settings
from sglang_relay.runtime.sglang.server import resolved_value
from sglang_relay.runtime.sglang.views import check_surface
from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import KVCacheConfigurator, ModelRunner

logger = logging.getLogger(__name__)

STAMP_BYTES = 8
INFLUENCE_BYTES = 4


def context_layer(settings: RelaySettings, num_layers: int) -> int | None:
    """The layer of the context masses the server records with each span (``None``: no
    config or operating point of the server ranks by them)."""
    layers = {
        cfg.context_layer(num_layers)
        for cfg in [settings.config, *settings.frontier.configs()]
        if cfg.ranks_context
    }
    if len(layers) > 1:
        raise ValueError(
            f"the profile's operating points rank by context mass at layers {sorted(layers)}; "
            "a server records one layer: profile again or set one l_ctx"
        )
    return layers.pop() if layers else None


def side_layers(settings: RelaySettings, num_layers: int) -> tuple[int | None, int | None]:
    """``(capture_layer, influence_layer)``: the layer whose hidden states the server stores
    (the one stored layer of its config and every operating point, :func:`stored_layer`)
    and the layer whose influence scores it accumulates (``None``: none). ValueError if the
    operating points need hidden states at two layers."""
    relay = RelayConfig.from_dict({**settings.config.to_dict(), "method": "relay"})
    sched = relay.schedule(num_layers)
    starts = {relay.stored_layer(num_layers)}
    starts |= {cfg.stored_layer(num_layers) for cfg in settings.frontier.configs()}
    starts.discard(None)
    if len(starts) > 1:
        raise ValueError(
            f"the profile's operating points need hidden states at layers {sorted(starts)}; "
            "a server stores one layer: profile again or set one l_start"
        )
    influence = sched.l_det if settings.config.tau_inf is not None else None
    if influence is not None and influence >= num_layers:
        influence = None
    return (starts.pop() if starts else None), influence


def bytes_per_slot(
    settings: RelaySettings, num_layers: int, hidden_size: int, itemsize: int
) -> int:
    """Side-data bytes per KV pool slot (what :class:`~.side_data.SlotLedger` allocates)."""
    capture, influence = side_layers(settings, num_layers)
    return (
        STAMP_BYTES
        + (hidden_size * itemsize if capture is not None else 0)
        + (INFLUENCE_BYTES if influence is not None else 0)
    )


def config_from_budget(original, kvc: KVCacheConfigurator, budget_bytes, *args, **kwargs):
    """Around-hook of ``KVCacheConfigurator.config_from_budget`` (see the module doc)."""
    server_args = kvc.server_args
    if not serves_relay(server_args) or getattr(kvc, "is_draft_worker", False):
        return original(kvc, budget_bytes, *args, **kwargs)
    check_surface("KVCacheConfigurator", kvc)
    mc = kvc.model_config
    try:
        settings = server_settings(server_args.model_path)
        per_slot = bytes_per_slot(
            settings, int(mc.num_hidden_layers), int(mc.hidden_size), kvc.model_dtype.itemsize
        )
    except ValueError:  # the relay cache factory refuses these settings with the message
        return original(kvc, budget_bytes, *args, **kwargs)
    first = original(kvc, budget_bytes, *args, **kwargs)
    check_surface("MemoryPoolConfig", first)
    # the page size SGLang resolved (a backend may force one), not the raw field
    page = max(1, int(resolved_value(server_args, "page_size", 1) or 1))
    reserved = per_slot * (int(first.max_total_num_tokens) + page)  # + the padding slot(s)
    config = original(kvc, max(0, budget_bytes - reserved), *args, **kwargs)
    info: dict[str, Any] = {
        "budget_bytes": int(budget_bytes),
        "side_bytes_per_slot": per_slot,
        "reserved_bytes": reserved,
        "tokens_without_relay": int(first.max_total_num_tokens),
        "tokens": int(config.max_total_num_tokens),
    }
    STATE.reserved[:] = [(held, i) for held, i in STATE.reserved if held is not kvc]
    STATE.reserved.append((kvc, info))  # the latest sizing of this pool (a resize repeats it)
    logger.info(
        "sglang-relay: KV pool %d -> %d tokens to keep %.1f MB of relay side data inside "
        "the %.1f MB budget",
        info["tokens_without_relay"],
        info["tokens"],
        reserved / 2**20,
        budget_bytes / 2**20,
    )
    return config


def budget_info(model_runner: ModelRunner) -> dict[str, Any] | None:
    """What the hook reserved for this runner's pool (``None``: it did not run)."""
    kvc = getattr(model_runner, "kv_cache_configurator", None)
    return next((info for held, info in STATE.reserved if held is kvc), None)
