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
import hashlib
import logging
import os
import socket
import struct
import uuid
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sglang_relay.runtime.options import namespace, request_option
from sglang_relay.runtime.settings import ENV_LORA, ENV_SCOPE

logger = logging.getLogger(__name__)

WINDOW = 32  # tokens per fingerprint (the span store's min_span)
STRIDE = 16  # a span publishes the window at every 16th token
ENDPOINT_ENV = "SGLANG_RELAY_DP_ENDPOINT"
IMBALANCE_ENV = "SGLANG_RELAY_DP_MAX_IMBALANCE"
ROUTING_ENV = "SGLANG_RELAY_DP_ROUTING"  # 0: off (SGLang's load-balance method alone)
DEFAULT_MAX_IMBALANCE = 8
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial hash is a bijection per term


def _powers() -> np.ndarray:
    out = np.empty(WINDOW, dtype=np.uint64)
    acc = np.uint64(1)
    with np.errstate(over="ignore"):
        for i in range(WINDOW - 1, -1, -1):
            out[i] = acc
            acc = acc * _BASE
    return out


_POWERS = _powers()


def namespace_salt(namespace: Hashable) -> np.uint64:
    """A 64-bit salt per relay namespace (:func:`sglang_relay.runtime.options.namespace`:
    SGLang's ``extra_key`` and ``cache_salt`` and the relay key), mixed into every
    fingerprint: a prompt only matches the spans of its own namespace, so routing (and its
    timing) does not tell one tenant whether another holds a text. The default namespace
    (nothing set) has salt 0."""
    if namespace is None or all(part is None for part in namespace):
        return np.uint64(0)
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def window_hashes(tokens, stride: int = 1, salt: int = 0) -> np.ndarray:
    """``uint64`` hashes of the ``WINDOW``-token windows of ``tokens`` starting at every
    ``stride``-th position (none if shorter than a window), XOR ``salt`` (the namespace's);
    identical in every process."""
    ids = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    if ids.shape[0] < WINDOW:
        return np.empty(0, dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, WINDOW)[::stride]
    with np.errstate(over="ignore"):
        return (windows * _POWERS).sum(axis=1, dtype=np.uint64) ^ np.uint64(salt)


def span_fingerprints(tokens, salt: int = 0) -> np.ndarray:
    """The fingerprints a rank publishes for a stored span: the windows at every
    ``STRIDE``-th token and the span's last window (so the windows published cover every
    token of the span: a prompt that pastes it whole is credited with all of it)."""
    n = len(tokens)
    if n < WINDOW:
        return np.empty(0, dtype=np.uint64)
    hashes = window_hashes(tokens, STRIDE, salt)
    if (n - WINDOW) % STRIDE:
        hashes = np.append(hashes, window_hashes(tokens[n - WINDOW :], 1, salt))
    return hashes


def covered_tokens(starts: Sequence[int]) -> int:
    """Tokens covered by ``WINDOW``-token windows starting at ``starts`` (ascending)."""
    if not len(starts):
        return 0
    gaps = np.diff(np.asarray(starts, dtype=np.int64))
    return int(np.minimum(gaps, WINDOW).sum()) + WINDOW


# ---- the routing rules (pure; benchmark/scale_sim.py simulates policies with them) -----------
def key_worker(routing_key: str, active: Sequence[int]) -> int:
    """The rank for a routing key (a request with a key and no matched fingerprint): a
    stable hash of the key (blake2b, the same in every process) indexes the ``active`` ranks
    (non-empty), so every agent of a keyed chain meets on one rank while the active ranks
    stay the same."""
    digest = hashlib.blake2b(routing_key.encode(), digest_size=8).digest()
    return active[int.from_bytes(digest, "little") % len(active)]


def fingerprint_choice(
    held: Mapping[int, int], loads: Sequence[int], active: Iterable[int], max_imbalance: int
) -> int | None:
    """The rank for a request whose fingerprints matched: of ``held`` (rank -> prompt tokens
    it holds; non-empty, active ranks only) the rank holding the most (ties: the lower load,
    then the first in ``held``'s order), unless its load exceeds the least loaded ``active``
    rank's by more than ``max_imbalance`` (None: the load-balance method decides).
    ``loads``: running + waiting requests per rank."""
    rank = max(held, key=lambda r: (held[r], -loads[r]))
    if loads[rank] - min(loads[r] for r in active) <= max_imbalance:
        return rank
    return None


# a fingerprint message: rank (u32), op (u8: 1 add, 2 drop), span id (i64), then the
# span's window hashes as little-endian u64 (add only). Raw bytes, not pickle: the
# controller never unpickles what a socket hands it.
_HEADER = struct.Struct("<IBq")
_OPS = {"add": 1, "drop": 2}
_OP_NAMES = {v: k for k, v in _OPS.items()}


def encode_message(rank: int, op: str, span_id: int, hashes: np.ndarray | None) -> bytes:
    body = b"" if hashes is None else np.asarray(hashes, dtype="<u8").tobytes()
    return _HEADER.pack(rank, _OPS[op], span_id) + body


