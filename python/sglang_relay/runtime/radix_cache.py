"""The ``relay`` radix-cache backend: SGLang's ``UnifiedRadixCache`` that also records the
output spans of finished requests and keeps relayed (approximate) KV out of the tree."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang_relay.core.relatedness import answer_offset
from sglang_relay.runtime.cache.host_tier import HostTier, Retention
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.config import modes, server_options
from sglang_relay.runtime.config.settings import server_settings
from sglang_relay.runtime.runtime import RelayRuntime
from sglang_relay.runtime.sglang.hooks import check_hooks_installed
from sglang_relay.runtime.sglang.host import (
    build_host_pool,
    forward_fence,
    load_fence,
    transfer_engine,
    transfer_indices,
    transfer_indices_for,
)
from sglang_relay.runtime.sglang.model import attach_runtime
from sglang_relay.runtime.sglang.pool import attach_pool_runtime
from sglang_relay.runtime.sglang.scheduling import (
    beam_search,
    evict_params,
    evict_result,
    guard_redo_of,
)
from sglang_relay.runtime.sglang.server import (
    attention_backend_name,
    live_kv_layout,
    radix_cache_api,
    reasoning_end_ids,
    server_view,
    unified_radix_cache_class,
)
from sglang_relay.runtime.sglang.views import check_startup_surface

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ModelRunner, Req, TreeCacheBuildContext

logger = logging.getLogger(__name__)

UnifiedRadixCache = unified_radix_cache_class()


def page_bounds(lo: int, hi: int, page_size: int) -> tuple[int, int]:
    """Row positions ``[lo, hi)`` rounded out to whole pages (a request's row positions
    and its slots are congruent modulo the page size, so these are its slots' pages)."""
    return lo // page_size * page_size, -(-hi // page_size) * page_size


class RelayRadixCache(UnifiedRadixCache):
    """A ``UnifiedRadixCache`` plus relay bookkeeping.

    * Exact stays exact: a request whose prefill used relayed KV is inserted into the tree
      only up to its first relayed position (unless ``allow_approx_prefix``), at every
      checkpoint, however often it is called, until the request is released.
    * Finished requests leave their output tokens as spans, recorded once per request with
      their slots' stamps; the tree may evict the KV at any time, and a span whose slots
      were rewritten since is not used (:mod:`sglang_relay.runtime.cache.side_data`). No
      allocator method is replaced.
    * Outputs of relayed requests stay out of the tree: the span store owns those slots and
      gives them back when it drops the span; with pages of more than one token it owns
      the whole pages its output tokens are in (SGLang's paged allocator frees by page).
    """

    relay: RelayRuntime | None = None
    ship: Any = None  # span shipping's publisher or receiver (runtime/scale/ship), if any

    def __init__(self, params: Any, *, architecture: str | None = None) -> None:
        self._takeover: dict[int, tuple[int, int]] = {}  # req_pool_idx -> owned row range
        self._recorded: set[str] = set()  # rids whose span was recorded (until release)
        super().__init__(params)  # calls reset()
        self.relay_architecture = architecture
        self.relay_model_config = None  # the scheduler's model config (build_relay_cache)
        # guard_*: redos of replies that stopped early (guard.py); held_tail_pages: partial
        # pages the store holds for the tree; span_record_errors: recordings that raised
        self.relay_counters: dict[str, int] = dict.fromkeys(("finished_requests",
            "recorded_spans", "unstored_outputs", "guard_reprefills", "guard_relayed_tokens_redone",
            "held_tail_pages", "span_record_errors"), 0)  # fmt: skip

    def match_prefix(self, *args: Any, **kwargs: Any) -> Any:
        # spans shipped from peers are taken before prompts are matched (scheduler thread)
        if self.ship is not None:
            self.ship.poll()
        return super().match_prefix(*args, **kwargs)

    def attach_runtime(self, runtime: RelayRuntime) -> None:
        self.relay = runtime
        attach_runtime(runtime.model, runtime)
        attach_pool_runtime(runtime.kv_pool, runtime)

    # ---- tree insertion ------------------------------------------------------------
    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        rt = self.relay
        if rt is None:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        relayed_from = rt.relayed_from(req.rid)
        if rt.publish_only:
            # a PD decode server: the prompt's KV came from a prefill server that may have
            # relayed it (approximate), which this server cannot know: none of it enters
            # the tree, and the output is the store's (as a relayed request's)
            relayed_from = 0
        clamp = relayed_from is not None and not rt.settings.allow_approx_prefix
        tree_up_to = min(up_to, relayed_from) if clamp else up_to
        span = namespace = None
        if req.finished() and req.rid not in self._recorded and not beam_search(req):
            self._recorded.add(req.rid)
            self.relay_counters["finished_requests"] += 1
            redo = guard_redo_of(req)
            if redo is not None:
                self.relay_counters["guard_reprefills"] += 1
                self.relay_counters["guard_relayed_tokens_redone"] += int(
                    redo.get("reused_tokens") or 0
                )
            namespace = rt.gate.store_namespace(req)  # None: not stored (no context pass either)
            try:  # inside cache_finished_req: a failure (e.g. out of memory) drops the span
                span = self._span_of(req, up_to, with_context=namespace is not None)
            except Exception:  # noqa: BLE001
                self.relay_counters["span_record_errors"] += 1
                logger.exception("sglang-relay: recording a finished output failed; not stored")
                span = None
        super().checkpoint(req, up_to=tree_up_to, **kwargs)
        if span is None:
            return
        start, tokens, slots, positions, stamps, context, answer = span
        if namespace is None:  # opted out, or no key under scope "key": nothing stored
            self.relay_counters["unstored_outputs"] += 1
            return  # as when the store declines a span: SGLang frees the slots
        # The store takes over the span's pages the tree does not keep: all of a relayed
        # request's output (kept out of the tree, whose clamp ends in the prompt) and, with
        # pages of more than one token, the last partial page of any other output (the
        # tree keeps whole pages only). A paged allocator frees whole pages: the first
        # page's prompt tail and the last page's rest come along.
        end = start + len(tokens)
        lo, hi = page_bounds(start, end, self.page_size)
        lo = max(lo, tree_up_to // self.page_size * self.page_size)
        owned = lo < end
        added = rt.store.add(
            tokens,
            slots,
            positions,
            stamps,
            namespace,
            owned=owned,
            context=context,
            answer_start=answer,
            held=hi - lo,
            held_slots=slots[max(lo, start) - start :],
        )
        if added is not None:
            self.relay_counters["recorded_spans"] += 1
            if owned:
                self._takeover[req.kv.req_pool_idx] = (lo, hi)
                self.relay_counters["held_tail_pages"] += int(not clamp)
            if self.ship is not None and self.ship.role == "publisher":
                self.ship.offer(added, tokens)  # never raises

    def _span_of(self, req: Req, up_to: int, *, with_context: bool):
        """The output tokens that have KV in the row (all but the last sampled one), and
        their context masses when the server ranks by them and ``with_context``."""
        rt = self.relay
        start = len(req.origin_input_ids)
        n = min(len(req.output_ids), up_to - start)
        if n < rt.cfg.min_span or req.kv.req_pool_idx is None:
            return None
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[start : start + n].to(torch.int64).clone()
        positions = torch.arange(start, start + n, dtype=torch.int64, device=slots.device)
        stamps = rt.ledger.snapshot(slots)
        tokens = list(req.output_ids[:n])
        # a reasoning model's output: what a downstream pastes is the answer after the
        # reasoning end marker (relatedness is judged on it; its context masses count the
        # reasoning as context)
        answer = answer_offset(tokens, reasoning_end_ids(self.relay_model_config, req))
        # signal "context": computed now, while the whole row's KV is still the request's,
        # from the streams stored with it (none stored: no masses, relays fall back)
        context = None
        if (
            with_context
            and rt.context_layer is not None
            and (rt.context_layer == 0 or bool(SlotLedger.has_hidden(stamps).all()))
        ):
            context = rt.span_context(row, start, tokens, answer)
        return start, tokens, slots, positions, stamps, context, answer

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        """Free a finished request's row except the output slots the span store took over."""
        take = self._takeover.pop(kv.req_pool_idx, None)
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

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        """The row is gone (finished, aborted or retracted): drop the request's relay state."""
        super().on_release(req, checkpointed=checkpointed)
        if self.relay is not None:
            self.relay.release(req.rid)
        self._recorded.discard(req.rid)

    # ---- memory accounting: owned spans are evictable --------------------------------
    def _owned(self) -> int:
        return self.relay.store.owned_tokens if self.relay is not None else 0

    def evictable_size(self) -> int:
        return super().evictable_size() + self._owned()

    def full_evictable_size(self) -> int:
        return super().full_evictable_size() + self._owned()

    def evict(self, params: Any) -> Any:
        released, rest = self._release_owned(params)
        result = super().evict(rest) if rest is not None else evict_result()
        result.num_tokens_evicted += released
        return result

    def evict_for_alloc(self, params: Any, **kwargs: Any) -> Any:
        released, rest = self._release_owned(params)
        result = super().evict_for_alloc(rest, **kwargs) if rest is not None else None
        if result is None:
            result = evict_result()
        result.num_tokens_evicted += released
        return result

    def _release_owned(self, params: Any) -> tuple[int, Any]:
        """Owned spans go first when SGLang needs room (they are the least exact KV); the
        tree then evicts only the shortfall. Returns (released, the params left for the
        tree, or None when nothing is left to evict)."""
        need = int(getattr(params, "num_tokens", 0) or 0)
        if need <= 0 or self.relay is None:
            return 0, params
        released = self.relay.store.release_owned(need)
        rest = dataclasses.replace(params, num_tokens=max(0, need - released))
        if rest.num_tokens == 0 and not any(
            getattr(rest, f) for f in ("swa_num_tokens", "mamba_num") if hasattr(rest, f)
        ):
            return released, None
        return released, rest

    def reset(self) -> None:
        super().reset()
        if self.relay is not None:
            self.relay.reset()
        self._takeover.clear()
        self._recorded.clear()

    def relay_stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` (``internal_states[i]["relay"]``)."""
        out: dict[str, Any] = {
            "enabled": True,
            "backend": type(self).__name__,
            "architecture": self.relay_architecture,
            # SGLang's host tier is attached (--enable-hierarchical-cache): its load-backs
            # stamp the slots they write (host_loaded_slots)
            "hicache": getattr(self, "cache_controller", None) is not None,
            **self.relay_counters,
        }
        if self.relay is not None:
            out.update(self.relay.stats())
        if self.ship is not None:
            out.update(self.ship.stats())
        allocator = self.token_to_kv_pool_allocator
        # SGLang's conservation law when idle: available + evictable + protected == total
        out["pool"] = {
            "total": int(allocator.size),
            "available": int(allocator.available_size()),
            "evictable": int(self.evictable_size()),
            "protected": int(self.protected_size()),
        }
        return out


def _host_tier(
    cache, runtime, allocator, page_size: int, tokens: int, settings, model_runner: ModelRunner,
    io_backend: str = "",
) -> HostTier:  # fmt: skip
    """The relay host tier (:mod:`sglang_relay.runtime.cache.host_tier`): on a HiCache server
    moved by the tree's own controller's engine and index rules; on a server that ships
    spans without HiCache, by an engine of the same class on ``--hicache-io-backend``."""
    controller = getattr(cache, "cache_controller", None)
    try:
        host_pool = build_host_pool(runtime.kv_pool, page_size, tokens)
    except (RuntimeError, ValueError, MemoryError) as exc:
        raise ValueError(
            f"sglang-relay: the relay host tier ({tokens} tokens) cannot be allocated "
            f"({exc}); pass a smaller --relay-host-tokens, or --relay-host-tokens 0 to keep "
            "no span copies in host memory"
        ) from exc
    tp = runtime.tp
    if controller is not None:
        engine, indices = controller.l2_transfer_engine, transfer_indices(controller, host_pool)
    else:
        engine = transfer_engine(io_backend)
        indices = transfer_indices_for(io_backend, runtime.kv_pool.device, host_pool)
    tier = HostTier(
        host_pool=host_pool,
        kv_pool=runtime.kv_pool,
        engine=engine,
        indices=indices,
        ledger=runtime.ledger,
        allocator=allocator,
        page_size=page_size,
        retention=Retention(ttl=settings.host_ttl, priority=settings.host_priority),
        make_room=lambda n: cache.evict(evict_params(n)),
        agree=None if tp is None else (lambda ok: tp.bounds([int(ok)], "restore")[0][0] == 1),
        load_fence=load_fence(controller)
        if controller is not None
        else forward_fence(model_runner),
    )
    logger.info(
        "sglang-relay: host tier of %d tokens (ttl %.0f s, priority %s)",
        tier.capacity,
        settings.host_ttl,
        settings.host_priority,
    )
    return tier


def build_relay_cache(ctx: TreeCacheBuildContext) -> Any:
    """Factory for ``register_radix_cache_backend`` (``ctx`` is a TreeCacheBuildContext).
    Refuses, with one message naming the option, every configuration relay cannot serve
    correctly (:mod:`sglang_relay.runtime.config.modes`)."""
    architectures = list(getattr(ctx.model_config.hf_config, "architectures", None) or [])
    arch = architectures[0] if architectures else None
    settings = server_settings(ctx.server_args.model_path)
    view = server_view(ctx)
    refusal = server_options.server_refusal(
        view, ctx.server_args, ship_role=settings.ship_role, architecture=arch
    )
    refusal = refusal or modes.kv_layout_refusal(*live_kv_layout(ctx))
    if refusal is not None:
        raise ValueError(refusal)
    _, _, create_unified = radix_cache_api()

    def cache_class(params: Any) -> RelayRadixCache:
        return RelayRadixCache(params, architecture=arch)

    cache = create_unified(ctx, cache_class=cache_class)
    model_runner = ctx.tp_worker.model_runner
    check_startup_surface(ctx, model_runner)
    # the backend SGLang resolved when none was typed (fa3 on Hopper, ...): the same list
    resolved = {"attention_backend": attention_backend_name(model_runner)}
    refusal = server_options.refusal(resolved)
    if refusal is not None:
        raise ValueError(refusal)
    allocator = ctx.params.token_to_kv_pool_allocator
    tree_page, pool_page = int(cache.page_size), int(getattr(allocator, "page_size", 1) or 1)
    if tree_page != pool_page:  # spans' page bounds are the tree's; frees are the pool's
        raise ValueError(
            f"sglang-relay: the radix tree's page size ({tree_page}) differs from the KV "
            f"allocator's ({pool_page}); relay cannot free span pages safely, {modes.OUT}"
        )
    budget = settings.span_tokens or max(1024, int(allocator.size) // 4)
    runtime = RelayRuntime(
        settings,
        model_runner,
        span_budget=budget,
        release_slots=allocator.free,
        prometheus=bool(getattr(ctx.params, "enable_metrics", False)),
    )
    speculative = modes.speculating(view)
    influence = runtime.influence_layer is not None
    for refused in (
        modes.graph_refusal(
            runtime.graphs,
            capture_in_graph=runtime.capture_in_graph,
            influence=influence,
            speculative=speculative,
        ),
        modes.spec_refusal(view, settings.ship_role, influence=influence),
        None
        if not speculative or runtime.moves_followed
        else (
            "sglang-relay: this KV pool moves KV with its own move_kv_cache, which relay's "
            "side data does not follow (speculative decoding's compaction); drop "
            f"--speculative-algorithm, {modes.OUT}"
        ),
    ):
        if refused is not None:
            raise ValueError(refused)
    cache.attach_runtime(runtime)
    cache.relay_model_config = ctx.model_config
    host_tokens = 2 * budget if settings.host_tokens is None else settings.host_tokens
    hicache = getattr(cache, "cache_controller", None) is not None
    if settings.ship_role is not None and host_tokens <= 0:
        raise ValueError(
            "sglang-relay: span shipping moves spans through the relay host tier; drop "
            "--relay-host-tokens 0 (or give it room), or drop --relay-ship-*"
        )
    if (hicache or settings.ship_role is not None) and host_tokens > 0:
        from sglang_relay.runtime.scale.ship.build import prepare_tier

        io_backend = "" if hicache else prepare_tier(ctx.server_args, view)
        runtime.store.tier = _host_tier(
            cache, runtime, allocator, tree_page, host_tokens, settings, model_runner, io_backend
        )
    if settings.ship_role is not None:
        from sglang_relay.runtime.scale.ship.build import build_shipper

        runtime.publish_only = view.disaggregation_mode == "decode"
        cache.ship = build_shipper(
            settings, tier=runtime.store.tier, runtime=runtime, model_config=ctx.model_config
        )
    check_hooks_installed()
    if not settings.profiled:
        logger.warning(
            "sglang-relay: no relay profile for %s: running the unprofiled rule (no stored "
            "hidden states, layer 0 dense, value deviation at layer 1 + first 16 tokens, "
            "reuse >= %.2f). Profile the model (`sglang-relay profile --quick --model-path "
            "%s --out DIR`, < 10 min for 0.5B on 2 CPU cores) and pass "
            "--relay-profile DIR/profile.json",
            ctx.server_args.model_path,
            settings.reuse_target or 0.0,
            ctx.server_args.model_path,
        )
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
