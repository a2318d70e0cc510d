"""Route each request to the data-parallel rank that holds its relayable tokens (``--dp-size N``).

With ``--dp-size N`` every rank is its own scheduler with its own span store, so a
downstream agent whose request lands on another rank than its upstream's pays full prefill.
SGLang 0.5.23's ``DataParallelController`` honours ``req.routed_dp_rank`` in
``maybe_external_dp_rank_routing`` before any load-balance method, and loads plug-ins in
its process, so routing needs no router of our own:

* every rank publishes fingerprints of the spans it stores (a hash of the 32-token window
  at every 16th token of the span and of its last window, :func:`span_fingerprints`) when
  it adds or drops one, to the controller over a Unix ``SOCK_SEQPACKET`` connection
  (:class:`FingerprintPublisher`). A send puts the message in the controller's receive
  queue before it returns, and the rank sends it before it streams the finished request's
  output: so the controller has it before any request that pastes that output can reach it
  (ZMQ, used before, hands a message to background I/O threads in both processes and does
  not order it against the rank's output; a downstream agent could be routed before its
  upstream's fingerprints were visible);
* the controller (:class:`DPRouter`) keeps which ranks hold each fingerprint; for a request
  without a rank it hashes every 32-token window of the prompt and credits each rank with
  the prompt tokens its matched windows cover (a span pasted whole: its length; a span of
  another text that shares part of it: only that part). The rank with the most wins unless
  its queue (running + waiting requests, SGLang's load snapshot) exceeds the least-loaded
  rank's by more than ``max_imbalance`` requests (``SGLANG_RELAY_DP_MAX_IMBALANCE``,
  default 8): then the configured load-balance method decides (``fallback_overloaded``);
* a request with a routing key (``X-SMG-Routing-Key`` / ``routing_key``) and no match goes
  to a stable hash of the key, so all agents of a keyed chain meet on one rank;
* otherwise the configured method decides (``fallback``).
* a request the router cannot read (an embedding request) or any routing error is left
  to the configured method too, counted on the controller (``fallback_error``): the hook
  never raises into SGLang's controller loop.

The decision rides with the request to its rank (a private ``custom_params`` key, as
SGLang's own renderer does for reasoning delimiters), which counts it:
``dp_routed_<decision>`` in ``get_server_info`` and on ``/metrics`` per rank.

Fingerprints are salted with the span's namespace (:func:`namespace_salt`) and a prompt's
windows with the request's, so a request only matches spans it could relay; the rank
still enforces namespaces when it relays (:mod:`.options`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import uuid
from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_relay.runtime.config.settings import ENV_LORA, ENV_SCOPE
from sglang_relay.runtime.scale.dp_fingerprints import (
    ENDPOINT_ENV,
    MAX_MESSAGE,
    covered_tokens,
    decode_message,
    fingerprint_choice,
    key_worker,
    namespace_salt,
    window_hashes,
)
from sglang_relay.runtime.sched.options import namespace, request_option, request_tenant
from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import DataParallelController, TokenizedGenerateReqInput

logger = logging.getLogger(__name__)


IMBALANCE_ENV = "SGLANG_RELAY_DP_MAX_IMBALANCE"


ROUTING_ENV = "SGLANG_RELAY_DP_ROUTING"  # 0: off (SGLang's load-balance method alone)


DEFAULT_MAX_IMBALANCE = 8


class DPRouter:
    """The controller side: fingerprints per rank, and the routing decision."""

    def __init__(self, num_ranks: int, endpoint: str, *, max_imbalance: int) -> None:
        """``endpoint``: the path of the Unix socket the ranks connect to (created here,
        removed at exit)."""
        self.num_ranks = num_ranks
        self.endpoint = endpoint
        self.max_imbalance = max_imbalance
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(endpoint)
        self._listener.listen(256)
        self._listener.setblocking(False)
        atexit.register(self.close)
        self._conns: list[socket.socket] = []  # one per publishing rank
        self._buf = bytearray(MAX_MESSAGE)
        self.holders: dict[int, Counter[int]] = {}  # fingerprint -> rank -> windows held
        self.spans: dict[tuple[int, int], np.ndarray] = {}  # (rank, span id) -> fingerprints
        self.decisions: Counter[str] = Counter()
        self.last_decision: str | None = None
        self.errors_seen: set[str] = set()  # exception kinds already logged (_route)
        self.scope = os.environ.get(ENV_SCOPE) or "shared"  # the ranks' relay scope
        self.lora = os.environ.get(ENV_LORA) or "adapter"  # and their LoRA namespaces

    def namespace(self, req: TokenizedGenerateReqInput) -> tuple | None:
        """The namespace ``req`` relays from, as its rank will compute it (None: none)."""
        from sglang_relay.runtime.sglang.scheduling import tokenized_isolation

        try:
            isolation = tokenized_isolation(req, self.lora)
            return namespace(self.scope, isolation, request_option(req), request_tenant(req))
        except ValueError:
            return None  # a bad relay key: the rank runs standard prefill

    # ---- fingerprints ---------------------------------------------------------------
    def drain(self) -> None:
        """Apply every fingerprint message the ranks sent before this call (each rank's in
        the order it sent them)."""
        while True:  # ranks that connected since the last call
            try:
                conn, _ = self._listener.accept()
            except OSError:  # none waiting (BlockingIOError), or closed
                break
            conn.setblocking(False)
            self._conns.append(conn)
        view = memoryview(self._buf)
        for conn in list(self._conns):
            while True:
                try:
                    n = conn.recv_into(self._buf)
                except BlockingIOError:
                    break
                except OSError:
                    n = 0
                if n == 0:  # the rank closed its end (it exited)
                    self._conns.remove(conn)
                    conn.close()
                    break
                try:
                    if n >= MAX_MESSAGE:
                        raise ValueError("fingerprint message over the size limit")
                    rank, op, span_id, hashes = decode_message(bytes(view[:n]))
                except ValueError:
                    self.decisions["bad_fingerprint_messages"] += 1
                    continue
                if 0 <= rank < self.num_ranks:
                    self.apply(rank, op, span_id, hashes)

    def close(self) -> None:
        """Stop listening and remove the socket's path."""
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint)

    def apply(self, rank: int, op: str, span_id: int, hashes: np.ndarray | None) -> None:
        key = (rank, span_id)
        if op == "add":
            self.spans[key] = hashes
            for h in hashes.tolist():
                self.holders.setdefault(h, Counter())[rank] += 1
        elif op == "drop":
            for h in self.spans.pop(key, np.empty(0, dtype=np.uint64)).tolist():
                ranks = self.holders.get(h)
                if ranks is None:
                    continue
                ranks[rank] -= 1
                if ranks[rank] <= 0:
                    del ranks[rank]
                if not ranks:
                    del self.holders[h]

    def held_tokens(self, tokens, namespace: Hashable = None) -> Counter[int]:
        """Per rank, the prompt tokens it holds as stored spans of ``namespace``: the tokens
        covered by the prompt's windows whose fingerprint the rank published (a span's
        published windows cover all of it, :func:`span_fingerprints`)."""
        found: Counter[int] = Counter()
        if not self.holders:
            return found
        starts: dict[int, list[int]] = {}
        hashes = window_hashes(tokens, 1, namespace_salt(namespace)).tolist()
        for pos, h in enumerate(hashes):
            for rank in self.holders.get(h, ()):
                starts.setdefault(rank, []).append(pos)
        for rank, pos in starts.items():
            found[rank] = covered_tokens(pos)
        return found

    # ---- routing --------------------------------------------------------------------
    def route(
        self,
        tokens,
        routing_key: str | None,
        loads: list[int],
        active: list[int],
        namespace: Hashable = None,
    ) -> int | None:
        """The rank for a request (None: let the configured load-balance method decide).
        ``loads``: running + waiting requests per rank; ``active``: ranks that take work;
        ``namespace``: the request's relay namespace (only its spans count)."""
        self.drain()
        held = self.held_tokens(tokens, namespace)
        held = {r: n for r, n in held.items() if r in active}
        if held:
            rank = fingerprint_choice(held, loads, active, self.max_imbalance)
            if rank is not None:
                return self._decided("matched", rank)
            return self._decided("fallback_overloaded", None)
        if routing_key and active:
            return self._decided("key", key_worker(routing_key, active))
        return self._decided("fallback", None)

    def _decided(self, decision: str, rank: int | None) -> int | None:
        self.decisions[decision] += 1
        self.last_decision = decision
        return rank

    def stats(self) -> dict[str, Any]:
        return {
            "fingerprints": len(self.holders),
            "spans": len(self.spans),
            **{f"routed_{k}": v for k, v in self.decisions.items()},
        }


