"""The CPU stand-in's hooks: what keeps SGLang 0.5.23's own CPU paths alive under relay.

Active only in processes ``sglang-relay serve`` set up for a machine without CUDA
(:mod:`sglang_relay.cpu_setup`: ``SGLANG_USE_CPU_ENGINE=1``, the stand-in ``sgl_kernel`` on
the path, CPU server defaults; marked ``SGLANG_RELAY_CPU_STANDIN=1``), registered by
:func:`sglang_relay.runtime.standin.register`: model-parallel groups without PyNccl, the
server's children forked from one preloaded forkserver, and the tests' opt-ins (FP8 KV
pools, unpinned LoRA and HiCache host memory, the PD sender's host indices).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sglang_relay.runtime.platform import cpu_engine_active

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import DataParallelController

# The scheduler and detokenizer processes SGLang starts ("spawn") each import SGLang and torch
# again, ~13 s of one core apiece here. On the stand-in they fork from one process that
# imported them once (multiprocessing's forkserver). That process is itself a fresh
# interpreter, started at the first child's start, after SGLang and relay have set the
# environment, so the children import under the environment spawned ones would see. It
# also loads SGLang's plug-ins once (relay's hooks applied), last, so the children do not.
FORKSERVER_PRELOAD = [
    # the collector off for the imports (import_gc)
    "sglang_relay.runtime.standin.forkserver_first",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang_relay.runtime.standin.forkserver_preload",
]
# set to 1: SGLang's own spawn on the stand-in too (the way back, and the comparison)
CPU_SPAWN_ENV = "SGLANG_RELAY_CPU_SPAWN"


def children_from_forkserver(result, server_args, *args, **kwargs):
    """After SGLang's ``_set_envs_and_config`` chose "spawn": on the CPU stand-in, start the
    server's children from a preloaded forkserver instead, unless SGLang would set a child
    up at its start in a way a fork from that server does not carry (then it stays spawn)."""
    import logging
    import multiprocessing as mp

    from sglang_relay.runtime.sglang.server import per_child_process_setup

    log = logging.getLogger(__name__)
    spawn_asked = os.environ.get(CPU_SPAWN_ENV) == "1"
    setup = CPU_SPAWN_ENV if spawn_asked else per_child_process_setup(server_args)
    if setup is not None:
        log.info("sglang-relay: server processes spawned one by one (%s)", setup)
        return result
    mp.set_start_method("forkserver", force=True)
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    log.info("sglang-relay: server processes fork from one preloaded process (CPU stand-in)")
    return result


# opt-in (tests): let SGLang's CPU KV pool hold --kv-cache-dtype fp8_e5m2
CPU_FP8_KV_ENV = "SGLANG_RELAY_CPU_FP8_KV"


def cpu_fp8_kv_opted_in() -> bool:
    return cpu_engine_active() and os.environ.get(CPU_FP8_KV_ENV) == "1"


def fp8_e5m2_kv_on_cpu(original, *args, **kwargs):
    """Around-hook of ``configure_kv_cache_dtype`` with ``SGLANG_RELAY_CPU_FP8_KV=1`` on
    the CPU: SGLang 0.5.23 refuses ``--kv-cache-dtype fp8_e5m2`` there ("not supported on
    CPU"; ``fp8_e4m3`` needs Intel AMX and its scaled CPU pool). Its pool, write and read
    paths for FP8 are device-independent (``MHATokenToKVPool`` stores uint8 and views
    float8; ``torch_native`` attention upcasts what it reads), so the stand-in resolves
    fp8_e5m2 as a CUDA machine does: an unscaled ``torch.float8_e5m2`` pool. What relay
    serves on GPUs' FP8 pools is tested on it (test/e2e/test_kv_dtypes.py)."""
    import torch

    if kwargs.get("server_args_kv_cache_dtype") == "fp8_e5m2" and not kwargs.get("is_draft_worker"):
        return None, torch.float8_e5m2
    return original(*args, **kwargs)


# opt-in (tests): SGLang's LoRA layers and torch_native LoRA backend on the CPU
CPU_LORA_ENV = "SGLANG_RELAY_CPU_LORA"
_PINNING_FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange")


def cpu_lora_opted_in() -> bool:
    return cpu_engine_active() and os.environ.get(CPU_LORA_ENV) == "1"


def pinning_off() -> None:
    """With ``SGLANG_RELAY_CPU_LORA=1`` on a CPU host: pinned host memory becomes ordinary
    memory. SGLang 0.5.23's LoRA layers and its torch_native LoRA backend pin their
    per-batch index tensors unconditionally (``Tensor.pin_memory()`` and
    ``pin_memory=True``; ``research/lora-study.md`` lists the 13 calls), which raises "Found
    no NVIDIA driver" without CUDA, so no LoRA server starts here. Pinning only speeds up
    host-to-device copies, and there is no device: every call it changes would have
    raised. Measured 2026-11-26: a ``--no-relay`` server with two adapters and
    ``--lora-backend torch_native`` starts and serves each adapter's own output."""
    import torch

    if torch.cuda.is_available() or getattr(torch, "_sglang_relay_unpinned", False):
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    def unpinned(factory):
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        call.__wrapped__ = factory
        return call

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch._sglang_relay_unpinned = True


# opt-in (tests): SGLang's HiCache host tier on the CPU
CPU_HICACHE_ENV = "SGLANG_RELAY_CPU_HICACHE"


def cpu_hicache_opted_in() -> bool:
    return cpu_engine_active() and os.environ.get(CPU_HICACHE_ENV) == "1"


def host_tier_on_cpu() -> None:
    """With ``SGLANG_RELAY_CPU_HICACHE=1`` on a CPU host: SGLang 0.5.23's HiCache host tier
    runs here with two stand-ins, everything else SGLang's own code (the host pools, the
    cache controller, its transfer engine, events and acks; research/design-hicache.md):

    * host pools are allocated unpinned: SGLang's allocator for a ``cpu`` transfer device
      registers its buffer with CUDA (``cudaHostRegister``), which raises without a driver;
      this takes SGLang's same allocator with ``pin_memory`` off (pinning only speeds
      host-to-device copies, and there is no device);
    * ``transfer_kv_direct`` (the copy under ``--hicache-io-backend direct`` and
      ``--hicache-mem-layout layer_first``), imported by ``pool_host/mha.py`` from
      ``sgl_kernel.kvcacheio`` only on CUDA/ROCm/XPU and so an undefined name on a CPU, is
      bound to :func:`transfer_kv_direct`: the same row copy in torch;
    * the host RAM SGLang leaves free when it sizes a host pool (a fixed 10 GiB, for GPU
      hosts) is 1 GiB: a 24 GB test machine running two servers has less than 10 GiB
      beyond them, and the pool is still checked against what is free.

    The other layouts and the ``kernel`` backend stay undefined here: a CPU server serves
    HiCache with ``--hicache-io-backend direct --hicache-mem-layout layer_first``."""
    from sglang.srt.mem_cache.pool_host import base, common, mha

    if getattr(mha, "transfer_kv_direct", None) is transfer_kv_direct:
        return
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30
    pinning = common.ALLOC_MEMORY_FUNCS["cpu"]

    def unpinned(*args, **kwargs):
        kwargs["pin_memory"] = False
        return pinning(*args, **kwargs)

    common.ALLOC_MEMORY_FUNCS["cpu"] = unpinned
    mha.transfer_kv_direct = transfer_kv_direct


def shipping_tier_on_cpu(server_args: Any, view: Any) -> None:
    """Before a shipping server's relay host tier is built on the CPU: its copies are
    HiCache's host tier's (:func:`host_tier_on_cpu`), and a PD prefill server's sender
    takes CPU page indices (:func:`pd_prefill_on_cpu`)."""
    host_tier_on_cpu()
    if view.disaggregation_mode == "prefill":
        pd_prefill_on_cpu()


def pd_prefill_on_cpu() -> None:
    """SGLang 0.5.23's PD prefill server on a CPU host: its Mooncake sender takes CPU page
    indices (``supports_host_tensor_indices`` False: ``prefill.py:_send_kv_chunk`` then
    builds no pinned index buffer and records no CUDA event), the path SGLang has for its
    other senders."""
    from sglang.srt.disaggregation.mooncake import conn

    conn.MooncakeKVSender.supports_host_tensor_indices = False


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in torch: for each ``(src, dst)`` layer
    buffer pair (``[slots, ...]``), ``dst[dst_indices] = src[src_indices]`` (token rows;
    ``page_size`` does not change a row copy)."""
    import torch

    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: layer lists or index lengths differ")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src.index_select(0, src_indices.to(src.device, torch.long))
        dst.index_copy_(0, dst_indices.to(dst.device, torch.long), rows.to(dst.device))


def model_parallel_group_without_pynccl(original, *args, **kwargs):
    """Around-hook of ``init_model_parallel_group`` on the CPU: SGLang 0.5.23 gives every
    in-tree platform a PyNccl communicator when the caller does not say otherwise, and
    PyNccl needs a CUDA device, so ``--tp 2`` on the CPU fails before loading the model.
    Without it the groups all-reduce through torch.distributed (gloo on the CPU)."""
    kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def blocking_event_loop(original, controller: DataParallelController, *args, **kwargs):
    """Around the DP controller's event loop, on the CPU stand-in only: wait on the socket.

    SGLang 0.5.23's loop receives without blocking in a ``while True`` with no wait, which
    keeps one core at 100 % while the server is idle. On a GPU host that is one core of many;
    on the 2-core CPU stand-in it is half the machine, taken from the ranks pinned to those
    cores. This loop does the same work (drain every queued request, dispatch it, feed the
    soft watchdog) but sleeps in ``zmq.Poller`` until a request arrives (or a second passes,
    so the watchdog is still fed while idle). It also reads the ranks' fingerprint
    messages at least once a second while idle, so they never queue up in the ranks."""
    import zmq

    from sglang_relay.runtime.sglang.scheduling import dp_controller_receiver
    from sglang_relay.runtime.state import STATE

    sock, recv, dispatch, feed = dp_controller_receiver(controller)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        feed()
        if STATE.dp_router is not None:
            STATE.dp_router.drain()
        if not poller.poll(timeout=1000):
            continue
        while True:
            try:
                message = recv()
            except zmq.ZMQError:
                break
            dispatch(message)
            feed()
