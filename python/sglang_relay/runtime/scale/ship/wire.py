"""The messages span shipping exchanges, and their checks: everything a peer sends is
treated as hostile until it passed them (a JSON header of known fields and bounded sizes,
then raw tensor frames of the announced dtype and shape; never pickle).

* ``hello`` (publisher -> receiver, once per connection): the publisher's name, its
  transfer session, its staging region's base address and size
  (:class:`~.staging.Staging`: the only memory it exposes to the transfer engine), and its
  :class:`~.pages.Geometry`, with a fresh nonce and its clock, signed with the
  publisher's own key (:func:`publisher_key`: the deployment secret bound to its name,
  an HMAC over the header and the frames' digests: no key crosses the network). A
  receiver derives that key from its secret and the claimed name, so a publisher cannot
  sign as another; it refuses a wrong signature, a clock outside :data:`HELLO_WINDOW_S`
  of its own, or a nonce it has seen (a replayed hello).
* ``offer`` (publisher -> receiver, per recorded span): the span (tokens, first position,
  namespace, where its answer starts), its slots and token offsets in the publisher's
  staging region, the digest of those pages, and its side rows as frames (which rows came
  with a stored hidden state, the hidden rows, influence scores, context masses); signed
  with the connection's key (:func:`session_key`: the publisher's key and the hello's
  nonce) and numbered: an offer forged without the key, or replayed (a number not above
  the last), is dropped. The namespace it carries is advice: the receiver files the span
  where its own configuration maps the publisher (:func:`.peers.filed_namespace`).
* ``ack`` / ``refuse`` (receiver -> publisher): the span was taken (or not), so its
  staging pages are free; a hello was refused, with the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

import torch

from sglang_relay.runtime.config.settings import ship_name_ok

VERSION = 2
HELLO_WINDOW_S = 300  # a hello's clock may differ from the receiver's by this much
MAX_HEADER_BYTES = 4 << 20
MAX_SPAN_TOKENS = 1 << 17
MAX_SESSION = 256
MAX_NAMESPACE_ITEM = 1024
DTYPES = {"bool": torch.bool, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}  # fmt: skip
SIDE = ("has_hidden", "hidden", "influence", "context")


class BadMessage(ValueError):
    """A peer's message failed a check; it is dropped (and counted)."""


def _int(d: dict, key: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise BadMessage(f"{key}: an integer in [{lo}, {hi}] expected")
    return v


def _str(d: dict, key: str, limit: int = MAX_SESSION) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > limit:
        raise BadMessage(f"{key}: a string of at most {limit} characters expected")
    return v


def _ints(d: dict, key: str, n: int, lo: int, hi: int) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) != n:
        raise BadMessage(f"{key}: a list of {n} integers expected")
    if not all(type(x) is int and lo <= x < hi for x in v):
        raise BadMessage(f"{key}: integers in [{lo}, {hi}) expected")
    return v


def encode(header: dict[str, Any], frames: list[bytes] = ()) -> list[bytes]:
    return [json.dumps({"v": VERSION, **header}).encode(), *frames]


def decode(parts: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    if not parts or len(parts[0]) > MAX_HEADER_BYTES:
        raise BadMessage("no header, or a header over the size limit")
    try:
        header = json.loads(parts[0])
    except Exception as exc:  # noqa: BLE001 - not JSON, or nested past the recursion limit
        raise BadMessage(f"header is not JSON ({type(exc).__name__})") from exc
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise BadMessage(f"header of protocol version {VERSION} expected")
    if header.get("kind") not in ("hello", "offer", "ack", "refuse"):
        raise BadMessage("unknown message kind")
    return header, list(parts[1:])


# ---- signatures ------------------------------------------------------------------------------
def sign(key: bytes, header: dict[str, Any], frames: list[bytes] = ()) -> str:
    """HMAC-SHA256 (hex) with ``key`` over ``header`` (canonical JSON, without ``mac``)
    and the SHA-256 of each frame, in order."""
    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True)
    mac = hmac.new(key, body.encode(), hashlib.sha256)
    for frame in frames:
        mac.update(hashlib.sha256(frame).digest())
    return mac.hexdigest()


def signed(key: bytes, header: dict[str, Any], frames: list[bytes] = ()) -> list[bytes]:
    header = {"v": VERSION, **header}
    return encode({**header, "mac": sign(key, header, frames)}, frames)


def verified(key: bytes, header: dict[str, Any], frames: list[bytes] = ()) -> bool:
    mac = header.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(mac, sign(key, header, frames))


def publisher_key(secret: str, name: str) -> bytes:
    """A publisher's own signing key: the deployment ``secret`` (which receivers hold)
    bound to the publisher's ``name``. A publisher holds only this key
    (``SGLANG_RELAY_SHIP_KEY``, printed by ``sglang-relay ship-key``), so it can sign as
    no other publisher."""
    return hmac.new(secret.encode(), b"sglang-relay ship publisher " + name.encode(),
                    hashlib.sha256).digest()  # fmt: skip


