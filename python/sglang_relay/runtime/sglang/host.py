"""SGLang's HiCache parts relay's host tier runs on (:mod:`sglang_relay.runtime.cache.host_tier`):
a host KV pool of the tree's own class and layout, HiCache's transfer engine, and the
controller's rule for the indices each io backend takes. Checked when the tier is built."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from sglang_relay.runtime.sglang.views import check_surface

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import HiCacheController, ModelRunner


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


def transfer_engine(io_backend: str) -> Any:
    """HiCache's transfer engine for a server without HiCache (a relay tier that ships
    spans between servers): the class the cache controller builds, with ``io_backend``
    (``--hicache-io-backend``)."""
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    return L2TransferEngine(io_backend)


def transfer_indices(controller: HiCacheController, host_pool: Any):
    """The index rule of ``controller`` (a ``HiCacheController``) for ``host_pool``:
    :func:`transfer_indices_for` its io backend and device."""
    check_surface("HiCacheController", controller)
    return transfer_indices_for(controller.io_backend, controller.device, host_pool)


def transfer_indices_for(io_backend: str, device: Any, host_pool: Any):
    """``(direction, host, device) -> (host, device)`` as the engine's io backend takes
    them: SGLang's own ``HiCacheController._move_write_operation`` for a ``"write"``
    (device to host: CPU host indices for the staged page_first write-back) and
    ``move_indices`` for a ``"load"``, run for ``host_pool`` (the relay tier's, of the
    tree's layout) through a view of a controller that names it. The base class's
    rules: the relay pool is one plain host pool, not the hybrid controller's pool group."""
    from sglang.srt.managers.cache_controller import HiCacheController as cls

    view = SimpleNamespace(io_backend=io_backend, mem_pool_host=host_pool, device=device)
    view.move_indices = lambda h, d: cls.move_indices(view, h, d)
    view._move_op_indices = lambda op: cls._move_op_indices(view, op)

    def indices(direction: str, host_idx: torch.Tensor, device_idx: torch.Tensor):
        if direction == "write":
            op = SimpleNamespace(
                host_indices=host_idx, device_indices=device_idx, pool_transfers=None
            )
            h, d, _ = cls._move_write_operation(view, op)
            return h, d
        return view.move_indices(host_idx, device_idx)

    return indices


def load_fence(controller: HiCacheController):
    """The start event of a host-to-device copy into reclaimed slots: recorded on the
    stream SGLang fences its own loads with (``load_fence_stream``, the forward stream,
    set by the scheduler after the cache is built; None until then)."""
    return stream_fence(lambda: getattr(controller, "load_fence_stream", None))


def forward_fence(model_runner: ModelRunner):
    """The same fence without HiCache (a tier that ships spans): the model runner's
    ``forward_stream``, the stream SGLang gives the controller as ``load_fence_stream``."""
    return stream_fence(lambda: getattr(model_runner, "forward_stream", None))


def stream_fence(stream_of):
    def event():
        stream = stream_of()
        if stream is None:
            return None
        from sglang.srt.utils import get_device_module

        ev = get_device_module().Event()
        ev.record(stream)
        return ev

    return event
