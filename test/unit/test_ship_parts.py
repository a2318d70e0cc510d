"""Span shipping's pieces without servers (runtime/scale/ship): the byte ranges a transfer
engine moves between two of SGLang's real host pools, checked by copying them with a
plain ``memmove`` against torch indexing of the same pools; and the offer checks, which
must refuse every malformed or hostile field before anything is allocated or moved.
(Two servers shipping over Mooncake: test/e2e/test_ship.py.)"""

from __future__ import annotations

import ctypes
import json
import secrets

import pytest
import torch
from kv_pools import cpu_kv_pools

from sglang_relay.runtime.cache.host_rows import digest
from sglang_relay.runtime.scale.ship import wire
from sglang_relay.runtime.scale.ship.pages import PoolAddress, paired_runs, transfer_lists


def test_paired_runs_are_the_runs_consecutive_on_both_sides():
    a = torch.tensor([4, 5, 6, 9, 10, 11, 12])
    b = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    assert paired_runs(a, b) == [(4, 0, 3), (9, 3, 1), (10, 7, 3)]


def _rows(host, idx: torch.Tensor) -> torch.Tensor:
    """[2, L, n, H, D]: the KV of host slots ``idx`` (plain indexing of the pool buffer)."""
    buf = host.kv_buffer
    return buf[:, :, idx] if host.layout == "layer_first" else buf[:, idx].transpose(1, 2)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_transfer_lists_move_exactly_the_span_rows(layout):
    src = cpu_kv_pools(slots=64, layers=3, seed=1, host_tokens=64, layout=layout).host
    dst = cpu_kv_pools(slots=64, layers=3, seed=2, host_tokens=64, layout=layout).host
    gen = torch.Generator().manual_seed(3)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=gen))
    dst.kv_buffer.copy_(torch.randn(dst.kv_buffer.shape, generator=gen))
    before = dst.kv_buffer.clone()
    remote = torch.tensor([8, 9, 10, 11, 40, 41, 42, 43, 17])
    local = torch.tensor([0, 1, 2, 20, 21, 22, 23, 24, 63])
    lp, rp, ln = transfer_lists(PoolAddress.of(dst), local, PoolAddress.of(src), remote)
    assert len(ln) < 2 * 3 * len(local)  # runs, not rows
    for to, frm, n in zip(lp, rp, ln, strict=True):  # what the engine does, by hand
        ctypes.memmove(to, frm, n)
    assert torch.equal(_rows(dst, local), _rows(src, remote))
    untouched = torch.ones(dst.size, dtype=torch.bool)
    untouched[local] = False
    assert torch.equal(_rows(dst, untouched.nonzero()[:, 0]), _rows_of(before, dst, untouched))
    assert digest(dst, local) == digest(src, remote)
    assert digest(dst, local) != digest(src, remote.flip(0))
    with pytest.raises(ValueError):
        PoolAddress.of(src).ranges(60, 8)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_staging_holds_a_host_pools_rows_in_whole_pages(layout):
    """A page-4 staging region of a host pool (either layout) takes rows in and gives them
    back exactly (checked by indexing the pools' buffers), hands out aligned whole pages,
    and keeps quarantined pages out of use until their time."""
    from sglang_relay.runtime.scale.ship.staging import Staging

    host = cpu_kv_pools(slots=64, layers=3, seed=1, host_tokens=64, layout=layout).host
    host.kv_buffer.copy_(
        torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(5))
    )
    clock = [0.0]
    staging = Staging(host, tokens=10, page_size=4, clock=lambda: clock[0])
    assert staging.size == 12 and staging.available() == 12  # rounded up to pages
    with pytest.raises(ValueError):
        staging.alloc(6)
    a = staging.alloc(8)
    assert a.view(-1, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and staging.alloc(8) is None
    rows = torch.tensor([33, 34, 35, 36, 2, 3, 4, 5])
    staging.take(host, rows, a)
    assert torch.equal(staging.kv_buffer[:, :, a], _rows(host, rows))
    back = torch.tensor([50, 51, 52, 53, 60, 61, 62, 63])
    staging.give(a, host, back)
    assert torch.equal(_rows(host, back), _rows(host, rows))
    assert digest(staging, a) == digest(host, rows)
    staging.quarantine(a[:4], 120.0)
    staging.free(a[4:])
    assert staging.available() == 8
    clock[0] += 121
    assert staging.available() == 12


def _rows_of(buf: torch.Tensor, host, mask: torch.Tensor) -> torch.Tensor:
    idx = mask.nonzero()[:, 0]
    return buf[:, :, idx] if host.layout == "layer_first" else buf[:, idx].transpose(1, 2)


N, HIDDEN, VOCAB = 40, 6, 1000


def _offer(**change) -> tuple[dict, list[bytes]]:
    side = {
        "has_hidden": torch.ones(N, dtype=torch.bool),
        "hidden": torch.randn(N, HIDDEN),
        "influence": None,
        "context": torch.rand(N),
    }
    args = dict(span=3, tokens=list(range(100, 100 + N)), start=50, namespace=(None,) * 4,
                answer_start=0, host_idx=list(range(N)), offsets=list(range(N)),
                digest="ab" * 16, side=side)  # fmt: skip
    header, frames = wire.decode(wire.offer(KEY, 1, **args))
    header.update(change)
    header["mac"] = wire.sign(KEY, header, frames)  # a publisher that holds the secret
    return header, frames


KEY = wire.session_key(wire.publisher_key("s", "p"), "n" * 32)


def _read(header, frames, key=KEY, last_seq=0):
    return wire.read_offer(header, frames, key=key, last_seq=last_seq, vocab=VOCAB,
                           max_position=4096, hidden=HIDDEN)[1]  # fmt: skip


def test_a_well_formed_offer_reads_back_as_sent():
    header, frames = _offer()
    offer = _read(header, frames)
    assert offer.tokens == list(range(100, 100 + N)) and offer.start == 50
    assert offer.namespace == (None, None, None, None)
    assert offer.side["hidden"].shape == (N, HIDDEN) and offer.side["has_hidden"].all()
    assert set(offer.side) == {"has_hidden", "hidden", "context"}
    tenant = [None, None, None, ["tenant", "acme"], "k"]  # a header scope's, as JSON sends it
    assert _read(*_offer(namespace=tenant)).namespace == (None, None, None, ("tenant", "acme"), "k")


def test_a_receiver_files_spans_by_its_own_map_of_the_publisher():
    from sglang_relay.runtime.scale.ship.peers import filed_namespace

    plain, acme = ("e", 1, "salt", "k"), ("e", 1, "salt", ("tenant", "acme"), "k")
    assert filed_namespace("*", plain) == plain and filed_namespace("*", acme) == acme
    assert filed_namespace("acme", plain) == acme  # filed under the mapped tenant
    assert filed_namespace("acme", acme) == acme
    assert filed_namespace("acme", ("e", 1, "salt", ("tenant", "victim"), "k")) is None
    assert filed_namespace("acme", (("tenant", "acme"), ("tenant", "acme"), "k")) is None


HOSTILE = [
    {"tokens": list(range(VOCAB - 10, VOCAB + 30))},  # ids beyond the vocabulary
    {"tokens": [1.5] * N},
    {"tokens": []},
    {"start": -1},
    {"start": 4096},  # positions beyond the model's context
    {"answer_start": N + 1},
    {"offsets": [N + 5] * N},  # past the span's host pages
    {"offsets": list(range(N - 1))},
    {"host_idx": [-1] * N},
    {"host_idx": list(range(10))},  # fewer slots than tokens
    {"namespace": [{"a": 1}]},
    {"namespace": ["x" * 5000]},
    {"namespace": [None, None, None, ["tenant", 5], None]},
    {"namespace": [None, None, None, ["admin", "x"], None]},
    {"namespace": [None, None, None, ["tenant", "a", "b"], None]},
    {"digest": 7},
    {"side": {"hidden": ["float32", [N, HIDDEN]]}},  # no has_hidden, frame count off
    {
        "side": {
            "has_hidden": ["bool", [N]],
            "hidden": ["float32", [N, HIDDEN + 1]],
            "context": ["float32", [N]],
        }
    },  # fmt: skip
    {
        "side": {
            "has_hidden": ["int64", [N]],
            "hidden": ["float32", [N, HIDDEN]],
            "context": ["float32", [N]],
        }
    },  # fmt: skip
    {
        "side": {
            "has_hidden": ["bool", [N]],
            "hidden": ["object", [N, HIDDEN]],
            "context": ["float32", [N]],
        }
    },  # fmt: skip
]


@pytest.mark.parametrize("change", HOSTILE, ids=lambda c: next(iter(c)))
def test_a_hostile_offer_is_refused(change):
    header, frames = _offer(**change)
    with pytest.raises(wire.BadMessage):
        _read(header, frames)


def test_truncated_frames_and_foreign_headers_are_refused():
    header, frames = _offer()
    with pytest.raises(wire.BadMessage):
        _read(header, [frames[0], frames[1][:-4], frames[2]])
    for raw in (b"\x80\x04pickle", b"[]", json.dumps({"v": 1, "kind": "offer"}).encode(),
                json.dumps({"v": 2, "kind": "exec"}).encode(), b""):  # fmt: skip
        with pytest.raises(wire.BadMessage):
            wire.decode([raw])
    with pytest.raises(wire.BadMessage):
        wire.read_hello({"session": "x" * 1000, "base": 1, "size": 1, "geometry": {}}, "", 0, {})


def test_a_forged_altered_or_replayed_offer_is_refused():
    """Offers are signed with the connection's key (the secret bound to its hello's nonce)
    and numbered: one altered after signing, signed without the secret or for another
    connection, or numbered at or below the last taken, is dropped."""
    header, frames = _offer()
    assert _read(header, frames).tokens == list(range(100, 100 + N))
    forged = {**header, "namespace": ["victim-tenant", None, None, None]}  # mac kept
    guess = wire.session_key(wire.publisher_key("guess", "p"), "n" * 32)
    other = {**header, "mac": wire.sign(guess, header, frames)}
    reconnect = wire.session_key(wire.publisher_key("s", "p"), "m" * 32)  # another connection
    for bad, key in ((forged, KEY), (other, KEY), (header, reconnect)):
        with pytest.raises(wire.BadMessage, match="not signed"):
            _read(bad, frames, key=key)
    with pytest.raises(wire.BadMessage, match="not signed"):  # a frame altered in flight
        _read(header, [frames[0], bytes(len(frames[1])), frames[2]])
    with pytest.raises(wire.BadMessage, match="replayed"):
        _read(header, frames, last_seq=1)


def test_ship_settings_take_one_role_and_host_port_addresses():
    from sglang_relay.runtime.config.settings import settings_from_env

    pub = {"SGLANG_RELAY_SHIP_TO": "a:1,b:2", "SGLANG_RELAY_SHIP_NAME": "decode-0"}
    got = settings_from_env("", pub)
    assert got.ship_to == ("a:1", "b:2") and got.ship_name == "decode-0" and not got.ship_key
    maps = {"SGLANG_RELAY_SHIP_PUBLISHERS": "decode-0=*,decode-1=*"}
    listen = {"SGLANG_RELAY_SHIP_LISTEN": "h:9", "SGLANG_RELAY_SHIP_SECRET": "s", **maps}
    got = settings_from_env("", listen)
    assert got.ship_role == "receiver"
    assert got.ship_publishers == (("decode-0", "*"), ("decode-1", "*"))
    local = {"SGLANG_RELAY_SHIP_LISTEN": "127.0.0.1:9", **maps}  # loopback: secret optional
    assert settings_from_env("", local).ship_role == "receiver"
    with pytest.raises(ValueError, match="beyond loopback without SGLANG_RELAY_SHIP_SECRET"):
        settings_from_env("", {"SGLANG_RELAY_SHIP_LISTEN": "0.0.0.0:9", **maps})
    tenant = {**listen, "SGLANG_RELAY_SHIP_PUBLISHERS": "decode-0=acme"}
    with pytest.raises(ValueError, match="needs a tenant scope"):
        settings_from_env("", tenant)
    scoped = settings_from_env("", {**tenant, "SGLANG_RELAY_SCOPE": "header:X-Tenant"})
    assert scoped.ship_publishers == (("decode-0", "acme"),)
    assert settings_from_env("", {}).ship_role is None
    for bad, named in (
        ({"SGLANG_RELAY_SHIP_TO": "nohost"}, "HOST:PORT"),
        ({"SGLANG_RELAY_SHIP_LISTEN": "h:99999", **maps}, "HOST:PORT"),
        ({**pub, "SGLANG_RELAY_SHIP_LISTEN": "h:2"}, "two roles"),
        ({**pub, "SGLANG_RELAY_SHIP_PROTOCOL": "udp"}, "PROTOCOL"),
        ({**pub, "SGLANG_RELAY_SHIP_LEASE": "0"}, "LEASE"),
        ({"SGLANG_RELAY_SHIP_TO": "a:1"}, "--relay-ship-name"),  # a publisher is named
        ({**pub, "SGLANG_RELAY_SHIP_SECRET": "s"}, "ship-key"),  # never the secret
        ({**pub, "SGLANG_RELAY_SHIP_KEY": "zz"}, "64 hex"),
        ({"SGLANG_RELAY_SHIP_LISTEN": "127.0.0.1:9"}, "--relay-ship-publishers"),
        ({**local, "SGLANG_RELAY_SHIP_PUBLISHERS": "decode-0"}, "--relay-ship-publishers"),
        ({**local, "SGLANG_RELAY_SHIP_PUBLISHERS": "a=*,a=*"}, "--relay-ship-publishers"),
    ):
        with pytest.raises(ValueError, match=named):
            settings_from_env("", bad)


@pytest.mark.parametrize(
    "view, role, named",
    [
        (dict(disaggregation_mode="decode"), None, "--relay-ship-to"),
        (dict(disaggregation_mode="prefill"), None, "--relay-ship-listen"),
        (dict(disaggregation_mode="prefill"), "publisher", "--relay-ship-listen"),
        (
            dict(disaggregation_mode="decode", disable_radix_cache=True),
            "publisher",
            "--disaggregation-decode-enable-radix-cache",
        ),  # fmt: skip
        (dict(tp_size=2), "receiver", "--tp-size 1"),
        (dict(enable_lora=True, lora_backend="torch_native"), "publisher", "LoRA"),
    ],
)
def test_pd_servers_are_served_only_with_span_shipping(view, role, named):
    from sglang_relay.runtime.config import modes

    message = modes.refusal(modes.ServerView(**view), ship_role=role)
    assert message is not None and named in message, message


def test_shipping_servers_of_the_right_role_are_served():
    from sglang_relay.runtime.config import modes

    for view, role in (
        (dict(disaggregation_mode="decode"), "publisher"),
        (dict(disaggregation_mode="prefill"), "receiver"),
        ({}, "publisher"),
        ({}, "receiver"),
    ):
        assert modes.refusal(modes.ServerView(**view), ship_role=role) is None, view


def test_a_publisher_of_other_pools_or_without_the_secret_is_refused():
    geometry = {"layout": "layer_first", "layer_num": 30, "head_num": 3, "head_dim": 64,
                "dtype": "torch.bfloat16", "page_size": 1, "hidden": 576,
                "hidden_dtype": "torch.bfloat16", "model": "m"}  # fmt: skip

    seen: dict[str, float] = {}
    now = 1_800_000_000.0

    def hello(
        secret="correct horse", mine="correct horse", nonce=None, sent=now, name="decode-0",
        signer=None, **change,
    ) -> wire.Hello:  # fmt: skip
        nonce = nonce or secrets.token_hex(16)
        key = wire.publisher_key(secret, signer or name)
        message = wire.hello(name, "h:1", 4096, 64, {**geometry, **change}, key, nonce, sent)
        header, _ = wire.decode(message)
        text = json.dumps(header)
        assert (secret == "" or secret not in text) and key.hex() not in text  # never sent
        return wire.read_hello(header, mine, now, seen)

    assert wire.hello_refusal(hello(), geometry) is None
    assert hello().key == wire.publisher_key("correct horse", "decode-0")
    assert wire.hello_refusal(hello(secret="", mine=""), geometry) is None  # loopback
    for change in (dict(secret="wrong battery"), dict(secret=""), dict(signer="decode-1")):
        # a wrong secret, none where the receiver has one, another publisher's key
        with pytest.raises(wire.BadMessage, match="not signed with publisher decode-0's key"):
            hello(**change)
    from sglang_relay.runtime.config.settings import settings_from_env

    for name in ("", "a b", "x" * 65, "../etc", "d\u0661", "decode-0\nx"):
        with pytest.raises(wire.BadMessage, match="publisher name"):
            hello(name=name)
        named = {"SGLANG_RELAY_SHIP_TO": "a:1", "SGLANG_RELAY_SHIP_NAME": name}
        with pytest.raises(ValueError, match="--relay-ship-name"):  # the settings' one rule
            settings_from_env("", named)
    with pytest.raises(wire.BadMessage, match="clock"):  # outside the replay window
        hello(sent=now - 2 * wire.HELLO_WINDOW_S)
    hello(nonce="a" * 32)
    with pytest.raises(wire.BadMessage, match="replayed"):  # the same hello again
        hello(nonce="a" * 32)
    for change in ({"page_size": 16}, {"model": "other"}, {"dtype": "torch.float32"},
                   {"hidden": 0}, {"layout": "page_first"}, {"extra": 1}):  # fmt: skip
        why = wire.hello_refusal(hello(**change), geometry)
        assert why is not None and next(iter(change)) in why, why


def test_ship_key_prints_the_key_a_receiver_derives_for_the_name(monkeypatch, capsys):
    import hashlib
    import hmac

    from sglang_relay.cli import main

    monkeypatch.setenv("SGLANG_RELAY_SHIP_SECRET", "deployment secret")
    assert main(["ship-key", "--name", "decode-0"]) == 0
    printed = capsys.readouterr().out.strip()
    want = hmac.new(b"deployment secret", b"sglang-relay ship publisher decode-0", hashlib.sha256)
    assert printed == want.hexdigest()
    assert main(["ship-key", "--name", "bad name"]) == 1
    monkeypatch.delenv("SGLANG_RELAY_SHIP_SECRET")
    assert main(["ship-key", "--name", "decode-0"]) == 1