def session_key(key: bytes, nonce: str) -> bytes:
    """The key a connection's offers are signed with: the publisher's ``key`` bound to its
    hello's nonce (an offer of one connection does not verify on another)."""
    return hmac.new(key, b"sglang-relay ship session " + nonce.encode(),
                    hashlib.sha256).digest()  # fmt: skip


def check_name(name: str) -> str:
    """A publisher name (:func:`~sglang_relay.runtime.config.settings.ship_name_ok`: 1-64
    letters, digits, ``.``, ``_``, ``-``); ValueError otherwise."""
    if not ship_name_ok(name):
        raise ValueError(f"a ship publisher name is 1-64 letters, digits, dots, _ or -: {name!r}")
    return name


# ---- hello -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    name: str
    session: str
    base: int
    size: int
    geometry: dict[str, Any]
    nonce: str
    time: int
    key: bytes  # the publisher's key (:func:`publisher_key`), as the receiver derived it


def hello(name: str, session: str, base: int, size: int, geometry: dict[str, Any], key: bytes,
          nonce: str, now: float) -> list[bytes]:  # fmt: skip
    """Publisher ``name``'s hello, signed with its ``key`` (:func:`publisher_key`; of the
    empty secret when none is set: integrity only, which a receiver accepts on loopback
    alone, :mod:`sglang_relay.runtime.config.settings`)."""
    return signed(key, {"kind": "hello", "name": name, "session": session, "base": base,
                        "size": size, "geometry": geometry, "nonce": nonce,
                        "time": int(now)})  # fmt: skip


def hello_refusal(hello: Hello, geometry: dict[str, Any]) -> str | None:
    """Why a receiver of ``geometry`` refuses a publisher's (authenticated) hello, else
    None: pools whose pages are not each other's KV (layout, shape, dtype, page size,
    stored hidden rows, model)."""
    diff = sorted(k for k in geometry if hello.geometry.get(k) != geometry[k])
    diff += sorted(k for k in hello.geometry if k not in geometry)
    return f"geometry differs in {', '.join(diff)}" if diff else None


def read_hello(header: dict[str, Any], secret: str, now: float, seen: dict[str, float]) -> Hello:
    """The hello in ``header``, authenticated: signed with the key ``secret`` gives the
    name it claims, its clock within :data:`HELLO_WINDOW_S` of ``now``, its nonce not in
    ``seen`` (nonce -> when seen, kept by the receiver for the window; this hello's is
    added). BadMessage otherwise."""
    try:
        name = check_name(header.get("name"))
    except ValueError as exc:
        raise BadMessage(f"hello: {exc}") from None
    key = publisher_key(secret, name)
    if not verified(key, header):
        raise BadMessage(
            f"hello: not signed with publisher {name}'s key under this receiver's secret "
            "(SGLANG_RELAY_SHIP_SECRET; the publisher's SGLANG_RELAY_SHIP_KEY)"
        )
    geometry = header.get("geometry")
    if not isinstance(geometry, dict) or len(json.dumps(geometry)) > 4096:
        raise BadMessage("geometry: a small object expected")
    session = _str(header, "session")
    host, sep, port = session.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise BadMessage("session: HOST:PORT expected")
    nonce = _str(header, "nonce", 64)
    sent = _int(header, "time", 0, 1 << 40)
    if abs(sent - now) > HELLO_WINDOW_S:
        raise BadMessage(f"hello: its clock is {int(sent - now)} s from the receiver's")
    for old in [n for n, t in seen.items() if t < now - 2 * HELLO_WINDOW_S]:
        del seen[old]
    if len(nonce) < 16 or nonce in seen:
        raise BadMessage("hello: a nonce seen before (a replayed hello)")
    seen[nonce] = now
    return Hello(
        name=name,
        session=session,
        base=_int(header, "base", 1, (1 << 64) - 1),
        size=_int(header, "size", 1, 1 << 40),
        geometry=geometry,
        nonce=nonce,
        time=sent,
        key=key,
    )


# ---- offer -------------------------------------------------------------------------------
@dataclass(slots=True)
class Offer:
    span: int  # the publisher's span id
    tokens: list[int]
    start: int  # position of the first token
    namespace: tuple
    answer_start: int
    host_idx: list[int]  # publisher's host slots (whole pages, in page order)
    offsets: list[int]  # token j sits at host_idx[offsets[j]]
    digest: str
    side: dict[str, torch.Tensor]  # SIDE names present


def offer(key: bytes, seq: int, span: int, tokens: list[int], start: int, namespace: tuple,
          answer_start: int, host_idx: list[int], offsets: list[int], digest: str,
          side: dict[str, torch.Tensor | None]) -> list[bytes]:  # fmt: skip
    """Offer number ``seq`` of a connection, signed with its ``key`` (:func:`session_key`)."""
    frames, shapes = [], {}
    for name in SIDE:
        t = side.get(name)
        if t is None:
            continue
        t = t.detach().to("cpu").contiguous()
        shapes[name] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
        frames.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    header = {
        "kind": "offer", "seq": seq, "span": span, "tokens": tokens, "start": start,
        "namespace": list(namespace), "answer_start": answer_start, "host_idx": host_idx,
        "offsets": offsets, "digest": digest, "side": shapes,
    }  # fmt: skip
    return signed(key, header, frames)


