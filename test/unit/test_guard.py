"""The early-stop guard's decisions (runtime/sched/guard.py); the served behaviour is in
test/e2e/test_relay.py (``-k guard``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_relay.launch import check_relay_settings, split_relay_flags
from sglang_relay.runtime.sched.guard import (
    GuardPolicy,
    eligible,
    guard_policy,
    redo_request,
    standard_option,
    stop_reason,
)
from sglang_relay.runtime.sched.options import stores_spans
from sglang_relay.runtime.sglang.scheduling import GUARD_KEY, guard_redo_of


def response(n=2, finish="stop", reused=120):
    return {
        "text": "```",
        "meta_info": {
            "completion_tokens": n,
            "finish_reason": None if finish is None else {"type": finish},
            "relay": {"reused_tokens": reused, "reuse_rate": 0.8},
        },
    }


def test_stop_reason_needs_relayed_kv_a_stop_and_a_short_reply():
    assert "stopped after 2 tokens with 120 relayed" in stop_reason(response(), 4)
    assert stop_reason(response(n=4), 4) is not None
    assert stop_reason(response(n=5), 4) is None  # long enough
    assert stop_reason(response(finish="length"), 4) is None  # the user's limit
    assert stop_reason(response(finish="abort"), 4) is None
    assert stop_reason(response(reused=0), 4) is None  # nothing relayed: exact already
    assert stop_reason(response(), 0) is None  # guard off
    no_info = response()
    del no_info["meta_info"]["relay"]
    assert stop_reason(no_info, 4) is None


def request(stream=False, max_new=64, session=None, relay=None):
    params = {"max_new_tokens": max_new, "temperature": 0.0}
    if relay is not None:
        params["custom_params"] = {"relay": relay, "other": 1}
    return SimpleNamespace(
        rid="r1", sampling_params=params, stream=stream, session_params=session, text="p"
    )


def test_eligible_requests():
    on = GuardPolicy(tokens=4)
    assert eligible(request(), on)
    assert not eligible(request(), GuardPolicy(tokens=0))
    assert not eligible(request(max_new=4), on)  # ends by length within the window anyway
    assert not eligible(request(session={"id": "s"}), on)  # a redo would append twice
    assert not eligible(request(stream=True), on)  # streams: only when asked
    assert eligible(request(stream=True), GuardPolicy(tokens=4, streams=True))


@pytest.mark.parametrize(
    "option",
    [None, "relay", "epic", "standard", {"method": "relay", "key": "k1"},
     {"reuse": 0.9, "store": False}, {"method": "standard", "store": True}],
)  # fmt: skip
def test_the_redo_is_standard_prefill_and_stores_exactly_when_the_first_would(option):
    redo = standard_option(option)
    assert redo["method"] == "standard"
    assert stores_spans(redo) == stores_spans(option)
    if isinstance(option, dict) and "key" in option:
        assert redo["key"] == option["key"]


def test_redo_request_copies_the_request_under_a_new_rid():
    obj = request(relay={"method": "relay", "key": "k1"})
    redo = redo_request(obj, response())
    assert redo.rid != obj.rid and redo.text == obj.text
    params = redo.sampling_params["custom_params"]
    assert params["relay"] == {"method": "standard", "store": True, "key": "k1"}
    assert params["other"] == 1
    assert params[GUARD_KEY] == {"of": "r1", "reused_tokens": 120}
    # the original request is untouched
    assert obj.sampling_params["custom_params"]["relay"] == {"method": "relay", "key": "k1"}
    note = guard_redo_of(SimpleNamespace(sampling_params=SimpleNamespace(custom_params=params)))
    assert note == {"of": "r1", "reused_tokens": 120}


def test_policy_from_the_environment_and_serve_flags(model_dir):
    assert guard_policy({}) == GuardPolicy(tokens=4, streams=False)
    _, env = split_relay_flags(["--relay-guard-tokens", "8", "--relay-guard-streams"])
    assert guard_policy(env) == GuardPolicy(tokens=8, streams=True)
    assert guard_policy({"SGLANG_RELAY_GUARD_TOKENS": "0"}).tokens == 0
    for bad in ({"SGLANG_RELAY_GUARD_TOKENS": "x"}, {"SGLANG_RELAY_GUARD_TOKENS": "-1"},
                {"SGLANG_RELAY_GUARD_STREAMS": "yes"}):  # fmt: skip
        with pytest.raises(ValueError, match="SGLANG_RELAY_GUARD"):
            guard_policy(bad)
    with pytest.raises(Exception, match="SGLANG_RELAY_GUARD_TOKENS"):
        check_relay_settings({"SGLANG_RELAY_GUARD_TOKENS": "x"}, str(model_dir))


def test_the_frontier_models_the_guard_as_the_server_runs_it():
    from sglang_relay.bench.evaluation import guard_outcome

    eos, exact = 2, [10, 11, 12, 13, 14, 2]
    assert guard_outcome([7, eos], exact, [eos]) == (True, exact)  # stopped at once: redone
    assert guard_outcome([7, 8, 9, eos], exact, [eos], limit=4)[0]
    assert guard_outcome([7, 8, 9, 9, eos], exact, [eos], limit=4) == (False, [7, 8, 9, 9, eos])
    assert guard_outcome([7, 8], exact, [eos]) == (False, [7, 8])  # cut by length, no stop
    assert guard_outcome([7, eos], exact, [eos], limit=0) == (False, [7, eos])
