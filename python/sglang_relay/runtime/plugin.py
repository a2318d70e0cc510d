"""SGLang plug-in entry point (group ``sglang.srt.plugins``, name ``relay``).

SGLang calls :func:`register` in every process it starts (engine, scheduler,
detokenizer), because processes are spawned and see nothing registered elsewhere. Every
hook is inert unless the ``relay`` radix-cache backend was built in that process, so
installing the package changes nothing for servers that do not select it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang_relay.runtime.backend import BACKEND_NAME, serves_relay
from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import (
        ForwardBatch,
        GenerateReqInput,
        KVCacheConfigurator,
        ModelRunner,
        Req,
        ReqState,
        ScheduleBatch,
        TokenizerManager,
    )

logger = logging.getLogger(__name__)

RELAY_INFO_KEY = "relay"


def _refuse_before_children(server_args, *args, **kwargs) -> None:
    """Before SGLang's launcher sets its environment and starts any child process: options
    relay cannot serve are refused at once, with the message the scheduler gives when it
    builds the cache (~30 s of imports later). ``serve`` checked them before SGLang's import;
    this is SGLang's own launcher (and an Engine). The scheduler still checks them, with the
    model's architecture and KV layout too."""
    if not serves_relay(server_args):
        return
    from sglang_relay.runtime.config.environment import unverified_set
    from sglang_relay.runtime.config.server_options import (
        never_ran,
        server_refusal,
        typed_values,
    )
    from sglang_relay.runtime.config.settings import ship_role
    from sglang_relay.runtime.sglang.server import server_view

    message = server_refusal(server_view(server_args), server_args, ship_role=ship_role())
    if message is not None:
        raise ValueError(message)
    untested = never_ran(typed_values(server_args), str(getattr(server_args, "device", "")))
    untested += unverified_set()  # SGLang environment variables of unverified sections
    if untested:  # served by design, never run by relay's tests: said once, at start-up
        logger.warning("sglang-relay: served but never run by relay's tests: %s "
                       "(docs/server-options.md)", ", ".join(untested))  # fmt: skip


def register() -> None:
    """Register the ``relay`` radix-cache backend and the plug-in's hooks. Idempotent."""
    if STATE.plugin_registered:
        return
    from sglang_relay.runtime.models.registry import MODEL_FORWARD_TARGETS
    from sglang_relay.runtime.sglang.hooks import register_hook
    from sglang_relay.runtime.sglang.server import radix_cache_api
    from sglang_relay.runtime.sglang.targets import (
        ABORT_REQUEST_TARGET,
        ADD_ONE_REQ_TARGET,
        CAPTURE_DECODE_GRAPH_TARGET,
        CPU_RESTORE_TARGET,
        DP_CONTROLLER_INIT_TARGET,
        DP_ROUTING_TARGET,
        GENERATE_REQUEST_TARGET,
        HOST_LOAD_TARGET,
        INTERNAL_STATE_TARGET,
        KV_BUDGET_TARGET,
        KV_MOVE_TARGET,
        META_INFO_TARGET,
        MIX_WITH_RUNNING_TARGET,
        MODEL_RUNNER_FORWARD_TARGET,
        PREPARE_FOR_EXTEND_TARGET,
        PROCESS_START_TARGET,
        REQUEST_LEVEL_KEY_TARGET,
        STREAM_RESPONSE_TARGET,
        TOKENIZER_INIT_TARGET,
    )

    register_backend, registered_backends, _ = radix_cache_api()
    if BACKEND_NAME not in registered_backends():
        from sglang_relay.runtime.radix_cache import build_relay_cache

        register_backend(BACKEND_NAME, build_relay_cache)

    register_hook(INTERNAL_STATE_TARGET, _add_relay_state, "after")
    for target in MODEL_FORWARD_TARGETS:
        register_hook(target, _model_forward, "around")
    register_hook(CAPTURE_DECODE_GRAPH_TARGET, _before_decode_graphs, "before")
    register_hook(MODEL_RUNNER_FORWARD_TARGET, _after_runner_forward, "after")
    from sglang_relay.runtime.scale import dp_routing

    register_hook(DP_CONTROLLER_INIT_TARGET, dp_routing.before_controller_init, "before")
    register_hook(DP_ROUTING_TARGET, dp_routing.route_request, "around")
    register_hook(PREPARE_FOR_EXTEND_TARGET, _after_prepare_for_extend, "after")
    register_hook(MIX_WITH_RUNNING_TARGET, _after_mix, "after")
    register_hook(ADD_ONE_REQ_TARGET, _add_one_req, "around")
    register_hook(REQUEST_LEVEL_KEY_TARGET, _request_level_key, "around")
    register_hook(META_INFO_TARGET, _unwrap_meta_info, "after")
    register_hook(STREAM_RESPONSE_TARGET, _unwrapped_responses, "around")
    register_hook(TOKENIZER_INIT_TARGET, _build_validator, "after")
    register_hook(GENERATE_REQUEST_TARGET, _admitted_request, "around")
    register_hook(ABORT_REQUEST_TARGET, _abort_with_redo, "around")
    register_hook(KV_BUDGET_TARGET, _config_from_budget, "around")
    register_hook(KV_MOVE_TARGET, _after_kv_move, "after")
    register_hook(HOST_LOAD_TARGET, _before_host_load, "before")
    register_hook(CPU_RESTORE_TARGET, _before_cpu_restore, "before")
    register_hook(PROCESS_START_TARGET, _refuse_before_children, "before")
    STATE.plugin_registered = True
    logger.info("sglang-relay registered (radix cache backend %r)", BACKEND_NAME)