# ---- controller process hooks ---------------------------------------------------------------


def before_controller_init(
    controller: DataParallelController, server_args, port_args, *args, **kwargs
) -> None:
    """Before the DP controller launches its ranks: bind the fingerprint socket and tell the
    ranks where it is (the environment is inherited by the spawned schedulers)."""
    from sglang_relay.runtime.backend import serves_relay

    if not serves_relay(server_args) or STATE.dp_router is not None:
        return
    if os.environ.get(ROUTING_ENV, "1") == "0":  # SGLang's load-balance method alone
        logger.info("sglang-relay: DP routing by span fingerprints is off (%s=0)", ROUTING_ENV)
        return
    from sglang_relay.runtime.sglang.views import check_router_surface

    check_router_surface()
    name = f"sglang-relay-dp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    endpoint = os.path.join(os.environ.get("TMPDIR", "/tmp"), name)
    if len(endpoint.encode()) > 100:  # a Unix socket path holds at most 107 bytes
        endpoint = os.path.join("/tmp", name)
    imbalance = int(os.environ.get(IMBALANCE_ENV, DEFAULT_MAX_IMBALANCE))
    STATE.dp_router = DPRouter(int(server_args.dp_size), endpoint, max_imbalance=imbalance)
    os.environ[ENDPOINT_ENV] = endpoint
    logger.info("sglang-relay: routing DP requests by span fingerprints (%s)", endpoint)