def read_offer(
    header: dict[str, Any], frames: list[bytes], *, key: bytes, last_seq: int, vocab: int,
    max_position: int, hidden: int,
) -> tuple[int, Offer]:  # fmt: skip
    """``(seq, offer)`` in ``header`` + ``frames``: signed with the connection's ``key``,
    numbered above ``last_seq``, and checked against the receiver's model (token ids below
    ``vocab``, positions below ``max_position``, hidden rows ``hidden`` wide)."""
    if not verified(key, header, frames):
        raise BadMessage("offer: not signed with this connection's key (forged or altered)")
    seq = _int(header, "seq", 0, 1 << 62)
    if seq <= last_seq:
        raise BadMessage(f"offer: number {seq} not above {last_seq} (replayed)")
    tokens_field = header.get("tokens")
    n = len(tokens_field) if isinstance(tokens_field, list) else 0
    if not 1 <= n <= MAX_SPAN_TOKENS:
        raise BadMessage(f"tokens: 1 to {MAX_SPAN_TOKENS} expected")
    tokens = _ints(header, "tokens", n, 0, vocab)
    start = _int(header, "start", 0, max(0, max_position - n))
    answer_start = _int(header, "answer_start", 0, n)
    host_field = header.get("host_idx")
    pages = len(host_field) if isinstance(host_field, list) else 0
    if not n <= pages <= 2 * n + 4096:
        raise BadMessage("host_idx: the span's whole pages expected")
    host_idx = _ints(header, "host_idx", pages, 0, 1 << 40)
    offsets = _ints(header, "offsets", n, 0, pages)
    ns = header.get("namespace")
    if not isinstance(ns, list) or len(ns) > 8:
        raise BadMessage("namespace: a short list expected")
    ns = [_namespace_item(item) for item in ns]
    digest = _str(header, "digest", 64)
    shapes = header.get("side")
    if not isinstance(shapes, dict) or not set(shapes) <= set(SIDE):
        raise BadMessage("side: known side rows expected")
    if len(frames) != len(shapes):
        raise BadMessage("one frame per side row expected")
    side = {}
    for name, frame in zip([s for s in SIDE if s in shapes], frames, strict=True):
        side[name] = _tensor(name, shapes[name], frame, n, hidden)
    if "has_hidden" not in side:
        raise BadMessage("has_hidden: expected")
    return seq, Offer(header["span"] if type(header.get("span")) is int else -1, tokens,
                      start, tuple(ns), answer_start, host_idx, offsets, digest, side)  # fmt: skip


def _namespace_item(item: Any) -> Any:
    """A namespace item as sent: a string, an integer, null, or a tenant pair (a header
    scope's ``("tenant", name)``, a list on the wire) read back as the tuple it was."""
    if item is None or type(item) is int:
        return item
    if isinstance(item, str) and len(item) <= MAX_NAMESPACE_ITEM:
        return item
    if (isinstance(item, list) and len(item) == 2 and item[0] == "tenant"
            and isinstance(item[1], str) and 0 < len(item[1]) <= MAX_NAMESPACE_ITEM):  # fmt: skip
        return ("tenant", item[1])
    raise BadMessage("namespace: strings, integers, nulls or tenant pairs expected")


def _tensor(name: str, spec: Any, frame: bytes, n: int, hidden: int) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES):
        raise BadMessage(f"{name}: [dtype, shape] expected")
    dtype, shape = DTYPES[spec[0]], spec[1]
    want = {"has_hidden": [n], "hidden": [n, hidden], "influence": [n], "context": [n]}[name]
    if shape != want:
        raise BadMessage(f"{name}: shape {want} expected, got {shape}")
    if name == "has_hidden" and dtype is not torch.bool:
        raise BadMessage("has_hidden: bool expected")
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    if len(frame) != count * itemsize:
        raise BadMessage(f"{name}: {count * itemsize} bytes expected, got {len(frame)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    if dtype is torch.bool:  # any byte: a bool is 0 or 1
        return (raw != 0).reshape(shape)
    return raw.view(dtype).reshape(shape)


def ack(span: int, ok: bool, why: str = "") -> list[bytes]:
    return encode({"kind": "ack", "span": span, "ok": ok, "why": why[:200]})


def refuse(why: str, *, resend_hello: bool = False) -> list[bytes]:
    """A receiver refuses a publisher (``resend_hello``: it does not know this connection,
    e.g. after its restart: the publisher should say hello again)."""
    return encode({"kind": "refuse", "why": why[:500], "resend_hello": resend_hello})
