"""The request trust boundary (runtime/sched/trust.py) and the scheduler's defensive reads of
relay's private keys; the served behaviour is in test/e2e/test_trust.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_relay.runtime.config.settings import settings_from_env
from sglang_relay.runtime.metrics import MAX_EVENTS, OVERFLOW_EVENT, RelayCounters
from sglang_relay.runtime.sched import trust
from sglang_relay.runtime.sched.guard import redo_request
from sglang_relay.runtime.sched.options import TENANT_KEY
from sglang_relay.runtime.sglang.scheduling import DP_ROUTE_KEY, GUARD_KEY, dp_route, guard_redo_of
from sglang_relay.runtime.state import STATE


class Req:  # a request object as SGLang builds it: fields only
    def __init__(self, sampling_params=None, text="p", input_ids=None, rid="r1"):
        self.sampling_params = sampling_params
        self.text = text
        self.input_ids = input_ids
        self.rid = rid


@pytest.fixture(scope="module")
def validator(model_dir):
    return trust.RequestValidator(settings_from_env(str(model_dir), {}), 30, 49152)


def test_private_keys_are_removed_from_client_requests(validator):
    params = {
        "max_new_tokens": 4,
        "custom_params": {
            GUARD_KEY: {"reused_tokens": "x"},
            DP_ROUTE_KEY: "zzz",
            "__sglang_relay_anything": 1,
            "mine": 2,
        },
    }
    obj = Req(params)
    validator.admit(obj)
    assert obj.sampling_params["custom_params"] == {"mine": 2}
    batch = Req([{"custom_params": {GUARD_KEY: {}}}, {"custom_params": None}])
    validator.admit(batch)
    assert batch.sampling_params[0]["custom_params"] == {}


def test_the_guards_own_redo_keeps_its_note(validator):
    first = Req({"max_new_tokens": 64, "custom_params": {"relay": "relay"}})
    out = {"meta_info": {"relay": {"reused_tokens": 7}, "prompt_tokens": 3}}
    redo = redo_request(first, out)
    validator.admit(redo)
    assert redo.sampling_params["custom_params"][GUARD_KEY] == {
        "of": "r1",
        "reused_tokens": 7,
    }
    # a look-alike built elsewhere (same fields, same rid) is not trusted
    fake = Req(dict(redo.sampling_params), rid=redo.rid)
    fake.sampling_params["custom_params"] = dict(redo.sampling_params["custom_params"])
    validator.admit(fake)
    assert GUARD_KEY not in fake.sampling_params["custom_params"]


def test_the_redo_is_one_sample():
    first = Req({"max_new_tokens": 64, "n": 3, "custom_params": {"relay": "relay"}})
    redo = redo_request(first, {"meta_info": {"relay": {"reused_tokens": 7}}})
    assert "n" not in redo.sampling_params and first.sampling_params["n"] == 3


@pytest.mark.parametrize(
    ("relay", "field"),
    [
        ("warp", "allowed: off, standard"),
        (3, "must be a method name"),
        ({"method": 3}, "custom_params.relay.method"),
        ({"reuse": 7}, "reuse target must be a number in (0, 1)"),
        ({"reuse": 0.9, "method": "epic"}, "applies to method relay"),
        ({"store": "yes"}, "custom_params.relay.store"),
        ({"key": ""}, "relay key"),
        ({"key": "k" * 300}, "relay key"),
        ({"zzz": 1}, "unknown fields zzz"),
        ({"config": {"l_start": "x"}}, "l_start must be an integer"),
        ({"config": {"nope": 1}}, "unknown relay config fields"),
        ({"config": {"l_start": 5, "l_det": 5}}, "l_start must be 0 or"),
    ],
)
def test_bad_relay_options_are_refused_naming_the_field(validator, relay, field):
    with pytest.raises(ValueError, match="sampling_params.custom_params") as exc:
        validator.admit(Req({"custom_params": {"relay": relay}}))
    assert field in str(exc.value)


@pytest.mark.parametrize(
    "relay",
    ["relay", "off", "standard", "epic", {"reuse": "speed"}, {"reuse": 0.8, "key": "k"},
     {"method": "standard", "store": True}, {"method": "relay", "config": {"first_k": 2}}],
)  # fmt: skip
def test_good_relay_options_pass(validator, relay):
    validator.admit(Req({"custom_params": {"relay": relay}}))


def test_prompts_the_scheduler_cannot_run_are_refused(validator):
    for ids in ([1, 49152], [-1], [[1, 2], [3, 10**9]], [1.5], [True]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            validator.admit(Req(input_ids=ids, text=None))
    for obj in (Req(text=""), Req(text=["a", ""]), Req(text=None, input_ids=[])):
        with pytest.raises(ValueError, match="empty"):
            validator.admit(obj)
    with pytest.raises(ValueError, match="must be an object"):
        validator.admit(Req({"custom_params": [1]}))
    validator.admit(Req(input_ids=[0, 49151], text=None))


def _req(params):
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=params))


def test_the_scheduler_ignores_private_notes_it_did_not_write():
    bad = [{"reused_tokens": "x"}, {"of": 1, "reused_tokens": 2}, {"of": "a"}, "x", 5]
    bad += [{"of": "a", "reused_tokens": -1}, {"of": "a", "reused_tokens": True}]
    for note in bad:
        assert guard_redo_of(_req({GUARD_KEY: note})) is None
    assert guard_redo_of(_req({GUARD_KEY: {"of": "a", "reused_tokens": 3}})) == {
        "of": "a",
        "reused_tokens": 3,
    }
    for route in ("zzz", 1, None, ["matched"]):
        assert dp_route(_req({DP_ROUTE_KEY: route})) is None
    assert dp_route(_req({DP_ROUTE_KEY: "matched"})) == "matched"
    assert dp_route(_req(None)) is None


def test_counters_hold_a_bounded_label_set():
    c = RelayCounters()
    c["fallbacks"] += 2
    c["Bad Label!"] += 1
    for i in range(3 * MAX_EVENTS):
        c[f"e{i}"] += 1
    assert len(c) <= MAX_EVENTS
    assert c["fallbacks"] == 2
    # admitted: e0.. while fewer than MAX_EVENTS - 1 events exist (fallbacks, the overflow)
    assert c[OVERFLOW_EVENT] == 1 + 3 * MAX_EVENTS - (MAX_EVENTS - 3)
    assert "Bad Label!" not in c


def test_an_abort_reaches_the_guards_redo(monkeypatch):
    from sglang_relay.runtime import plugin
    from sglang_relay.runtime.sched import guard

    aborted = []
    monkeypatch.setitem(STATE.live_redos, "r9", "r9" + guard.REDO_SUFFIX)
    plugin._abort_with_redo(lambda manager, rid, *a, **k: aborted.append(rid), None, "r9")
    assert aborted == ["r9", "r9" + guard.REDO_SUFFIX]
    aborted.clear()
    plugin._abort_with_redo(lambda manager, rid, *a, **k: aborted.append(rid), None, "r8")
    assert aborted == ["r8"]


# ---- scope bound to the operator's header (SGLANG_RELAY_SCOPE=header:<Name>) -------------------


def test_a_header_scope_files_the_tenant_the_operator_header_names(model_dir):
    """The tenant comes from the HTTP header alone: a client's own tenant key in the body is
    stripped with the other private keys, a request without the header (the Engine API, a
    gateway that did not set it) gets none, a batch gets it in every entry."""
    settings = settings_from_env(str(model_dir), {"SGLANG_RELAY_SCOPE": "header:X-Tenant"})
    gate = trust.RequestValidator(settings, 30, 49152)
    http = SimpleNamespace(headers={"x-tenant": "acme"})  # Starlette's headers: lower-case
    forged = Req({"custom_params": {TENANT_KEY: "victim", "relay": {"key": "k"}}})
    gate.admit(forged, http)
    assert forged.sampling_params["custom_params"] == {TENANT_KEY: "acme",
                                                       "relay": {"key": "k"}}  # fmt: skip
    bare = Req({"custom_params": {TENANT_KEY: "victim"}})
    gate.admit(bare, None)
    assert bare.sampling_params["custom_params"] == {}
    batch = Req([{"max_new_tokens": 2}, {"custom_params": None}])
    gate.admit(batch, http)
    assert [sp["custom_params"] for sp in batch.sampling_params] == [{TENANT_KEY: "acme"}] * 2
    empty = Req(None)
    gate.admit(empty, http)
    assert empty.sampling_params == {"custom_params": {TENANT_KEY: "acme"}}
    with pytest.raises(ValueError, match="x-tenant: longer than 256"):
        gate.admit(Req({}), SimpleNamespace(headers={"x-tenant": "a" * 257}))
    # the default scope files nothing, whatever the headers say
    shared = trust.RequestValidator(settings_from_env(str(model_dir), {}), 30, 49152)
    plain = Req({"custom_params": {"mine": 1}})
    shared.admit(plain, http)
    assert plain.sampling_params["custom_params"] == {"mine": 1}


def test_tenants_never_share_a_namespace_whatever_the_body_says():
    from sglang_relay.runtime.sched.options import namespace, request_tenant

    iso = (None, None, None)
    scope = "header:x-tenant"
    a = namespace(scope, iso, {"key": "k"}, "acme")
    b = namespace(scope, iso, {"key": "k"}, "globex")
    assert a != b and None not in (a, b)
    assert namespace(scope, iso, {"key": "k"}, None) is None  # no header: no spans at all
    assert namespace(scope, iso, {"key": "k1"}, "acme") != a  # keys still split a tenant
    assert namespace("shared", iso, {"key": "k"}, "acme") == namespace("shared", iso, {"key": "k"})
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={TENANT_KEY: "t"}))
    assert request_tenant(req) == "t"
    for junk in ({TENANT_KEY: ""}, {TENANT_KEY: 3}, None, "x"):
        req.sampling_params.custom_params = junk
        assert request_tenant(req) is None


def test_scope_and_meta_settings_are_checked(model_dir):
    ok = settings_from_env(str(model_dir), {"SGLANG_RELAY_SCOPE": "header:X-Tenant-Id",
                                            "SGLANG_RELAY_META": "counts"})  # fmt: skip
    assert (ok.scope, ok.meta) == ("header:X-Tenant-Id", "counts")
    for env, words in (
        ({"SGLANG_RELAY_SCOPE": "header:"}, "header:<Name>"),
        ({"SGLANG_RELAY_SCOPE": "header:a b"}, "header:<Name>"),
        ({"SGLANG_RELAY_SCOPE": "tenant"}, "header:<Name>"),
        ({"SGLANG_RELAY_META": "some"}, "full, counts, off"),
    ):
        with pytest.raises(ValueError, match=words):
            settings_from_env(str(model_dir), env)


def test_meta_shows_what_the_operator_allows():
    from sglang_relay.runtime.plugin import _show

    info = {
        "method": "relay",
        "spans_matched": 2,
        "reused_tokens": 40,
        "selected_tokens": 4,
        "reuse_rate": 0.9,
        "fallback": None,
        "probe": "last_row",
        "operating_point": {},
    }
    meta = {"relay": dict(info), "prompt_tokens": 9}
    _show(meta, "counts")
    assert meta == {"prompt_tokens": 9, "relay": {"method": "relay", "reused_tokens": 40,
                    "selected_tokens": 4, "reuse_rate": 0.9, "fallback": None}}  # fmt: skip
    _show(meta, "off")
    assert meta == {"prompt_tokens": 9}
