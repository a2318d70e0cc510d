"""Early-stop guard: a relayed reply that stops within its first tokens is redone exactly.

Why (docs/fidelity.md, "The demo's Reviewer"): the worst thing approximate KV does to a
user is not a small shift in the distribution but a reply that ends at once (the demo's
Reviewer wrote three backticks and the end of turn where exact prefill writes a review).
Such a stop is visible on the server: the request finished by a stop condition (end of
sequence, a stop token or a stop string) after at most ``N`` output tokens while relayed
KV was in its prompt. The guard then sends the same request again with standard prefill
(same sampling parameters, same relay key, its output stored as a span as the first one
would have been) and returns that answer instead; ``meta_info["relay"]["guard"]`` says so,
and the schedulers count ``guard_reprefills``. Its price is one standard prefill for a
relayed request whose answer is genuinely that short, bounded by the prompt.

It runs in the tokenizer manager, around SGLang's per-request response stream. A guarded
streamed request's first ``N`` tokens are held back until the guard has decided, so a
client never sees a reply that is then replaced. Holding costs a streamed relayed reply up
to ``N`` decode steps of time to its first chunk, which is what relay saves, so streams
are guarded only when asked (``SGLANG_RELAY_GUARD_STREAMS=1``, ``serve
--relay-guard-streams``); requests that wait for the whole reply, as agent frameworks'
calls do, are guarded by default. ``SGLANG_RELAY_GUARD_TOKENS`` (``serve
--relay-guard-tokens``) sets ``N`` (default 4); ``0`` turns the guard off.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_relay.runtime.config.settings import DEFAULT_GUARD_TOKENS
from sglang_relay.runtime.sglang.scheduling import GUARD_KEY, request_times, submit_request
from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import GenerateReqInput, ReqState, TokenizerManager

logger = logging.getLogger(__name__)

ENV_GUARD_TOKENS = "SGLANG_RELAY_GUARD_TOKENS"
ENV_GUARD_STREAMS = "SGLANG_RELAY_GUARD_STREAMS"


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    tokens: int = DEFAULT_GUARD_TOKENS  # N: replies of at most N tokens are checked; 0: off
    streams: bool = False  # also streamed requests (their first N tokens are held back)


def guard_policy(env: dict[str, str] | None = None) -> GuardPolicy:
    """The policy from the environment (ValueError on a bad value)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_GUARD_TOKENS)
    try:
        n = int(raw) if raw else DEFAULT_GUARD_TOKENS
    except ValueError as exc:
        raise ValueError(f"{ENV_GUARD_TOKENS} must be an integer; got {raw!r}") from exc
    if n < 0:
        raise ValueError(f"{ENV_GUARD_TOKENS} must be >= 0; got {n}")
    streams = env.get(ENV_GUARD_STREAMS, "0")
    if streams not in ("0", "1"):
        raise ValueError(f"{ENV_GUARD_STREAMS} must be 0 or 1; got {streams!r}")
    return GuardPolicy(tokens=n, streams=streams == "1")


def stop_reason(out: dict[str, Any], limit: int) -> str | None:
    """Why the finished response ``out`` must be redone with standard prefill, or None.

    It must have relayed KV (``meta_info["relay"]["reused_tokens"] > 0``), have finished by
    a stop condition (not the length limit, not an abort) and hold at most ``limit`` output
    tokens."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if limit <= 0 or not isinstance(meta, dict):
        return None
    info = meta.get("relay")
    finish = meta.get("finish_reason")
    if not isinstance(info, dict) or not info.get("reused_tokens"):
        return None
    if not isinstance(finish, dict) or finish.get("type") != "stop":
        return None
    n = meta.get("completion_tokens")
    if not isinstance(n, int) or n > limit:
        return None
    return f"stopped after {n} tokens with {info['reused_tokens']} relayed prompt tokens"


def eligible(obj: GenerateReqInput, policy: GuardPolicy) -> bool:
    """Whether a request may be guarded at all: a generate request of one prompt that may
    run longer than the limit, not streamed (unless the policy holds streams back), outside
    SGLang's sessions (a redo would append twice)."""
    sp = getattr(obj, "sampling_params", None)
    if policy.tokens <= 0 or not isinstance(sp, dict) or getattr(obj, "session_params", None):
        return False
    if getattr(obj, "stream", False) and not policy.streams:
        return False
    max_new = sp.get("max_new_tokens")
    return max_new is None or int(max_new) > policy.tokens


