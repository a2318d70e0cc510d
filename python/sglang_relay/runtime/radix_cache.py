"""The ``relay`` radix-cache backend: SGLang's ``UnifiedRadixCache`` that also records the
output spans of finished requests and keeps relayed (approximate) KV out of the tree."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_relay.runtime import compat
from sglang_relay.runtime.relay import RelayRuntime, _set_current
from sglang_relay.runtime.settings import settings_from_env

logger = logging.getLogger(__name__)

UnifiedRadixCache = compat.unified_radix_cache_class()


class RelayRadixCache(UnifiedRadixCache):
    """A ``UnifiedRadixCache`` plus relay bookkeeping.

    * Exact stays exact: a request whose prefill used relayed KV is inserted into the tree
      only up to its first relayed position (unless ``allow_approx_prefix``), so a plain
      prefix hit never returns approximate KV.
    * Finished, non-relayed requests leave their output tokens as spans; the span KV is the
      tree's own and may be evicted by the tree at any time: the allocator hook clears
      the slot owner map on every free, which invalidates the span.
    """

    relay: RelayRuntime | None = None

    def __init__(self, params: Any, *, architecture: str | None = None) -> None:
        super().__init__(params)
        self.relay_architecture = architecture
        self.relay_counters: dict[str, int] = {"finished_requests": 0, "recorded_spans": 0}

    def attach_runtime(self, runtime: RelayRuntime) -> None:
        self.relay = runtime
        self._takeover: dict[int, tuple[int, int]] = {}
        allocator = self.token_to_kv_pool_allocator
        original_free = allocator.free
        store = runtime.store

        def free(free_index: torch.Tensor, _orig=original_free) -> None:
            store.on_free(free_index)
            _orig(free_index)

        allocator.free = free
        store.free_slots = free

    # ---- tree insertion ------------------------------------------------------------
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        rt = self.relay
        if rt is None:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        relayed_from = rt.relayed_from.get(req.rid)
        clamp = relayed_from is not None and not rt.settings.allow_approx_prefix
        tree_up_to = min(up_to, relayed_from) if clamp else up_to
        span = None
        if req.finished():
            self.relay_counters["finished_requests"] += 1
            rt.relayed_from.pop(req.rid, None)
            span = self._span_of(req, up_to)
        super().checkpoint(req, up_to=tree_up_to, **kwargs)
        if span is None:
            return
        span_id, start, tokens, slots, positions = span
        owned = clamp  # outputs of a relayed request stay out of the tree: the store owns them
        namespace = (req.extra_key, req.cache_salt)
        if rt.store.commit(span_id, tokens, slots, positions, namespace, owned=owned):
            self.relay_counters["recorded_spans"] += 1
            if owned:
                self._takeover[req.kv.req_pool_idx] = (start, start + len(tokens))

    def _span_of(self, req: Any, up_to: int):
        """Claim the output tokens that have KV in the row (all but the last sampled one)."""
        rt = self.relay
        start = len(req.origin_input_ids)
        n = min(len(req.output_ids), up_to - start)
        if n < rt.cfg.min_span or req.kv.req_pool_idx is None:
            return None
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[start : start + n].to(torch.int64).clone()
        positions = torch.arange(start, start + n, dtype=torch.int64, device=slots.device)
        span_id = rt.store.claim(slots)
        return span_id, start, list(req.output_ids[:n]), slots, positions

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        """Free a finished request's row except the output slots the span store took over."""
        take = getattr(self, "_takeover", {}).pop(kv.req_pool_idx, None)
        if take is not None:
            lo, hi = take
            kept: list[tuple[int, int]] = []
            for a, b in ranges:
                if a < lo:
                    kept.append((a, min(b, lo)))
                if b > hi:
                    kept.append((max(a, hi), b))
            ranges = [(a, b) for a, b in kept if b > a]
        super().free_kv_row(kv, ranges)

    # ---- memory accounting: owned spans are evictable --------------------------------
    def _owned(self) -> int:
        return self.relay.store.owned_tokens if self.relay is not None else 0

    def evictable_size(self) -> int:
        return super().evictable_size() + self._owned()

    def full_evictable_size(self) -> int:
        return super().full_evictable_size() + self._owned()

    def evict(self, params: Any) -> Any:
        released = self._release_owned(params)
        result = super().evict(params)
        result.num_tokens_evicted += released
        return result

    def evict_for_alloc(self, params: Any, **kwargs: Any) -> Any:
        released = self._release_owned(params)
        result = super().evict_for_alloc(params, **kwargs)
        result.num_tokens_evicted += released
        return result

    def _release_owned(self, params: Any) -> int:
        """Owned spans go first when SGLang needs room (they are the least exact KV)."""
        need = int(getattr(params, "num_tokens", 0) or 0)
        if need <= 0 or self.relay is None:
            return 0
        return self.relay.store.release_owned(need)

    def reset(self) -> None:
        super().reset()
        if self.relay is not None:
            # flush_cache clears the allocator right after: forget, do not free
            self.relay.store.clear(release=False)
            self.relay.relayed_from.clear()
            self.relay.pending.clear()
            self._takeover.clear()

    def relay_stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` (``internal_states[i]["relay"]``)."""
        out: dict[str, Any] = {
            "enabled": True,
            "backend": type(self).__name__,
            "architecture": self.relay_architecture,
            **self.relay_counters,
        }
        if self.relay is not None:
            out.update(self.relay.stats())
        allocator = self.token_to_kv_pool_allocator
        # SGLang's conservation law when idle: available + evictable + protected == total
        out["pool"] = {
            "total": int(allocator.size),
            "available": int(allocator.available_size()),
            "evictable": int(self.evictable_size()),
            "protected": int(self.protected_size()),
        }
        return out


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
    if ctx.tp_size != 1:
        raise ValueError("sglang-relay supports tensor parallel size 1 only for now (--tp 1)")
    if ctx.params.page_size != 1:
        raise ValueError("sglang-relay supports --page-size 1 only for now")
    if ctx.disable_radix_cache:
        raise ValueError(
            "--radix-cache-backend relay needs the radix cache: drop --disable-radix-cache"
        )
    settings = settings_from_env(ctx.server_args.model_path)
    _, _, create_unified = compat.radix_cache_api()

    def cache_class(params: Any) -> RelayRadixCache:
        return RelayRadixCache(params, architecture=arch)

    cache = create_unified(ctx, cache_class=cache_class)
    model_runner = ctx.tp_worker.model_runner
    pool_tokens = int(ctx.params.token_to_kv_pool_allocator.size)
    budget = settings.span_tokens or max(1024, pool_tokens // 4)
    runtime = RelayRuntime(
        settings,
        model_runner,
        span_budget=budget,
        prometheus=bool(getattr(ctx.params, "enable_metrics", False)),
    )
    cache.attach_runtime(runtime)
    _set_current(runtime)
    logger.info(
        "sglang-relay: method=%s layers=[%s,%s,%s] capture_layer=%s span_budget=%d side=%.1f MB",
        runtime.cfg.method,
        runtime.cfg.l_start,
        runtime.cfg.l_det,
        runtime.cfg.l_end,
        runtime.capture_layer,
        budget,
        runtime.side_bytes() / 2**20,
    )
    return cache
