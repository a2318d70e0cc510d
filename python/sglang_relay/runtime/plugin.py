"""SGLang plug-in entry point (group ``sglang.srt.plugins``, name ``relay``).

SGLang calls :func:`register` in every process it starts (engine, scheduler,
detokenizer), because processes are spawned and see nothing registered elsewhere.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "relay"
_registered = False


def register() -> None:
    """Register the ``relay`` radix-cache backend and the plug-in's hooks. Idempotent."""
    global _registered
    if _registered:
        return
    from sglang_relay.runtime import compat

    register_backend, registered_backends, _ = compat.radix_cache_api()
    if BACKEND_NAME not in registered_backends():
        from sglang_relay.runtime.radix_cache import build_relay_cache

        register_backend(BACKEND_NAME, build_relay_cache)

    registry, hook_type = compat.hook_registry()
    registry.register(compat.INTERNAL_STATE_TARGET, _add_relay_state, hook_type.AFTER)
    _registered = True
    logger.info("sglang-relay registered (radix cache backend %r)", BACKEND_NAME)


def _add_relay_state(result, controller, *args, **kwargs):
    """Add ``relay`` (the tree cache's relay stats) to ``/get_server_info`` internal states."""
    stats = getattr(controller.scheduler.tree_cache, "relay_stats", None)
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        state["relay"] = stats() if callable(stats) else {"enabled": False}
    return result
