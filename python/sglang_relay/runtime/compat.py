"""The one place that names SGLang internals; checked against the pinned version at import.

Every other module of ``sglang_relay.runtime`` takes SGLang classes and paths from here, so
porting to the next SGLang release means changing this file (and the hooks it names).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED_SGLANG = ("0.5.23",)

try:
    SGLANG_VERSION = version("sglang")
except PackageNotFoundError as exc:  # pragma: no cover - packaging error
    raise ImportError("sglang-relay needs SGLang installed (pip install sglang==0.5.23)") from exc

if SGLANG_VERSION not in SUPPORTED_SGLANG:
    raise ImportError(
        f"sglang-relay supports SGLang {', '.join(SUPPORTED_SGLANG)}; found {SGLANG_VERSION}. "
        "Install the supported release or upgrade sglang-relay."
    )

# Hook targets (dotted paths for sglang.srt.plugins.hook_registry).
INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)

# Model architectures whose attention, RoPE and KV layout the relay path understands.
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})


def radix_cache_api():
    """(register_radix_cache_backend, registered_radix_cache_backends,
    create_unified_radix_cache)."""
    from sglang.srt.mem_cache.registry import (
        create_unified_radix_cache,
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    return register_radix_cache_backend, registered_radix_cache_backends, create_unified_radix_cache


def unified_radix_cache_class():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache


def hook_registry():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return HookRegistry, HookType


def attention_backend_name(model_runner) -> str | None:
    """The attention backend the runner resolved for prefill (``--attention-backend`` or
    SGLang's platform default); the raw ``ServerArgs`` value when the runner has none."""
    resolved = getattr(model_runner, "prefill_attention_backend_str", None)
    if resolved:
        return resolved
    args = getattr(model_runner, "server_args", None)
    return getattr(args, "attention_backend", None)


def cuda_graphs_enabled(model_runner, phase: str) -> bool:
    """Whether ``phase`` (``"decode"`` or ``"prefill"``) batches may replay captured CUDA
    graphs: the published per-phase graph config (``--cuda-graph-backend-decode``,
    ``--disable-prefill-cuda-graph``, ``--disable-cuda-graph``, ...), else the legacy flag."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase
    from sglang.srt.runtime_context import get_exec

    if phase not in Phase.ALL:
        raise ValueError(f"unknown CUDA graph phase {phase!r}")
    try:
        cfg = get_exec().graph.cuda_graph_config
    except (ValueError, AttributeError):  # not published (e.g. outside a scheduler)
        cfg = None
    if cfg is None:
        args = getattr(model_runner, "server_args", None)
        return not getattr(args, "disable_cuda_graph", True)
    return getattr(cfg, phase).backend != Backend.DISABLED


def kv_write_loc(loc):
    """A KV write target for ``set_kv_buffer`` on SGLang's token-major pools."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc(loc)


# Model classes whose forward the relay loop may take over (dotted hook targets).
MODEL_FORWARD_TARGETS = (
    "sglang.srt.models.llama.LlamaModel.forward",
    "sglang.srt.models.qwen2.Qwen2Model.forward",
)
PREPARE_FOR_EXTEND_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
REQUEST_LEVEL_KEY_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.is_request_level_customized_info_key"
)
META_INFO_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
