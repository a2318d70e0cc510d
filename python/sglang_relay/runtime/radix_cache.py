"""The ``relay`` radix-cache backend: SGLang's ``UnifiedRadixCache`` plus relay bookkeeping."""

from __future__ import annotations

import logging
from typing import Any

from sglang_relay.runtime import compat

logger = logging.getLogger(__name__)

UnifiedRadixCache = compat.unified_radix_cache_class()


class RelayRadixCache(UnifiedRadixCache):
    """A ``UnifiedRadixCache`` that records the output spans of finished requests.

    Exact prefix matching is inherited unchanged: a plain radix hit only ever returns KV
    that SGLang itself computed for that exact prefix.
    """

    def __init__(self, params: Any, *, architecture: str | None = None) -> None:
        super().__init__(params)
        self.relay_architecture = architecture
        self.relay_counters: dict[str, int] = {
            "finished_requests": 0,
            "recorded_output_tokens": 0,
        }

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to, **kwargs)
        if req.finished():
            self.relay_counters["finished_requests"] += 1
            self.relay_counters["recorded_output_tokens"] += max(0, len(req.output_ids) - 1)

    def relay_stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` (``internal_states[i]["relay"]``)."""
        return {
            "enabled": True,
            "backend": type(self).__name__,
            "architecture": self.relay_architecture,
            **self.relay_counters,
        }


def build_relay_cache(ctx: Any) -> Any:
    """Factory for ``register_radix_cache_backend`` (``ctx`` is a TreeCacheBuildContext)."""
    architectures = list(getattr(ctx.model_config.hf_config, "architectures", None) or [])
    arch = architectures[0] if architectures else None
    if arch not in compat.SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"sglang-relay does not support the {arch} architecture yet (supported: "
            f"{', '.join(sorted(compat.SUPPORTED_ARCHITECTURES))}); drop "
            "--radix-cache-backend relay to serve this model without relay"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError("sglang-relay does not support sliding-window, Mamba or DSA models yet")
    _, _, create_unified = compat.radix_cache_api()

    def cache_class(params: Any) -> RelayRadixCache:
        return RelayRadixCache(params, architecture=arch)

    return create_unified(ctx, cache_class=cache_class)
