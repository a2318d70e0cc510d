"""Whether a server serves relay: SGLang's ``--radix-cache-backend`` names relay's cache.

A leaf module (nothing of relay's imported), so every hook can ask it without importing
the plug-in that installs the hooks."""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "relay"


def serves_relay(server_args: Any) -> bool:
    """Whether ``server_args`` (SGLang's ``ServerArgs``, or None) selects relay's cache."""
    return getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME
