"""A server's span-shipping end, built with its relay cache
(:mod:`sglang_relay.runtime.scale.ship`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# set-ups a platform needs before a shipping server's host tier is built, as
# ``fn(server_args, view)``; the CPU stand-in adds its copies here (``add_tier_setup``)
_TIER_SETUPS: list[Callable[[Any, Any], None]] = []


def add_tier_setup(setup: Callable[[Any, Any], None]) -> None:
    """Run ``setup(server_args, view)`` before each shipping server's host tier is built."""
    if setup not in _TIER_SETUPS:
        _TIER_SETUPS.append(setup)


def prepare_tier(server_args: Any, view: Any) -> str:
    """The io backend of a shipping server's relay host tier (no HiCache: the tier's own
    engine), after the set-ups the platform added (:func:`add_tier_setup`)."""
    from sglang_relay.runtime.platform import cpu_engine_active

    io_backend = str(getattr(server_args, "hicache_io_backend", "") or "kernel")
    if cpu_engine_active():
        layout = getattr(server_args, "hicache_mem_layout", None)
        if io_backend != "direct" or layout != "layer_first":
            raise ValueError(
                "sglang-relay: on a CPU host the relay host tier that ships spans copies "
                "with --hicache-io-backend direct --hicache-mem-layout layer_first (got "
                f"{io_backend}, {layout}); add them"
            )
    for setup in _TIER_SETUPS:
        setup(server_args, view)
    return io_backend


def build_shipper(settings: Any, *, tier: Any, runtime: Any, model_config: Any) -> Any:
    """The publisher or receiver ``settings.ship_role`` asks for, on ``tier`` (the server's
    relay host tier) and ``runtime``'s store and ledger."""
    from sglang_relay.runtime.scale.ship.mooncake import MooncakeTransport
    from sglang_relay.runtime.scale.ship.pages import model_digest, pool_geometry
    from sglang_relay.runtime.scale.ship.peers import Publisher
    from sglang_relay.runtime.scale.ship.receiver import Receiver
    from sglang_relay.runtime.scale.ship.wire import publisher_key

    hf_config = model_config.hf_config
    layers = {
        "capture_layer": runtime.capture_layer if runtime.ledger.hidden is not None else None,
        "influence_layer": runtime.influence_layer,
        "context_layer": runtime.context_layer,
    }
    geometry = pool_geometry(
        tier.host_pool, hidden=runtime.ledger.hidden, model=model_digest(hf_config), layers=layers
    )
    role = settings.ship_role
    address = settings.ship_listen if role == "receiver" else settings.ship_to[0]
    host = address.rpartition(":")[0] if role == "receiver" else _local_host(address)
    transport = MooncakeTransport(host, settings.ship_protocol)
    staging = min(settings.ship_staging, tier.capacity)
    if role == "publisher":
        key = bytes.fromhex(settings.ship_key) if settings.ship_key else None
        shipper = Publisher(
            tier=tier, store=runtime.store, transport=transport, peers=list(settings.ship_to),
            geometry=geometry, lease=settings.ship_lease, name=settings.ship_name,
            key=key or publisher_key("", settings.ship_name), staging_tokens=staging,
        )  # fmt: skip
    else:
        shipper = Receiver(
            tier=tier, store=runtime.store, ledger=runtime.ledger, transport=transport,
            listen=settings.ship_listen, geometry=geometry,
            vocab=int(getattr(hf_config, "vocab_size", 0) or 1 << 31),
            max_position=int(getattr(model_config, "context_len", 0) or 1 << 31),
            secret=settings.ship_secret, publishers=dict(settings.ship_publishers),
            staging_tokens=staging,
        )  # fmt: skip
    logger.info(
        "sglang-relay: span shipping as %s (%s, session %s)", role, address, transport.session
    )
    return shipper


def _local_host(peer: str) -> str:
    """This server's address as a peer at ``peer`` reaches it (the interface that routes
    there; loopback for a loopback peer)."""
    import socket

    host, _, port = peer.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]