def _add_relay_state(result, controller, *args, **kwargs):
    """Add ``relay`` (the tree cache's relay stats) to ``/get_server_info`` internal states."""
    stats = getattr(controller.scheduler.tree_cache, "relay_stats", None)
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        state["relay"] = stats() if callable(stats) else {"enabled": False}
    return result


def _model_forward(
    original, model, input_ids, positions, forward_batch: ForwardBatch, *args, **kwargs
):
    """Every forward of a Llama/Qwen2 model: through the relay runtime if it serves it.

    A forward being captured into a decode graph (and a decode before the runtime exists)
    runs the decode capture installed before graph capture: it never reads the runtime, so
    what is captured does not depend on when the runtime was built."""
    from sglang_relay.runtime.sglang.model import (
        capturing_graph,
        decode_capture_of,
        forward_mode_name,
        runtime_of,
    )

    fb = forward_batch
    if capturing_graph():
        capture = decode_capture_of(model)
        if capture is None:
            return original(model, input_ids, positions, fb, *args, **kwargs)
        return capture.forward(original, model, input_ids, positions, fb, *args, **kwargs)
    rt = runtime_of(model)
    if rt is None:
        capture = decode_capture_of(model)
        if capture is not None and forward_mode_name(fb) == "DECODE":
            return capture.forward(original, model, input_ids, positions, fb, *args, **kwargs)
        return original(model, input_ids, positions, fb, *args, **kwargs)
    return rt.forward(original, model, input_ids, positions, fb, *args, **kwargs)


def _before_decode_graphs(*args, **kwargs):
    """Before SGLang captures decode graphs: install relay's decode capture (:mod:`.decode`)."""
    from sglang_relay.runtime.forward.decode import install_decode_capture

    runner = kwargs.get("model_runner", args[0] if args else None)
    if runner is not None:
        install_decode_capture(runner)


def _after_runner_forward(result, runner: ModelRunner, *args, **kwargs):
    """A decode forward that replayed a captured graph did not come through the runtime's
    forward: count it there (and drop plans no extend will run)."""
    from sglang_relay.runtime.sglang.model import forward_mode_name, inner_model, runtime_of

    rt = runtime_of(inner_model(runner))
    fb = kwargs.get("forward_batch", args[0] if args else None)
    if rt is not None and fb is not None:
        mode = forward_mode_name(fb)
        if result.can_run_graph:
            rt.graph_forward(mode)
        rt.check_forward(mode, graph=bool(result.can_run_graph))
    return result


def _after_kv_move(result, pool, tgt_loc, src_loc, *args, **kwargs):
    """The pool copied KV between slots outside any forward (speculative decoding's
    compaction of accepted tokens): the served pool's side data follows."""
    from sglang_relay.runtime.sglang.pool import pool_runtime

    rt = pool_runtime(pool)
    if rt is not None:
        rt.kv_moved(tgt_loc, src_loc)
    return result


