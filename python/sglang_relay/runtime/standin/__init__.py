"""CPU stand-ins: what lets SGLang 0.5.23 run without a GPU so relay can be tested for real
here. None of it is relay's method; every piece replaces one GPU-only SGLang path with the
smallest equivalent that runs on a CPU, tested against SGLang's own kernel where one exists.

* :mod:`.cpu`: the hooks that keep SGLang's CPU paths alive (no PyNccl, forkserver
  children, FP8 KV pools, unpinned LoRA and HiCache host memory, the PD sender);
* :mod:`.cpu_graph`: the CPU graph runner's attention backend and placeholder kernels;
* :mod:`.cpu_spec`, :mod:`.cpu_eagle`: NGRAM and EAGLE's CUDA ops in torch;
* :mod:`.cpu_models`: what SGLang's model classes launch on CUDA alone (MiniMax-M2's q/k
  norm, gpt-oss's sinks on torch_native, MLA absorbed on torch_native), in torch;
* :mod:`.quant_standin`: an activation-quantizing method that runs on a CPU;
* ``_cpu_shim/sgl_kernel``: the stand-in ``sgl_kernel`` package;
* :mod:`.forkserver_first`, :mod:`.forkserver_preload`: the children's preloaded forkserver.

Registered by :func:`register` alone, SGLang's plug-in ``relay-cpu`` (its own entry point, so
nothing else in :mod:`sglang_relay.runtime` imports this package). It registers nothing
unless ``sglang-relay`` set this process up as the CPU stand-in (``sglang_relay.cpu_setup``:
:func:`sglang_relay.runtime.platform.cpu_engine_active`, which needs CUDA absent): a GPU
install loads the module and returns. May import: any layer of the runtime but the top.
"""

from __future__ import annotations

import logging

from sglang_relay.runtime.platform import cpu_engine_active
from sglang_relay.runtime.state import STATE

logger = logging.getLogger(__name__)


def register() -> None:
    """Every stand-in hook this process needs (idempotent; nothing off the CPU stand-in)."""
    if STATE.standin_registered or not cpu_engine_active():
        return
    from sglang_relay.runtime.scale.ship.build import add_tier_setup
    from sglang_relay.runtime.sglang.hooks import register_hook
    from sglang_relay.runtime.sglang.targets import (
        CPU_DECODE_ATTENTION_TARGET,
        CPU_DRAFT_DECODE_BACKEND_TARGET,
        CPU_DRAFT_EXTEND_BACKEND_TARGET,
        CPU_GPT_OSS_BACKEND_CHECK_TARGET,
        CPU_GRAPH_FAKE_TARGET,
        CPU_MINIMAX_QK_NORM_TARGET,
        CPU_VERIFY_ATTENTION_TARGET,
        DP_EVENT_LOOP_TARGET,
        KV_CACHE_DTYPE_TARGET,
        MODEL_PARALLEL_GROUP_TARGET,
        PROCESS_START_TARGET,
    )
    from sglang_relay.runtime.standin import (
        cpu,
        cpu_eagle,
        cpu_graph,
        cpu_models,
        cpu_spec,
        quant_standin,
    )

    register_hook(MODEL_PARALLEL_GROUP_TARGET, cpu.model_parallel_group_without_pynccl, "around")
    register_hook(PROCESS_START_TARGET, cpu.children_from_forkserver, "after")
    cpu_graph.register_graph_backend()
    register_hook(CPU_GRAPH_FAKE_TARGET, cpu_graph.define_missing_kernel, "around")
    # SGLang's DP controller spins on its socket: one of the stand-in's two cores
    register_hook(DP_EVENT_LOOP_TARGET, cpu.blocking_event_loop, "around")
    register_hook(CPU_VERIFY_ATTENTION_TARGET, cpu_spec.torch_native_with_verify, "around")
    register_hook(CPU_DRAFT_EXTEND_BACKEND_TARGET, cpu_eagle.draft_extend_on_torch_native, "around")
    register_hook(CPU_DRAFT_DECODE_BACKEND_TARGET, cpu_eagle.draft_decode_on_torch_native, "around")
    register_hook(CPU_MINIMAX_QK_NORM_TARGET, cpu_models.minimax_qk_norm, "around")
    register_hook(
        CPU_GPT_OSS_BACKEND_CHECK_TARGET,
        cpu_models.gpt_oss_check_sees_torch_native_with_sinks,
        "around",
    )
    register_hook(CPU_VERIFY_ATTENTION_TARGET, cpu_models.torch_native_extend_with_sinks, "around")
    register_hook(CPU_DECODE_ATTENTION_TARGET, cpu_models.torch_native_decode_with_sinks, "around")
    cpu_models.register_mla_on_torch_native()
    if cpu.cpu_fp8_kv_opted_in():
        register_hook(KV_CACHE_DTYPE_TARGET, cpu.fp8_e5m2_kv_on_cpu, "around")
    if cpu.cpu_hicache_opted_in():
        cpu.host_tier_on_cpu()
    add_tier_setup(cpu.shipping_tier_on_cpu)
    if cpu.cpu_lora_opted_in():
        cpu.pinning_off()
    if quant_standin.standin_opted_in():
        quant_standin.register()
    STATE.standin_registered = True
    logger.info("sglang-relay: CPU stand-in registered")
