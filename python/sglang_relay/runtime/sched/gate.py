"""The scheduler side of one relay runtime: which requests relay, and how.

A :class:`RequestGate` answers the scheduler's hooks for one request at a time:

* ``admits(req, admitted)`` when SGLang adds a request to a prefill batch (a batch holds
  relaying requests or plain ones, never both);
* ``plan(req)`` / ``plan_failed(req)`` after ``prepare_for_extend``: the request's options,
  namespace and spans in this chunk, planned for the next forward or published as a
  fallback with its reason;
* ``store_namespace(req)`` when a finished request's output may be stored as a span.

It never touches a forward; the model side is :class:`~.runtime.RelayRuntime`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.operating import OperatingPoint
from sglang_relay.core.relatedness import related_spans
from sglang_relay.runtime.sched.options import (
    namespace,
    request_option,
    request_tenant,
    resolve_config,
    stores_spans,
)
from sglang_relay.runtime.sglang.scheduling import (
    IsolationError,
    dp_route,
    extend_chunk,
    prompt_ids,
    remaining_input,
    request_isolation,
    request_refusal,
    set_request_info,
)
from sglang_relay.runtime.sglang.views import check_surface
from sglang_relay.runtime.stats import RequestStats

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import Req

MEMO_ENTRIES = 4096  # per-request memos keep at most this many requests
# a prompt that pastes an output whose span was dropped for room (cache/evicted.py)
EVICTED = (
    "span_evicted: the pasted output's span was dropped for room (raise "
    "--relay-span-tokens, or --relay-host-tokens / --relay-host-ttl with a host tier)"
)


def _remember(memo: OrderedDict, key: Any, value: Any) -> None:
    memo[key] = value
    while len(memo) > MEMO_ENTRIES:
        memo.popitem(last=False)


class RequestGate:
    """Admission and per-request planning for the runtime ``rt`` (whose ``disabled`` /
    ``disable``, settings, span store, planner, counters and planned requests it uses)."""

    def __init__(self, rt: Any, *, admit_window: int | None) -> None:
        self.rt = rt
        self.settings = rt.settings
        # the admission check looks at the next chunk only (what the plan will see), so a
        # long prompt costs O(chunk) per chunk there, not O(rest of the prompt)
        self.admit_window = admit_window
        self._req_checked = False
        self._req_unreadable = False  # the Req surface check failed: read nothing of a Req
        self._relays: OrderedDict[tuple[str, int], bool] = OrderedDict()  # admission memo
        self._related: OrderedDict[str, set[int]] = OrderedDict()  # rid -> span ids
        self._routes_counted: OrderedDict[str, bool] = OrderedDict()  # DP decisions counted

    # ---- options ---------------------------------------------------------------------------
    def config(self, req: Req) -> tuple[RelayConfig | None, OperatingPoint | None]:
        """``req``'s relay config (None: standard) and operating point; ValueError on bad
        options."""
        rt = self.rt
        return resolve_config(
            self.settings,
            request_option(req),
            num_layers=rt.num_layers,
            capture_layer=rt.capture_layer,
            context_layer=rt.context_layer,
        )

    def namespace(self, req: Req) -> tuple | None:
        """The span namespace ``req`` reuses from (None: none, under scope ``key`` without
        a key); ValueError on a bad relay key."""
        isolation = request_isolation(req, self.settings.lora)
        return namespace(self.settings.scope, isolation, request_option(req), request_tenant(req))

    def store_namespace(self, req: Req) -> tuple | None:
        """Where ``req``'s output is stored as a span (None: it is not): its namespace, if
        it has one and did not opt out of relay without asking to store."""
        if self.rt.disabled is not None:
            return None
        try:
            return self.namespace(req) if stores_spans(request_option(req)) else None
        except ValueError:
            return None

    # ---- admission -------------------------------------------------------------------------
    def admits(self, req: Req, admitted: list) -> bool:
        """Whether ``req`` may join a prefill batch that already holds ``admitted``: plain
        requests never share a batch with relaying ones, so they run SGLang's own forward
        (its kernels, its numerics) exactly as on a server without relay."""
        if self.rt.disabled or not admitted:
            return True
        try:
            if self.relays_in(req) == self.relays_in(admitted[0]):
                return True
        except Exception as exc:  # noqa: BLE001 - admission must never raise
            self.rt.disable(f"admission check failed ({type(exc).__name__}: {exc})")
            return True
        self.rt.counters["batches_split"] += 1
        return False

    def relays_in(self, req: Req) -> bool:
        """Whether the next chunk of ``req``'s input holds a related stored span it would
        relay (what its plan will find)."""
        key = (req.rid, req.prefix_len)
        known = self._relays.get(key)
        if known is None:
            try:
                cfg, _ = self.config(req)
                ns = self.namespace(req)
            except ValueError:
                cfg = ns = None
            known = False
            if cfg is not None and ns is not None and request_refusal(req) is None:
                window = remaining_input(req, self.admit_window)
                ids = {m.span_id for m in self.rt.store.matches(window, ns)}
                if ids and self.settings.min_share > 0:
                    ids &= self.related(req, ns)
                known = bool(ids)
            _remember(self._relays, key, known)
        return known

    def related(self, req: Req, ns: Any) -> set[int]:
        """The stored spans ``req``'s prompt relates to (see ``related_spans``): decided
        once per request, on its whole remaining input, so every chunk agrees."""
        related = self._related.get(req.rid)
        if related is None:
            store = self.rt.store
            related = related_spans(
                store.matches(remaining_input(req), ns),
                store.span_length,
                self.settings.min_share,
                answer_start=store.answer_start,
            )
            _remember(self._related, req.rid, related)
        return related

    # ---- planning --------------------------------------------------------------------------
    def plan(self, req: Req, written: Any = None) -> None:
        """After ``prepare_for_extend``: find spans in this extend chunk of ``req``
        (``written``: the slots the batch writes, ``out_cache_loc``)."""
        with self.rt.phases("match"):
            self._plan(req, written)

    def _plan(self, req: Req, written: Any) -> None:
        rt = self.rt
        if not self._req_checked:  # the first request is the first Req there is to check
            self._req_checked = True
            try:
                check_surface("Req", req)
            except Exception as exc:  # noqa: BLE001 - loud and for good, not per request
                self._req_unreadable = True
                rt.disable(f"SGLang's Req does not match what relay reads ({exc})")
        if self._req_unreadable:
            return  # nothing of a Req may be read or written
        route = dp_route(req)
        if route is not None and req.rid not in self._routes_counted:
            _remember(self._routes_counted, req.rid, True)
            rt.counters[f"dp_routed_{route}"] += 1
        stats = rt.requests.get(req.rid)
        if stats is None:
            stats = RequestStats(rt.cfg.method, rt.num_layers)
        if rt.disabled is not None:
            return self.publish(req, stats, fallback=f"relay_disabled: {rt.disabled}")
        try:
            cfg, point = self.config(req)
        except ValueError as exc:
            return self.publish(req, stats, fallback=f"bad_options: {exc}")
        stats.method = cfg.method if cfg is not None else "standard"
        stats.point = point.to_dict() if point is not None else None
        if cfg is None:
            return self.publish(req, stats)
        refusal = request_refusal(req)
        if refusal is not None:
            return self.publish(req, stats, fallback=refusal)
        try:
            ns = self.namespace(req)
        except IsolationError as exc:
            return self.publish(req, stats, fallback=f"lora_namespace: {exc}")
        except ValueError as exc:
            return self.publish(req, stats, fallback=f"bad_options: {exc}")
        if ns is None:  # scope "key": no cache_salt and no relay key
            return self.publish(req, stats, fallback="no_relay_key")
        tokens, start, last_chunk = extend_chunk(req)
        if last_chunk:
            tokens = tokens[:-1]  # the last prompt token is always computed normally
        planned, unrelated = rt.planner.plan_request(
            req.rid,
            cfg,
            stats,
            tokens,
            start,
            ns,
            related=(lambda: self.related(req, ns)) if self.settings.min_share > 0 else None,
            last_chunk=last_chunk,
            written=written,
        )
        if unrelated:
            rt.counters["unrelated_matches"] += unrelated
        if planned:
            rt.requests[req.rid] = stats
        elif unrelated:  # every match was to an unrelated span
            return self.publish(req, stats, fallback="unrelated_match")
        elif (
            last_chunk
            and req.rid not in rt.requests
            and rt.store.evicted.pasted(prompt_ids(req), ns)
        ):  # it relayed nothing and pastes a span that was dropped for room
            return self.publish(req, stats, fallback=EVICTED)
        self.publish(req, stats)

    def plan_failed(self, req: Req) -> None:
        """Planning raised: the request runs standard prefill and says so."""
        rt = self.rt
        rt.planner.forget(req.rid)
        stats = rt.requests.get(req.rid) or RequestStats(rt.cfg.method, rt.num_layers)
        self.publish(req, stats, fallback="error")

    def publish(self, req: Req, stats: RequestStats, fallback: str | None = None) -> None:
        """``stats`` become ``req``'s relay info (with ``fallback``, counted, if given)."""
        if fallback is not None:
            stats.discard(fallback)
            self.rt.counters.fallback(fallback)
        set_request_info(req, stats.to_dict())
        stats.req = req

    def forget(self, rid: str) -> None:
        """The request's row is gone."""
        self._related.pop(rid, None)
