"""The relay runtime of one scheduler process: built whole in one step by the relay radix
cache, reachable from it (``cache.relay``) and from the served model (the attribute
``sglang.model.MODEL_RUNTIME_ATTR``), never from a module global.

It owns the slot ledger (stamps, hidden states, influence), the span store, the planner,
the layer driver and the per-request stats, and answers the plug-in's hooks:

* the scheduler's (admission, ``plan(req)`` after ``prepare_for_extend``) through its
  :class:`~.sched.gate.RequestGate`, ``runtime.gate``;
* ``forward(original, model, ...)`` for every forward of the served model: stamps the KV
  slots it writes, and runs the relay extend or SGLang's own forward;
* ``span_context`` / ``relayed_from`` / ``release(rid)`` from the cache's checkpoint and
  on_release.

Data path of one relayed request: docs/architecture.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang_relay.runtime.cache.budget import budget_info, context_layer, side_layers
from sglang_relay.runtime.cache.span_store import SpanStore
from sglang_relay.runtime.config.settings import RelaySettings
from sglang_relay.runtime.forward import attention as extend_attention
from sglang_relay.runtime.forward.decode import DecodeCapture, InfluenceHook, new_ledger
from sglang_relay.runtime.forward.extend import (
    NO_PLAN,
    BatchPlan,
    plan_fingerprint,
    relay_extend,
    relay_prepare,
)
from sglang_relay.runtime.forward.layer_driver import LayerDriver, span_context
from sglang_relay.runtime.forward.scratch import free_bytes, scratch_refusal
from sglang_relay.runtime.forward.tp import TPMismatch, TPSync
from sglang_relay.runtime.import_gc import collector_state
from sglang_relay.runtime.metrics import PhaseClock, RelayCounters
from sglang_relay.runtime.models.anatomy import radix_of
from sglang_relay.runtime.scale.dp_fingerprints import dp_publisher
from sglang_relay.runtime.sched.gate import RequestGate
from sglang_relay.runtime.sched.planner import Planner, PlanningFailed
from sglang_relay.runtime.sglang.model import (
    attach_decode_capture,
    check_model_anatomy,
    decode_capture_of,
    forward_mode_name,
    graphs_enabled,
    inner_model,
    linear_method_name,
    linear_rows,
    lora_backend,
    tp_group,
)
from sglang_relay.runtime.sglang.pool import moves_reach_hook
from sglang_relay.runtime.sglang.scheduling import dp_rank, set_request_info
from sglang_relay.runtime.sglang.server import attention_backend_name, chunk_size
from sglang_relay.runtime.stats import RequestStats
from sglang_relay_kernels import kernel_family, pick_extend_attention

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch, ModelRunner

logger = logging.getLogger(__name__)

# forwards that store the hidden states of the slots they write (when the profile needs
# them): every output token, whichever batch produced it, keeps its hidden state (SGLang
# 0.5.23's eager runner turns a mixed batch into an EXTEND forward; NPU and context
# parallelism keep MIXED), a speculative verify's too: accepted drafts' rows are what a
# plain decode stores, and they follow the compaction to their final slots (kv_moved).
PLAIN_MODES = frozenset({"EXTEND", "DECODE", "MIXED", "TARGET_VERIFY"})


class RelayRuntime:
    """Owns the relay state of one scheduler process."""

    def __init__(
        self,
        settings: RelaySettings,
        model_runner: ModelRunner,
        *,
        span_budget: int,
        release_slots,
        prometheus: bool = False,
    ) -> None:
        self.settings = settings
        self.cfg = settings.config
        self.model = inner_model(model_runner)
        self.num_layers = len(self.model.layers)
        anatomy = check_model_anatomy(model_runner)
        self.kv_pool = model_runner.token_to_kv_pool
        # KV the pool copies outside a forward reaches kv_moved (runtime/sglang/pool.py)
        self.moves_followed = moves_reach_hook(self.kv_pool)
        self.linear_method = linear_method_name(self.model)  # e.g. a quantized checkpoint's
        self.linear_rows = linear_rows(self.model)  # row subsets vs the full batch
        # relay's own forwards' layers, bound per layer from the architecture's adapter
        self.driver = LayerDriver(self.model, self.kv_pool, anatomy)
        self.lora = lora_backend(model_runner)  # None unless SGLang serves LoRA
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        kbuf = self.kv_pool.get_key_buffer(radix_of(self.model.layers[0].self_attn).layer_id)
        self.device = kbuf.device
        if self.cfg.method != "standard":
            self.cfg.schedule(self.num_layers)  # validates the layer range for this model
        self.capture_layer, self.influence_layer = side_layers(settings, self.num_layers)
        # signal "context": the layer whose context masses each recorded span carries
        self.context_layer = context_layer(settings, self.num_layers)
        # the server's default operating point (raises at start-up if out of reach)
        self.default_point = (
            settings.point(settings.reuse_target, self.num_layers)
            if settings.reuse_target is not None
            else None
        )
        self.kv_budget = budget_info(model_runner)  # side data reserved from the KV budget
        group = tp_group()
        self.tp = TPSync(group) if group is not None else None
        # decode graphs were captured with the decode capture installed before them: adopt
        # its ledger, so graph replays and this runtime share the same side data
        influence = self.influence_layer is not None
        self.decode_capture = decode_capture_of(self.model)
        self.capture_in_graph = self.decode_capture is not None and self.decode_capture.matches(
            self.capture_layer, influence=influence, slots=kbuf.shape[0]
        )
        if not self.capture_in_graph:  # graphs captured without it are refused below
            if self.decode_capture is not None:
                self.decode_capture.remove()  # its hook would write a ledger no one reads
            ledger = new_ledger(self.model, self.kv_pool, self.capture_layer, influence=influence)
            self.decode_capture = DecodeCapture(ledger, self.capture_layer)
            self.decode_capture.install(self.model, anatomy.residual)
            attach_decode_capture(self.model, self.decode_capture)
        self.ledger = self.decode_capture.ledger
        self.influence_hook = (
            InfluenceHook(
                self.model, self.influence_layer, self.ledger, self.kv_pool, self.req_to_token
            )
            if influence
            else None
        )
        # refused (modes.graph_refusal) when a captured graph would skip relay's work
        self.graphs = graphs_enabled(model_runner)
        self.attention_name = pick_extend_attention(
            attention_backend_name(model_runner),
            self.device,
            kbuf.dtype,
            latent=anatomy.prepare == "mla",
        )
        self.publisher = dp_publisher()  # None unless a DP controller routes by fingerprints
        self.store = SpanStore(
            min_match=self.cfg.min_span,
            max_tokens=span_budget,
            release_slots=release_slots,
            listener=self.publisher,
        )
        self.planner = Planner(
            self.store,
            self.ledger,
            num_layers=self.num_layers,
            min_span=self.cfg.min_span,
            req_to_token=self.req_to_token,
            attention=extend_attention.build(self.attention_name, self.device),
            tp=self.tp,
        )
        self.requests: dict[str, RequestStats] = {}  # planned requests, until released
        self.counters = RelayCounters(prometheus=prometheus)
        self.phases = PhaseClock.from_env(str(self.device))  # bench ttft's breakdown
        self._moved_slots: torch.Tensor | None = None  # kv_moved's device-side count
        # the scheduler's side: admission, options, per-request plans and fallbacks
        self.gate = RequestGate(self, admit_window=chunk_size(model_runner))
        # the runtime invariant: every eager forward of SGLang's runner that writes KV came
        # through this runtime's hook (which stamps the slots it writes); else relay is off
        self.hook_forwards = 0
        self.runner_forwards = 0
        self.disabled: str | None = None
        # a PD decode server's relay records and publishes spans, never relays (its
        # prompts' KV arrives by transfer: runtime/scale/ship)
        self.publish_only = False

    def side_bytes(self) -> int:
        return self.ledger.nbytes()

    # ---- cache side -----------------------------------------------------------------------
    def span_context(
        self, row: torch.Tensor, prompt_len: int, tokens: list[int], answer_start: int = 0
    ) -> torch.Tensor:
        """Context masses of a finished output's tokens at ``context_layer``
        (:func:`.layer_driver.span_context`)."""
        rt = self
        with self.phases("context"):
            return span_context(rt.driver, rt.ledger.hidden, rt.context_layer, rt.lora, row,
                                prompt_len, tokens, answer_start)  # fmt: skip

    # ---- model side ----------------------------------------------------------------------
    def forward(self, original, model, input_ids, positions, fb: ForwardBatch, *args, **kwargs):
        """Every forward of the served model comes through here. An extend batch with an
        agreed plan runs the relay extend; every other forward runs SGLang's own, its
        slots stamped first (:meth:`_plain`)."""
        mode = forward_mode_name(fb)
        self.hook_forwards += mode != "IDLE"
        self.counters[f"forwards_{mode.lower()}"] += 1
        embeds = kwargs.get("input_embeds") is not None or bool(args and args[0] is not None)
        if mode == "EXTEND" and not embeds:
            plan, dropped = self._plan_batch(fb)
            for stats, reason in dropped:
                self._discard(stats, reason)
            if self.tp is not None and not self._tp_agreed(plan):
                # every rank sees the same MIN/MAX, so every rank takes this path together
                plan = None
            if plan is not None:
                return self._relay(original, model, input_ids, positions, fb, plan, args, kwargs)
        else:  # plans cannot run in any other mode
            for plan in self.planner.take_pending():
                self._discard(plan.stats, f"{mode.lower()}_batch")
        hidden = mode in PLAIN_MODES and not embeds and self.disabled is None
        return self._plain(original, model, input_ids, positions, fb, args, kwargs, mode, hidden)

    def _plain(
        self, original, model, input_ids, positions, fb: ForwardBatch, args, kwargs, mode, hidden
    ):
        """SGLang's own forward, untouched. Its KV slots are stamped first, as holding a
        stored hidden state when ``hidden`` and the profile stores them (the decode
        capture's hook copies them from inside the forward); with influence scores on, a
        decode forward also accumulates them (:class:`~.decode.InfluenceHook`)."""
        loc = fb.out_cache_loc
        hidden = hidden and self.capture_layer is not None
        self.ledger.stamp(loc, with_hidden=hidden)
        if self.ledger.influence is not None:
            self.ledger.influence[loc] = 0.0  # fresh slots start with no influence
        hook = self.influence_hook
        stores = self.decode_capture.stores
        if hook is not None:
            hook.armed = mode == "DECODE" and self.disabled is None
        try:
            out = original(model, input_ids, positions, fb, *args, **kwargs)
        finally:
            if hook is not None:
                hook.armed = False
        if hidden and loc.numel() and self.decode_capture.stores == stores:
            self.disable(
                f"a {mode} forward did not pass the hidden-state hook at layer "
                f"{self.capture_layer} (this model's forward does not call its attention "
                "module there)"
            )
        return out

    def kv_moved(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """The served pool copied the KV of slots ``src`` to ``tgt`` outside any forward
        (``move_kv_cache``: speculative decoding's compaction): the ledger follows, so each
        moved slot carries its source's hidden row under a fresh stamp."""
        self.ledger.move(tgt, src)
        self.counters["kv_moves"] += 1
        # slots whose KV really changed place (not the identity pairs of a chain or the
        # 0 -> 0 padding), summed on the device: no host sync per verify step
        moved = (tgt.reshape(-1) != src.reshape(-1)).sum()
        self._moved_slots = moved if self._moved_slots is None else self._moved_slots + moved

    def kv_loaded(self, slots: torch.Tensor) -> None:
        """HiCache copies host KV into ``slots`` outside any forward (a load-back of a tree
        node, a retracted request's restore): they get fresh stamps without a hidden row,
        as a forward that stores none would give them."""
        self.ledger.stamp(slots.to(self.ledger.stamps.device), with_hidden=False)
        self.counters["host_loaded_slots"] += int(slots.numel())

    def _plan_batch(self, fb: ForwardBatch) -> tuple[BatchPlan | None, list]:
        """The batch's plan. Never raises: under TP every rank must reach the agreement
        that follows (a rank that failed sends no plan, so all ranks fall back together)."""
        if self.disabled is not None:
            return None, [(p.stats, "relay_disabled") for p in self.planner.take_pending()]
        try:
            with self.phases("plan_batch"):
                return self.planner.plan_batch(fb)
        except Exception as exc:  # noqa: BLE001 - the scheduler must keep serving
            logger.exception("relay planning of an extend batch failed; standard prefill")
            failed = isinstance(exc, PlanningFailed)
            taken = exc.stats if failed else []
            taken += [p.stats for p in self.planner.take_pending()]
            reason = f"error: {type(exc.__cause__ if failed else exc).__name__}"
            return None, [(stats, reason) for stats in taken]

    def check_forward(self, mode: str, graph: bool) -> None:
        """After every forward of SGLang's runner: an eager forward that writes KV must have
        come through :meth:`forward`. One that did not wrote KV relay never stamped, so a
        freed and reused span slot could pass as unchanged: relay turns itself off."""
        if graph or mode == "IDLE":  # IDLE is not counted on the hook side either
            return
        self.runner_forwards += 1
        if self.runner_forwards != self.hook_forwards and self.disabled is None:
            self.disable(
                f"a {mode} forward wrote KV without passing relay's hook "
                f"({self.runner_forwards} runner forwards, {self.hook_forwards} hooked)"
            )

    def disable(self, reason: str) -> None:
        """Relay off for the rest of this server's life: every request runs standard
        prefill and says why; no span is stored or reused."""
        self.disabled = reason
        self.counters["relay_disabled"] = 1
        for plan in self.planner.take_pending():
            self._discard(plan.stats, "relay_disabled")
        logger.error(
            "sglang-relay turned itself off: %s; every request runs standard prefill", reason
        )

    def graph_forward(self, mode: str) -> None:
        """A ``mode`` forward replayed a captured graph (the decode capture ran inside it)."""
        self.counters[f"graph_forwards_{mode.lower()}"] += 1
        for plan in self.planner.take_pending():  # plans run in eager extends only
            self._discard(plan.stats, f"{mode.lower()}_batch")

    def scratch_free(self) -> int:  # memory for relay's own buffers (forward/scratch.py)
        return free_bytes(self.ledger.stamps.device)

    def _tp_agreed(self, plan: BatchPlan | None) -> bool:
        """Under TP, before any plan-shaped collective: every rank holds the same plan
        (:meth:`.TPSync.agree_plan`), else its requests fall back; relay off on one rank
        goes off on all (alone, it would never agree with the others again)."""
        fp = NO_PLAN if plan is None else plan_fingerprint(plan)
        agreed, reason, off = self.tp.agree_plan(fp, self.disabled is not None)
        if off and self.disabled is None:
            self.disable("relay turned itself off on another TP rank")
        for stats in plan.owners if plan is not None and not agreed else ():
            self._discard(stats, reason)
        return agreed

    def _relay(self, original, model, input_ids, positions, fb: ForwardBatch, plan, args, kwargs):
        plan.lora, plan.clock = self.lora, self.phases
        call = (original, model, input_ids, positions, fb, args, kwargs)
        failed = None  # before any collective: a failure falls back on every rank together
        try:
            with self.phases("prepare"):
                failed = scratch_refusal(plan, self.driver, self.scratch_free())
                if failed is None:
                    relay_prepare(self.driver, fb, plan, self.ledger, self.capture_layer)
        except Exception as exc:  # noqa: BLE001 - counted as the plan's fallback
            logger.exception("preparing a relay extend failed; standard prefill for this batch")
            failed = f"error: {type(exc).__name__}"
        if self.tp is not None:
            failed = self.tp.worst_failure(failed, "prepare")
        if failed is not None:
            return self._fall_back(plan, failed, call)
        try:
            out = relay_extend(
                self.driver, input_ids, positions, fb, plan, self.ledger, self.capture_layer
            )
        except Exception as exc:  # the stock forward rewrites every extend row's KV
            if self.tp is not None and not isinstance(exc, TPMismatch):
                # raised on this rank alone, maybe between two of the layer loop's
                # collectives: the other ranks may wait in one this rank never joins, and
                # SGLang's forward here would pair its collectives with theirs (a hang, or
                # wrong sums where shapes match). Fail as SGLang fails on any forward error.
                self.disable(f"relay extend raised on TP rank {self.tp.rank}: {exc!r}")
                raise
            logger.exception("relay extend failed; standard prefill for this batch")
            reason = "tp_mismatch: selections" if isinstance(exc, TPMismatch) else "error"
            reason = f"{reason}: {type(exc).__name__}"
            return self._fall_back(plan, reason, call)
        for stats in plan.owners:
            if stats.chunk is not None:
                self.counters["spans_matched"] += stats.chunk.spans
                if stats.chunk.probe is not None:
                    self.counters[f"probe_{stats.chunk.probe}"] += 1
            stats.commit()
            self._republish(stats)
        self.counters["relay_extends"] += 1
        self.counters["relayed_tokens"] += int(plan.span_rows.numel())
        return out

    def _fall_back(self, plan: BatchPlan, reason: str, call: tuple):
        """The plan's requests fall back: SGLang's forward of the batch (``call``)."""
        for stats in plan.owners:
            self._discard(stats, reason)
        return self._plain(*call, "EXTEND", True)

    def _discard(self, stats: RequestStats, reason: str) -> None:
        stats.discard(reason)
        self.counters.fallback(reason)
        self._republish(stats)

    def _republish(self, stats: RequestStats) -> None:
        if stats.req is not None:
            set_request_info(stats.req, stats.to_dict())

    # ---- cache side ----------------------------------------------------------------------
    def relayed_from(self, rid: str) -> int | None:
        """The first row position of ``rid`` holding relayed (approximate) KV, if any."""
        stats = self.requests.get(rid)
        return None if stats is None else stats.relayed_from

    def release(self, rid: str) -> None:
        """The request's row is gone: forget its plan and stats."""
        self.planner.forget(rid)
        self.requests.pop(rid, None)
        self.gate.forget(rid)

    def reset(self) -> None:
        """``flush_cache``: the allocator is cleared right after; forget, do not free."""
        self.store.clear(release=False)
        self.ledger.reset()
        self.requests.clear()
        self.planner.pending.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "method": self.cfg.method,
            "config": self.cfg.to_dict(),
            "profile": self.settings.profile_path,
            "scope": self.settings.scope,
            "min_share": self.settings.min_share,
            "profiled": self.settings.profiled,
            "reuse_target": self.settings.reuse_target,
            "operating_points": [t for t, _ in self.settings.frontier.points],
            "default_point": None
            if self.default_point is None
            else {**self.default_point.to_dict(), "config": self.default_point.config.to_dict()},
            "capture_layer": self.capture_layer,
            "disabled": self.disabled,
            "extend_attention": self.attention_name,
            "cuda_graphs": self.graphs,
            "capture_in_graph": self.capture_in_graph,
            "gc": collector_state(),
            "kv_moves_followed": self.moves_followed,
            "kv_moved_slots": 0 if self._moved_slots is None else int(self._moved_slots),
            "linear_method": self.linear_method,
            "linear_rows": self.linear_rows,
            "kernels": kernel_family(self.device),
            "side_bytes": self.side_bytes(),
            **self.phases.stats(),
            "kv_budget": self.kv_budget,
            **(self.tp.stats() if self.tp is not None else {"tp_size": 1}),
            "dp_rank": dp_rank()[0],
            "dp_fingerprints_sent": self.publisher.sent if self.publisher is not None else 0,
            "dp_fingerprints_dropped": self.publisher.dropped if self.publisher else 0,
            "requests_tracked": len(self.requests),
            **self.store.stats(),
            **dict(self.counters),
        }
