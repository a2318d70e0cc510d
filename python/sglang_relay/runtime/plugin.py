"""SGLang plug-in entry point (group ``sglang.srt.plugins``, name ``relay``).

SGLang calls :func:`register` in every process it starts (engine, scheduler,
detokenizer), because processes are spawned and see nothing registered elsewhere. Every
hook is inert unless the ``relay`` radix-cache backend was built in that process, so
installing the package changes nothing for servers that do not select it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "relay"
RELAY_INFO_KEY = "relay"
_registered = False


def register() -> None:
    """Register the ``relay`` radix-cache backend and the plug-in's hooks. Idempotent."""
    global _registered
    if _registered:
        return
    from sglang_relay.runtime import compat

    register_backend, registered_backends, _ = compat.radix_cache_api()
    if BACKEND_NAME not in registered_backends():
        from sglang_relay.runtime.radix_cache import build_relay_cache

        register_backend(BACKEND_NAME, build_relay_cache)

    registry, hook = compat.hook_registry()
    registry.register(compat.INTERNAL_STATE_TARGET, _add_relay_state, hook.AFTER)
    for target in compat.MODEL_FORWARD_TARGETS:
        registry.register(target, _model_forward, hook.AROUND)
    registry.register(compat.PREPARE_FOR_EXTEND_TARGET, _after_prepare_for_extend, hook.AFTER)
    registry.register(compat.REQUEST_LEVEL_KEY_TARGET, _request_level_key, hook.AROUND)
    registry.register(compat.META_INFO_TARGET, _unwrap_meta_info, hook.AFTER)
    _registered = True
    logger.info("sglang-relay registered (radix cache backend %r)", BACKEND_NAME)


def _add_relay_state(result, controller, *args, **kwargs):
    """Add ``relay`` (the tree cache's relay stats) to ``/get_server_info`` internal states."""
    stats = getattr(controller.scheduler.tree_cache, "relay_stats", None)
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        state["relay"] = stats() if callable(stats) else {"enabled": False}
    return result


def _model_forward(original, model, input_ids, positions, forward_batch, *args, **kwargs):
    from sglang_relay.runtime.relay import current

    rt = current()
    if rt is None or model is not rt.model or kwargs.get("input_embeds") is not None:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    if args and args[0] is not None:  # input_embeds passed positionally
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    from sglang_relay.runtime import model_loop

    mode = forward_batch.forward_mode
    if mode.is_decode():
        if not rt.captures:
            return original(model, input_ids, positions, forward_batch, *args, **kwargs)
        return model_loop.capture_decode(
            model,
            input_ids,
            positions,
            forward_batch,
            rt.capture_layer,
            rt.hidden,
            rt.influence,
            rt.influence_layer,
            rt.req_to_token,
        )
    if mode.name != "EXTEND":  # mixed, draft and verify batches keep the stock path
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    plan = rt.batch_plan(forward_batch)
    if plan is None:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    try:
        out = model_loop.relay_extend(
            model, input_ids, positions, forward_batch, plan, rt.hidden, rt.influence
        )
    except Exception as exc:  # fall back: the stock forward rewrites every extend row's KV
        rt.fail_plan(plan, exc)
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    rt.finish_plan(plan)
    logger.debug(
        "relay extend: %d rows, %d relayed, groups=%s",
        plan.num_rows,
        int(plan.span_rows.numel()),
        [(g.cfg.method, int(g.rows.numel())) for g in plan.groups],
    )
    return out


def _after_prepare_for_extend(result, batch, *args, **kwargs):
    from sglang_relay.runtime.relay import current

    rt = current()
    if rt is None or batch.forward_mode.name != "EXTEND":
        return result
    for req in batch.reqs:
        try:
            rt.plan_request(req)
        except Exception:  # planning must never break scheduling
            logger.exception("relay planning failed for %s; standard prefill", req.rid)
            rt.pending.pop(req.rid, None)
            rt.planning_failed(req)
    return result


def _request_level_key(original, streamer, key, *args, **kwargs):
    if key == RELAY_INFO_KEY:
        return True
    return original(streamer, key, *args, **kwargs)


def _unwrap_meta_info(result, manager, meta_info, *args, **kwargs):
    """``meta_info["relay"]`` arrives as a one-element list (request-level info): unwrap."""
    value = meta_info.get(RELAY_INFO_KEY)
    if isinstance(value, list) and value:
        meta_info[RELAY_INFO_KEY] = value[-1]
    return result
