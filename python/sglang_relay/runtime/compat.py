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