def _before_host_load(engine, *args, **kwargs):
    """HiCache is about to copy host KV into device slots (a tree load-back, a retracted
    request's restore), outside any forward: the served pool's slots it writes get fresh
    stamps first, so no span recorded on them reads the loaded KV as its own. The
    transfers (positional or ``transfers=``) are handed on as a list, read once here."""
    from sglang_relay.runtime.sglang.pool import pool_runtime

    if "transfers" in kwargs:
        transfers = kwargs["transfers"] = list(kwargs["transfers"])
    else:
        transfers = list(args[0])
        args = (transfers, *args[1:])
    for transfer in transfers:
        rt = pool_runtime(transfer.device_pool)
        if rt is not None and not transfer.is_draft:
            rt.kv_loaded(transfer.device_indices)
    return (engine, *args), kwargs


def _before_cpu_restore(req: Req, req_to_token_pool, allocator, *args, **kwargs):
    """A retracted request's KV is about to be copied back from CPU tensors into its row's
    slots (a PD decode server), outside any forward: they get fresh stamps first."""
    from sglang_relay.runtime.sglang.pool import pool_runtime

    rt = pool_runtime(allocator.get_kvcache())
    if rt is not None:
        slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.seqlen - 1]
        rt.kv_loaded(slots.long())
    return (req, req_to_token_pool, allocator, *args), kwargs


def _after_prepare_for_extend(result, batch: ScheduleBatch, *args, **kwargs):
    """Plan every request of an extend batch (mixed batches reuse nothing)."""
    rt = getattr(batch.tree_cache, "relay", None)
    if rt is None or batch.forward_mode.name != "EXTEND" or rt.publish_only:
        return result
    written = batch.out_cache_loc
    for req in batch.reqs:
        try:
            rt.gate.plan(req, written)
        except Exception:  # planning must never break scheduling
            logger.exception("relay planning failed; standard prefill")
            try:
                rt.gate.plan_failed(req)
            except Exception:  # noqa: BLE001 - a scheduler exception ends the server
                logger.exception("relay could not record the fallback")
    return result


def _after_mix(result, batch: ScheduleBatch, *args, **kwargs):
    """Count extend batches that SGLang mixed with running decodes (``--enable-mixed-chunk``)."""
    rt = getattr(batch.tree_cache, "relay", None)
    if rt is not None:
        rt.counters["mixed_batches"] += 1
    return result


def _add_one_req(original, adder, req: Req, *args, **kwargs):
    """A prefill batch holds relaying requests or plain ones, never both."""
    from sglang_relay.runtime.sglang.scheduling import (
        add_req_stop,
        adder_admitted,
        adder_tree_cache,
    )

    rt = getattr(adder_tree_cache(adder), "relay", None)
    if rt is not None and not rt.gate.admits(req, adder_admitted(adder)):
        return add_req_stop()
    return original(adder, req, *args, **kwargs)


def _config_from_budget(original, configurator: KVCacheConfigurator, budget_bytes, *args, **kwargs):
    """The KV pool's byte budget: relay's side data comes out of it (:mod:`.budget`)."""
    from sglang_relay.runtime.cache.budget import config_from_budget

    return config_from_budget(original, configurator, budget_bytes, *args, **kwargs)


def _build_validator(result, manager: TokenizerManager, *args, **kwargs):
    from sglang_relay.runtime.sched import trust

    trust.validator_for(manager)
    return result


async def _admitted_request(
    original, manager: TokenizerManager, obj: GenerateReqInput, *args, **kwargs
):
    """Every generate request on a relay server passes the trust boundary first
    (:mod:`.trust`): private keys stripped, the relay option resolved; a bad one raises
    ValueError before anything is sent to a scheduler (SGLang answers 400)."""
    from sglang_relay.runtime.sched import trust

    validator = trust.validator_for(manager)
    if validator is not None and hasattr(obj, "sampling_params"):
        try:
            validator.admit(obj, kwargs.get("request", args[0] if args else None))
        except ValueError:
            # refused before SGLang normalized it: what SGLang's clean-up of a refused
            # stream reads (create_abort_task: obj.is_single; nothing to abort yet)
            if getattr(obj, "is_single", None) is None:
                obj.is_single = not isinstance(getattr(obj, "rid", None), list)
            raise
    async for out in original(manager, obj, *args, **kwargs):
        yield out


def _abort_with_redo(original, manager: TokenizerManager, rid: str = "", *args, **kwargs):
    """An abort of a request reaches the early-stop guard's redo of it too."""
    from sglang_relay.runtime.sched import guard

    result = original(manager, rid, *args, **kwargs)
    redo = guard.live_redo(rid) if rid else None
    if redo is not None:
        original(manager, redo, *args, **kwargs)
    return result