def decode_message(raw: bytes) -> tuple[int, str, int, np.ndarray | None]:
    """The fields of :func:`encode_message`'s bytes; ValueError when they are not one."""
    if len(raw) < _HEADER.size or (len(raw) - _HEADER.size) % 8:
        raise ValueError(f"fingerprint message of {len(raw)} bytes")
    rank, code, span_id = _HEADER.unpack_from(raw)
    op = _OP_NAMES.get(code)
    if op is None or (op == "drop" and len(raw) != _HEADER.size):
        raise ValueError(f"fingerprint message with op {code} and {len(raw)} bytes")
    hashes = np.frombuffer(raw, dtype="<u8", offset=_HEADER.size).astype(np.uint64)
    return rank, op, span_id, hashes if op == "add" else None


MAX_MESSAGE = 1 << 20  # bytes: a span of up to ~2M tokens; a longer one is not published
_SEND_BUFFER = 4 << 20  # bytes of messages in the socket (the kernel caps it at wmem_max)
MAX_PENDING = 100_000  # messages a rank keeps, in order, while its socket is full


class FingerprintPublisher:
    """The rank side: tells the controller which span fingerprints this rank holds.

    Sends never block and never raise. While the socket is full (the controller has not
    read the messages in it yet) new messages wait here, in order, and go with the next
    send: a burst of span drops is late, never lost (a lost drop would leave the controller
    routing to a span that is gone). A message beyond ``MAX_PENDING`` waiting ones, or with
    the controller gone, is counted in ``dropped``; routing then degrades to the
    load-balance method, never to a wrong relay (the rank checks its own store)."""

    def __init__(self, endpoint: str, rank: int) -> None:
        self.rank = rank
        self.sent = 0
        self.dropped = 0
        self._pending: deque[bytes] = deque()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            self._sock.connect(endpoint)
            self._sock.setblocking(False)
        except OSError as exc:
            logger.warning("sglang-relay: rank %d cannot reach the DP router at %s (%s); "
                           "its spans are not routed to", rank, endpoint, exc)  # fmt: skip
            self._sock.close()
            self._sock = None

    def _send(self, op: str, span_id: int, hashes: np.ndarray | None) -> None:
        raw = encode_message(self.rank, op, span_id, hashes)
        if self._sock is None or len(raw) >= MAX_MESSAGE or len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(raw)
        self.flush()

    def flush(self) -> None:
        """Send the waiting messages, oldest first, until the socket is full."""
        while self._pending and self._sock is not None:
            try:
                self._sock.send(self._pending[0], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return  # full: the rest waits for the next send
            except OSError:  # the controller gone (BrokenPipeError): nothing will arrive
                self.dropped += len(self._pending)
                self._pending.clear()
                return
            self._pending.popleft()
            self.sent += 1

    @property
    def waiting(self) -> int:
        """Messages waiting for room in the socket."""
        return len(self._pending)

    def added(self, span_id: int, tokens: list[int], namespace: Hashable = None) -> None:
        self._send("add", span_id, span_fingerprints(tokens, namespace_salt(namespace)))

    def dropped_span(self, span_id: int) -> None:
        self._send("drop", span_id, None)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


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

    def namespace(self, req) -> tuple | None:
        """The namespace ``req`` relays from, as its rank will compute it (None: none)."""
        from sglang_relay.runtime.sglang.scheduling import tokenized_isolation

        try:
            isolation = tokenized_isolation(req, self.lora)
            return namespace(self.scope, isolation, request_option(req))
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
_ROUTER: list[DPRouter] = []  # the controller process's router (at most one)


def before_controller_init(controller, server_args, port_args, *args, **kwargs) -> None:
    """Before the DP controller launches its ranks: bind the fingerprint socket and tell the
    ranks where it is (the environment is inherited by the spawned schedulers)."""
    from sglang_relay.runtime.backend import serves_relay

    if not serves_relay(server_args) or _ROUTER:
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
    _ROUTER.append(DPRouter(int(server_args.dp_size), endpoint, max_imbalance=imbalance))
    os.environ[ENDPOINT_ENV] = endpoint
    logger.info("sglang-relay: routing DP requests by span fingerprints (%s)", endpoint)


def route_request(original, controller, req, *args, **kwargs):
    """Around ``maybe_external_dp_rank_routing``: pick the rank holding ``req``'s spans."""
    if _ROUTER and getattr(req, "input_ids", None):
        _route(_ROUTER[0], controller, req)
    return original(controller, req, *args, **kwargs)


def _route(router: DPRouter, controller, req) -> None:
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


def blocking_event_loop(original, controller, *args, **kwargs):
    """Around the DP controller's event loop, on the CPU stand-in only: wait on the socket.

    SGLang 0.5.23's loop receives without blocking in a ``while True`` with no wait, which
    keeps one core at 100 % while the server is idle. On a GPU host that is one core of many;
    on the 2-core CPU stand-in it is half the machine, taken from the ranks pinned to those
    cores. This loop does the same work (drain every queued request, dispatch it, feed the
    soft watchdog) but sleeps in ``zmq.Poller`` until a request arrives (or a second passes,
    so the watchdog is still fed while idle). It also reads the ranks' fingerprint
    messages at least once a second while idle, so they never queue up in the ranks."""
    import zmq

    from sglang_relay.runtime.sglang.scheduling import dp_controller_receiver

    sock, recv, dispatch, feed = dp_controller_receiver(controller)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        feed()
        if _ROUTER:
            _ROUTER[0].drain()
        if not poller.poll(timeout=1000):
            continue
        while True:
            try:
                message = recv()
            except zmq.ZMQError:
                break
            dispatch(message)
            feed()
