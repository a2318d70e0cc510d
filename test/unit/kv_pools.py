"""SGLang's real KV pools on this CPU for the host-tier tests: a device pool
(``MHATokenToKVPool``) filled with seeded random KV, a host pool of it
(``MHATokenToKVPoolHost``, layer_first, unpinned) and HiCache's transfer engine
(``L2TransferEngine``, io backend ``direct``), with the CPU stand-in's row copy bound
where a CUDA build imports ``sgl_kernel``'s (``cpu.host_tier_on_cpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def cpu_kv_pools(
    *,
    slots: int,
    layers: int,
    page: int = 1,
    seed: int = 0,
    host_tokens: int | None = None,
    layout: str = "layer_first",
) -> SimpleNamespace:
    from sglang_relay import cpu_setup
    from sglang_relay.runtime.standin import cpu

    cpu_setup.activate()
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    cpu.host_tier_on_cpu()
    pool = MHATokenToKVPool(
        size=slots,
        page_size=page,
        dtype=torch.float32,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_kv_cache_copy=False,
    )
    gen = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        pool.k_buffer[layer][:] = torch.randn(pool.k_buffer[layer].shape, generator=gen)
        pool.v_buffer[layer][:] = torch.randn(pool.v_buffer[layer].shape, generator=gen)
    info = pool.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(1 << 30):
        host = MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            page,
            layout,
            pin_memory=False,
            device_capacity_tokens=slots,
            start_layer=0,
            end_layer=layers - 1,
            host_token_capacity=host_tokens,
        )
    return SimpleNamespace(pool=pool, host=host, engine=L2TransferEngine("direct"))
