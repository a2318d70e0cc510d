"""The served KV pool as relay reaches it: the runtime it serves (an attribute relay adds),
and whether the pool's KV moves reach relay's hook."""

from __future__ import annotations

from sglang_relay.runtime.sglang.targets import KV_MOVE_TARGET

POOL_RUNTIME_ATTR = "_sglang_relay_runtime"


def attach_pool_runtime(pool, runtime) -> None:
    """``pool`` is the served model's KV pool: its moves go to ``runtime``."""
    setattr(pool, POOL_RUNTIME_ATTR, runtime)


def pool_runtime(pool):
    """The relay runtime whose served KV pool is ``pool`` (None: another pool, such as an
    EAGLE draft model's, which keeps no relay side data)."""
    return getattr(pool, POOL_RUNTIME_ATTR, None)


def moves_reach_hook(pool) -> bool:
    """Whether ``pool.move_kv_cache`` is the pool method relay hooks (its class does not
    override it): a pool class with its own move would copy KV past the ledger."""
    from sglang_relay.runtime.sglang.hooks import resolve

    return getattr(type(pool), "move_kv_cache", None) is resolve(KV_MOVE_TARGET)
