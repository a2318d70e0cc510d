"""The fingerprints a data-parallel rank publishes of the spans it stores, and the routing
rules the controller applies to them (:mod:`.dp_routing`): 32-token window hashes salted
with the span's namespace, the messages a rank sends over its ``SOCK_SEQPACKET`` socket,
which rank a prompt's matched windows favour. Pure functions and the publisher;
``research/studies/scale_sim.py`` simulates policies with the rules."""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from sglang_relay.core.fingerprints import (  # noqa: F401 - this module's names too
    STRIDE,
    WINDOW,
    namespace_salt,
    span_fingerprints,
    window_hashes,
)

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "SGLANG_RELAY_DP_ENDPOINT"


def covered_tokens(starts: Sequence[int]) -> int:
    """Tokens covered by ``WINDOW``-token windows starting at ``starts`` (ascending)."""
    if not len(starts):
        return 0
    gaps = np.diff(np.asarray(starts, dtype=np.int64))
    return int(np.minimum(gaps, WINDOW).sum()) + WINDOW


# ---- the routing rules (pure; research/studies/scale_sim.py simulates policies with them) ----
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


def dp_publisher() -> FingerprintPublisher | None:
    """This rank's fingerprint publisher when a DP controller routes by spans (its endpoint
    is in the environment); TP rank 0 of each DP rank speaks for the rank."""
    import os

    from sglang_relay.runtime.sglang.scheduling import dp_rank

    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    dp, tp = dp_rank()
    return FingerprintPublisher(endpoint, dp) if tp == 0 else None