def standard_option(option: Any) -> dict[str, Any]:
    """The redo's ``custom_params["relay"]``: standard prefill, the same relay key, and its
    output stored as a span exactly when the relayed request's would have been."""
    from sglang_relay.runtime.sched.options import stores_spans

    redo: dict[str, Any] = {"method": "standard", "store": stores_spans(option)}
    if isinstance(option, dict) and "key" in option:
        redo["key"] = option["key"]
    return redo


REDO_SUFFIX = "-relay-guard"


def live_redo(rid: str) -> str | None:
    """The rid of the guard's redo of request ``rid`` while it runs, else None."""
    return STATE.live_redos.get(rid)


def redo_request(obj: GenerateReqInput, out: dict[str, Any]) -> Any:
    """A copy of request ``obj`` that runs with standard prefill, under a new rid: one
    sample (the guarded request is one sample of its request, whatever its ``n``), marked
    as built here so the trust boundary keeps its private note (:mod:`.trust`)."""
    from sglang_relay.runtime.sched import trust

    sp = dict(obj.sampling_params)
    sp.pop("n", None)
    params = dict(sp.get("custom_params") or {})
    info = out["meta_info"]["relay"]
    params["relay"] = standard_option(params.get("relay"))
    params[GUARD_KEY] = {"of": str(obj.rid), "reused_tokens": int(info["reused_tokens"])}
    sp["custom_params"] = params
    redo = copy.copy(obj)
    redo.sampling_params = sp
    redo.rid = f"{obj.rid}{REDO_SUFFIX}"
    return trust.trust(redo)


def _first_usage(meta: dict[str, Any]) -> dict[str, Any]:
    """What the relayed (first) attempt computed, for the redo's response."""
    keys = ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency")
    return {k: meta[k] for k in keys if k in meta}


async def guarded(
    responses,
    manager: TokenizerManager,
    obj: GenerateReqInput,
    request: Any,
    policy: GuardPolicy,
    state: ReqState,
):
    """The responses of request ``obj`` (tokenizer-manager state ``state``) with the guard
    applied (see the module text)."""
    limit = policy.tokens
    if not eligible(obj, policy):
        async for out in responses:
            yield out
        return
    held: list[dict[str, Any]] = []
    async for out in responses:
        meta = out.get("meta_info") if isinstance(out, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        if meta.get("finish_reason") is None:  # a streamed chunk
            info, n = meta.get("relay"), meta.get("completion_tokens")
            relayed = isinstance(info, dict) and bool(info.get("reused_tokens"))
            if relayed and isinstance(n, int) and n <= limit:
                held.append(out)  # the guard may still replace it
                continue
            for chunk in held:
                yield chunk
            yield out
            async for rest in responses:  # decided: nothing more is held
                yield rest
            return
        reason = stop_reason(out, limit)
        if reason is None:
            for chunk in held:
                yield chunk
            yield out
            return
        first = meta["relay"]
        times = request_times(state)
        waited = time.perf_counter() - times[0] if times is not None else 0.0
        redo = redo_request(obj, out)
        first_usage = _first_usage(meta)
        sent = False
        STATE.live_redos[str(obj.rid)] = redo.rid
        try:
            async for redone in submit_request(manager, redo, request):
                redone_meta = redone.get("meta_info") if isinstance(redone, dict) else None
                if isinstance(redone_meta, dict):
                    redone_meta["id"] = obj.rid
                    info = redone_meta.get("relay")
                    info = dict(info if isinstance(info, dict) else {})
                    if "ttft_s" in info:  # from the first request's arrival
                        info["ttft_s"] = round(waited + info["ttft_s"], 6)
                    if isinstance(redone_meta.get("e2e_latency"), int | float):
                        # what the client waited for: the first attempt and the redo
                        redone_meta["e2e_latency"] = round(waited + redone_meta["e2e_latency"], 6)
                    info["guard"] = {
                        "reprefilled": True,
                        "reason": reason,
                        "relayed": first,
                        "first_attempt": first_usage,  # computed too, then replaced
                    }
                    redone_meta["relay"] = info
                sent = True
                yield redone
        except Exception as exc:  # the redo failed before answering: the first answer, said
            if sent:
                raise
            logger.exception("sglang-relay: early-stop guard redo of %s failed", obj.rid)
            error = f"{type(exc).__name__}: {exc}"
            note = {"reprefilled": False, "reason": reason, "error": error}
            meta["relay"] = {**first, "guard": note}
            for chunk in held:
                yield chunk
            yield out
        finally:
            STATE.live_redos.pop(str(obj.rid), None)
        return
    for chunk in held:
        yield chunk