def route_request(
    original, controller: DataParallelController, req: TokenizedGenerateReqInput, *args, **kwargs
):
    """Around ``maybe_external_dp_rank_routing``: pick the rank holding ``req``'s spans."""
    if STATE.dp_router is not None and getattr(req, "input_ids", None):
        _route(STATE.dp_router, controller, req)
    return original(controller, req, *args, **kwargs)


def _route(
    router: DPRouter, controller: DataParallelController, req: TokenizedGenerateReqInput
) -> None:
    """Set ``req.routed_dp_rank`` to the rank holding its spans and tag the decision.

    Never raises into SGLang's controller loop: a request the router cannot read (an
    embedding request has no ``extra_key``) or any other error leaves the request as it
    came, to SGLang's own routing, counted as ``fallback_error`` (the first of each kind
    logged with its traceback)."""
    from sglang_relay.runtime.sglang.scheduling import dp_loads, tag_dp_route

    given = getattr(req, "routed_dp_rank", None)
    try:
        if given is not None:
            decision = "explicit"  # the client chose (routed_dp_rank / X-Data-Parallel-Rank)
        else:
            loads, active = dp_loads(controller)
            namespace = router.namespace(req)
            tokens = req.input_ids if namespace is not None else ()  # None: it cannot relay
            rank = router.route(tokens, getattr(req, "routing_key", None), loads, active, namespace)
            if rank is not None:
                req.routed_dp_rank = rank
            decision = router.last_decision
            if sum(router.decisions.values()) % 256 == 1:
                logger.info("sglang-relay DP routing: %s", router.stats())
        tag_dp_route(req, decision)  # counted by the rank (get_server_info, metrics)
    except Exception as exc:  # noqa: BLE001 - the controller must keep serving
        if getattr(req, "routed_dp_rank", None) != given:
            req.routed_dp_rank = given
        router._decided("fallback_error", None)
        kind = type(exc).__name__
        if kind not in router.errors_seen:
            router.errors_seen.add(kind)
            logger.warning(
                "sglang-relay DP routing failed for a %s (%s); SGLang's load-balance method "
                "routes it (counted as routed_fallback_error)",
                type(req).__name__,
                kind,
                exc_info=True,
            )
