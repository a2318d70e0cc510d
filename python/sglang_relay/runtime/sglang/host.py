"""SGLang's HiCache parts relay's host tier runs on (:mod:`sglang_relay.runtime.host_tier`):
a host KV pool of the tree's own class and layout, HiCache's transfer engine, and the
controller's rule for the indices each io backend takes. Checked when the tier is built."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sglang_relay.runtime.sglang.views import check_surface


def l2_transfer(host_pool: Any, kv_pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor):
    """One target-model transfer between ``host_pool`` and the served ``kv_pool``."""
    from sglang.srt.mem_cache.l2_transfer import L2Transfer

    return L2Transfer(host_pool, kv_pool, host_idx, device_idx)


def build_host_pool(kv_pool: Any, page_size: int, tokens: int) -> Any:
    """A host pool of ``tokens`` slots (rounded to pages) for the served KV pool, built as
    HiCache builds the tree's (``build_kv_host_pool``: the class, layout and host-memory
    budget of ``--hicache-*``; inside the tree cache's build, so it is charged to the same
    budget)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool

    # SGLang sizes a fixed host pool in GB (``host_size * 1e9 // bytes per token``); the
    # device buffers hold ``size`` slots plus one padding page
    rows = int(kv_pool.size) + page_size
    gb = (tokens + 0.5) * sum(kv_pool.get_kv_size_bytes()) / rows / 1e9
    pool = build_kv_host_pool(
        kv_pool=kv_pool, page_size=page_size, host_size=gb, pool_label="relay"
    )
    check_surface("HostKVCache", pool)
    return pool


def transfer_indices(controller: Any, host_pool: Any):
    """``(host, device) -> (host, device)`` as the engine's io backend takes them: SGLang's
    own ``HiCacheController.move_indices``, run for ``host_pool`` (the relay tier's, of the
    same layout as the tree's)."""
    check_surface("HiCacheController", controller)
    view = SimpleNamespace(
        io_backend=controller.io_backend, mem_pool_host=host_pool, device=controller.device
    )
    move = type(controller).move_indices

    def indices(host_idx: torch.Tensor, device_idx: torch.Tensor):
        return move(view, host_idx, device_idx)

    return indices