def _request_level_key(original, streamer, key, *args, **kwargs):
    if key == RELAY_INFO_KEY:
        return True
    return original(streamer, key, *args, **kwargs)


def _unwrap(meta_info) -> None:
    """``meta_info["relay"]`` arrives as a list (request-level info, accumulated): unwrap."""
    value = meta_info.get(RELAY_INFO_KEY) if isinstance(meta_info, dict) else None
    if isinstance(value, list) and value:
        meta_info[RELAY_INFO_KEY] = value[-1]


def _unwrap_meta_info(result, manager: TokenizerManager, meta_info, *args, **kwargs):
    _unwrap(meta_info)
    return result


async def _unwrapped_responses(original, manager: TokenizerManager, *args, **kwargs):
    """Every response the client gets has ``meta_info["relay"]`` as one object, also the
    streamed chunks SGLang completes from its accumulated list (chunked prefills). On a
    relay server the final one also carries the server-measured TTFT, and a relayed reply
    that stops within its first tokens is redone exactly (:mod:`.guard`)."""
    from sglang_relay.runtime.sched import guard
    from sglang_relay.runtime.sglang.scheduling import request_times, scheduler_times_sent

    obj = kwargs.get("obj", args[0] if args else None)
    state = kwargs.get("state", args[1] if len(args) > 1 else None)
    request = kwargs.get("request", args[2] if len(args) > 2 else None)
    policy = _guard_policy(manager, state)
    # SGLang knows a whole-reply request's first-token time only from the scheduler's
    # time stats, which it sends with --enable-metrics; otherwise it is the reply's end
    timed = policy is not None and (getattr(obj, "stream", False) or scheduler_times_sent(manager))

    async def unwrapped():
        async for out in original(manager, *args, **kwargs):
            meta = out.get("meta_info") if isinstance(out, dict) else None
            _unwrap(meta)
            if timed and isinstance(meta, dict) and meta.get("finish_reason"):
                times = request_times(state)
                if times is not None and isinstance(meta.get(RELAY_INFO_KEY), dict):
                    meta[RELAY_INFO_KEY]["ttft_s"] = round(times[1] - times[0], 6)
            yield out

    shown = _meta_shown(manager)
    stream = unwrapped() if policy is None else guard.guarded(
        unwrapped(), manager, obj, request, policy, state
    )  # fmt: skip
    async for out in stream:
        if shown != "full" and isinstance(out, dict):  # after the guard, which reads it
            _show(out.get("meta_info"), shown)
        yield out


def _meta_shown(manager: TokenizerManager) -> str:
    """What ``meta_info["relay"]`` shows this server's clients (``SGLANG_RELAY_META``; a
    server without relay: ``full``, there is nothing to hide)."""
    from sglang_relay.runtime.sched import trust

    validator = trust.validator_for(manager)
    return "full" if validator is None else validator.settings.meta


def _show(meta_info, shown: str) -> None:
    """``meta_info["relay"]`` cut to what ``shown`` lets a client see: ``off``, nothing;
    ``counts``, its own method, reused and selected tokens, reuse rate and fallback."""
    from sglang_relay.runtime.config.settings import META_COUNTS

    if not isinstance(meta_info, dict) or RELAY_INFO_KEY not in meta_info:
        return
    info = meta_info.pop(RELAY_INFO_KEY)
    if shown == "counts" and isinstance(info, dict):
        meta_info[RELAY_INFO_KEY] = {k: info[k] for k in META_COUNTS if k in info}


def _guard_policy(manager: TokenizerManager, state: ReqState):
    """The guard's policy in this process (:class:`.guard.GuardPolicy`), or None on a
    server that does not serve relay (nothing is added or held back there). A bad value
    was refused at launch; here it only turns the guard off, loudly."""
    if not STATE.guard_policy_known:
        from sglang_relay.runtime.sched.guard import GuardPolicy, guard_policy
        from sglang_relay.runtime.sglang.views import check_tokenizer_surface

        policy = None
        args = getattr(manager, "server_args", None)
        if serves_relay(args):
            check_tokenizer_surface(manager, state)
            try:
                policy = guard_policy()
            except ValueError:
                logger.exception("sglang-relay: early-stop guard off")
                policy = GuardPolicy(tokens=0, streams=False)
        STATE.guard_policy, STATE.guard_policy_known = policy, True
    return STATE.guard_policy
