"""Requests as SGLang's scheduler, tokenizer manager and DP controller hold them: isolation
keys, why a request must not relay, the chunk an extend computes, relay's private notes on
a request (the guard's redo, the DP route) and the times SGLang stamps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_relay.runtime.sglang.views import check_surface

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import (
        DataParallelController,
        GenerateReqInput,
        Req,
        ReqState,
        TokenizedGenerateReqInput,
        TokenizerManager,
    )


def dp_loads(controller: DataParallelController) -> tuple[list[int], list[int]]:
    """(running + waiting requests per DP rank, the ranks that take work) as SGLang's
    controller sees them (its load snapshot, refreshed at most every 20 ms)."""
    check_surface("DataParallelController", controller)
    controller.refresh_load_budget()
    return list(controller.dp_budget.total_requests), list(controller._active_workers)


def dp_controller_receiver(controller: DataParallelController):
    """(the controller's socket from the tokenizer, receive one message without blocking,
    dispatch one message, feed the controller's soft watchdog), for an event loop that
    waits on the socket (:func:`sglang_relay.runtime.standin.cpu.blocking_event_loop`)."""
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    check_surface("DataParallelControllerLoop", controller)
    sock = controller.recv_from_tokenizer

    def recv():
        return dpc.sock_recv(sock, flags=zmq.NOBLOCK)

    return sock, recv, controller._request_dispatcher, controller.soft_watchdog.feed


DP_ROUTE_KEY = "__sglang_relay_dp_route"  # private custom_params key: controller -> rank


def tag_dp_route(req: TokenizedGenerateReqInput, decision: str) -> None:
    """Record the DP controller's routing decision on a tokenized request."""
    sp = req.sampling_params
    params = sp.custom_params if isinstance(sp.custom_params, dict) else {}
    params[DP_ROUTE_KEY] = decision
    sp.custom_params = params


GUARD_KEY = "__sglang_relay_guard"  # private custom_params key: guard redo -> scheduler


def guard_redo_of(req: Req) -> dict | None:
    """The early-stop guard's note on a scheduler request that redoes a relayed one
    (``{"of": rid, "reused_tokens": n}``), else None. The tokenizer removes private keys
    from client requests (:mod:`.trust`); a note not shaped as the guard writes it is
    ignored here all the same, never raised on (a scheduler exception ends the server)."""
    params = getattr(req.sampling_params, "custom_params", None)
    note = params.get(GUARD_KEY) if isinstance(params, dict) else None
    if not isinstance(note, dict):
        return None
    of, n = note.get("of"), note.get("reused_tokens")
    if not isinstance(of, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return None
    return {"of": of[:256], "reused_tokens": min(n, 1 << 40)}


def submit_request(manager: TokenizerManager, obj: GenerateReqInput, request):
    """Send a new generate request through the tokenizer manager as the HTTP server
    would; its responses (an async generator)."""
    check_surface("GenerateReqInput", obj)
    return manager.generate_request(obj, request)


def request_times(state: ReqState) -> tuple[float, float] | None:
    """(arrival, first output) of a tokenizer-manager request state, on the monotonic
    clock SGLang stamps them with (``time.perf_counter``); None before its first output."""
    stats = getattr(state, "time_stats", None)
    created = getattr(stats, "created_time", 0.0)
    first = getattr(stats, "first_token_time", 0.0)
    return (float(created), float(first)) if created and first else None


def scheduler_times_sent(manager: TokenizerManager) -> bool:
    """Whether the schedulers send their per-request time stats (``--enable-metrics``), the
    only source of a non-streamed request's first-token time in the tokenizer manager."""
    return bool(getattr(manager.server_args, "enable_metrics", False))


# every routing decision the DP controller tags (runtime/scale/dp_routing.py): a fixed label set
DP_DECISIONS = frozenset(
    {"matched", "key", "explicit", "fallback", "fallback_overloaded", "fallback_error"}
)


def dp_route(req: Req) -> str | None:
    """The DP controller's routing decision for a scheduler request (None: no DP routing,
    or a value the controller does not write)."""
    params = getattr(req.sampling_params, "custom_params", None)
    route = params.get(DP_ROUTE_KEY) if isinstance(params, dict) else None
    return route if isinstance(route, str) and route in DP_DECISIONS else None


def dp_rank() -> tuple[int, int]:
    """(this scheduler's DP rank, its TP rank)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.dp_rank or 0), int(parallel.tp_rank or 0)


def evict_result():
    from sglang.srt.mem_cache.base_prefix_cache import EvictResult

    return EvictResult()


class IsolationError(ValueError):
    """A scheduler request whose ``extra_key`` cannot be split into the user's key and its
    LoRA adapter id: it neither stores nor reuses spans."""


def request_isolation(req: Req, lora: str = "adapter") -> tuple:
    """SGLang's cache isolation keys of a scheduler ``Req``: ``(extra_key the user set,
    LoRA adapter id, cache_salt)``. ``Req.__init__`` stores ``extra_key`` as the user's
    key with the adapter id appended and keeps ``lora_id`` apart, so the two are split
    here (a concatenation would let ``"x" + id`` under the base model meet ``"x"`` under
    the adapter). ``lora``: ``"adapter"`` keeps adapters apart, ``"shared"`` drops the id.
    Raises :class:`IsolationError` if the key does not end with the id."""
    key, lora_id = req.extra_key or None, getattr(req, "lora_id", None) or None
    if lora_id is not None:
        if key is None or not key.endswith(lora_id):
            raise IsolationError("extra_key does not end with the request's lora_id")
        key = key[: len(key) - len(lora_id)] or None
    return _isolation(key, lora_id, req.cache_salt, lora)


def tokenized_isolation(recv, lora: str = "adapter") -> tuple:
    """The same keys of a tokenized request (``TokenizedGenerateReqInput``, where the DP
    controller routes it): it carries ``extra_key`` and ``lora_id`` as separate fields.
    An embedding request has no ``extra_key`` (AttributeError: the router leaves it to
    SGLang's own routing, counted)."""
    return _isolation(recv.extra_key or None, recv.lora_id or None, recv.cache_salt, lora)


def _isolation(key, lora_id, salt, lora: str) -> tuple:
    return (key, lora_id if lora == "adapter" else None, salt)


def request_refusal(req: Req) -> str | None:
    """Why this request must not relay (it runs standard prefill), else None."""
    # SGLang sets logprob_start_len to the input length for output-only logprobs; -1 asks
    # for none; anything inside the prompt asks for input-token logprobs
    if req.return_logprob and 0 <= req.logprob_start_len < len(req.origin_input_ids) - 1:
        return "input_logprobs"
    if getattr(req, "return_hidden_states", False):
        return "return_hidden_states"
    if getattr(req, "input_embeds", None) is not None or req.multimodal_inputs is not None:
        return "unsupported_input"
    if getattr(req, "session_id", None) is not None:
        return "session"  # the row becomes the next turn's exact prefix
    if beam_search(req):
        return "beam_search"
    return None


def beam_search(req: Req) -> bool:
    """Beam requests share slots between rows (SGLang remaps them): never relay or record."""
    return (getattr(req.sampling_params, "beam_width", 1) or 1) > 1


def extend_chunk(req: Req) -> tuple[list[int], int, bool]:
    """The tokens this extend computes, the row position of the first, and whether the
    chunk ends the request's input (chunked prefill truncates ``get_fill_ids()`` to the
    chunk, so the full length comes from the untruncated ids)."""
    start = req.prefix_len
    end = start + req.extend_len
    tokens = list(req.get_fill_ids()[start:end])
    total = len(req.origin_input_ids) + len(req.output_ids)
    return tokens, start, end >= total


def prompt_ids(req: Req) -> list[int]:
    """The request's whole prompt (every chunk of it)."""
    return list(req.origin_input_ids)


def remaining_input(req: Req, limit: int | None = None) -> list[int]:
    """The input tokens a waiting request still has to prefill (after its prefix match),
    at most ``limit`` of them."""
    end = None if limit is None else req.prefix_len + limit
    return list(req.full_untruncated_fill_ids[req.prefix_len : end])


def adder_tree_cache(adder):
    """The tree cache of a ``PrefillAdder``."""
    return adder.tree_cache


def adder_admitted(adder) -> list:
    """Requests a ``PrefillAdder`` admitted to the batch so far."""
    return adder.can_run_list


def add_req_stop():
    """``add_one_req``'s "stop adding to this batch" result (the request stays queued)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult.OTHER


def set_request_info(req: Req, info: dict) -> None:
    """Publish ``info`` as the request's ``meta_info["relay"]`` (request-level info)."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info["relay"] = [info]


def evict_params(num_tokens: int):
    """SGLang's ``EvictParams`` asking a tree cache for ``num_tokens`` device slots."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=num_tokens)
