"""Span namespaces per LoRA adapter, on SGLang's own request objects: the scheduler's ``Req``
(which appends the adapter id to ``extra_key``) and the ``TokenizedGenerateReqInput`` the DP
controller routes (which carries both apart). The expected namespaces are written out by
hand from the fields each request was built with."""

from __future__ import annotations

from array import array
from uuid import uuid4

import pytest

from sglang_relay.runtime.config.settings import settings_from_env
from sglang_relay.runtime.scale.dp_fingerprints import namespace_salt
from sglang_relay.runtime.sched.options import namespace
from sglang_relay.runtime.sglang.scheduling import (
    IsolationError,
    request_isolation,
    tokenized_isolation,
)
from sglang_relay.runtime.sglang.views import attributes, missing_surface

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = [5, 6, 7, 8]


def _ids():
    from sglang.srt.lora.lora_registry import LoRARef

    # a runtime-loaded adapter's id and a --lora-paths adapter's (stable across restarts)
    return [uuid4().hex, LoRARef.deterministic_id("reviewer", "/adapters/reviewer")]


def _tokenized(lora_id=None, extra_key=None, cache_salt=None, relay=None):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(custom_params={"relay": relay} if relay is not None else None)
    return TokenizedGenerateReqInput(
        input_text=None, input_ids=array("i", TOKENS), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=params, return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
        lora_id=lora_id, extra_key=extra_key, cache_salt=cache_salt,
    )  # fmt: skip


def _req(recv):
    """The scheduler's Req for a tokenized request, with the fields the scheduler passes
    (rid, text, ids, sampling params, lora_id, extra_key, cache_salt)."""
    from sglang.srt.managers.schedule_batch import Req

    return Req(
        "r", "", array("q", recv.input_ids), recv.sampling_params, lora_id=recv.lora_id,
        extra_key=recv.extra_key, cache_salt=recv.cache_salt,
    )  # fmt: skip


@pytest.mark.parametrize("user", [None, "", "team", "team" + "0" * 32])
def test_the_users_key_and_the_adapter_come_apart_again(user):
    for lora_id in [None, *_ids()]:
        recv = _tokenized(lora_id=lora_id, extra_key=user, cache_salt="s")
        req = _req(recv)
        if lora_id is not None:  # SGLang's own concatenation, which relay undoes
            assert req.extra_key == (user or "") + lora_id
        want = (user or None, lora_id, "s")
        assert request_isolation(req) == want
        assert tokenized_isolation(recv) == want  # router and rank agree
        for scope in ("shared", "key"):
            rank = namespace(scope, request_isolation(req), None)
            router = namespace(scope, tokenized_isolation(recv), None)
            assert rank == router == (user or None, lora_id, "s", None)
            assert namespace_salt(rank) == namespace_salt(router)


def test_a_key_ending_in_an_adapter_id_is_not_that_adapter():
    """SGLang's ``extra_key`` is the same string for a base-model request keyed "x" + id and
    an adapter-id request keyed "x"; their relay namespaces differ."""
    lora_id = _ids()[0]
    base = _req(_tokenized(extra_key="x" + lora_id))
    adapter = _req(_tokenized(lora_id=lora_id, extra_key="x"))
    assert base.extra_key == adapter.extra_key  # what a concatenated namespace would see
    a, b = request_isolation(base), request_isolation(adapter)
    assert a == ("x" + lora_id, None, None) and b == ("x", lora_id, None)
    assert namespace("shared", a, None) != namespace("shared", b, None)


def test_adapters_are_apart_by_default_and_together_when_shared():
    a, b = _ids()
    reqs = {
        "base": _req(_tokenized(extra_key="k", cache_salt="s")),
        "a": _req(_tokenized(lora_id=a, extra_key="k", cache_salt="s")),
        "b": _req(_tokenized(lora_id=b, extra_key="k", cache_salt="s")),
    }
    apart = {n: namespace("shared", request_isolation(r), None) for n, r in reqs.items()}
    assert len(set(apart.values())) == 3
    together = {
        n: namespace("shared", request_isolation(r, "shared"), None) for n, r in reqs.items()
    }
    assert set(together.values()) == {("k", None, "s", None)}
    # the user's key and the salt still separate under "shared"
    other_salt = _req(_tokenized(lora_id=a, extra_key="k", cache_salt="t"))
    other_key = _req(_tokenized(lora_id=a, extra_key="j", cache_salt="s"))
    for r in (other_salt, other_key):
        assert namespace("shared", request_isolation(r, "shared"), None) not in set(
            together.values()
        )
    # the router reads the same mode from the same setting
    recv = _tokenized(lora_id=b, extra_key="k", cache_salt="s")
    assert tokenized_isolation(recv, "shared") == ("k", None, "s")


def test_scope_key_needs_a_salt_or_relay_key_under_an_adapter_too():
    lora_id = _ids()[1]
    req = _req(_tokenized(lora_id=lora_id))
    assert namespace("key", request_isolation(req), None) is None
    keyed = _req(_tokenized(lora_id=lora_id, relay={"method": "relay", "key": "chain-1"}))
    got = namespace("key", request_isolation(keyed), {"method": "relay", "key": "chain-1"})
    assert got == (None, lora_id, None, "chain-1")


def test_a_key_sglang_changed_after_the_adapter_fails_closed():
    """Elastic EP appends ``|elastic_ep_size=N`` to ``extra_key`` after the adapter id: the
    split no longer holds, so the request neither stores nor reuses (a counted fallback in
    the runtime, ``lora_namespace``)."""
    lora_id = _ids()[0]
    req = _req(_tokenized(lora_id=lora_id, extra_key="k"))
    req.extra_key += "|elastic_ep_size=2"
    with pytest.raises(IsolationError):
        request_isolation(req)
    assert isinstance(IsolationError("x"), ValueError)  # callers catching ValueError


def test_the_setting_is_read_and_checked():
    assert settings_from_env("", {}).lora == "adapter"
    assert settings_from_env("", {"SGLANG_RELAY_LORA": "shared"}).lora == "shared"
    with pytest.raises(ValueError, match="SGLANG_RELAY_LORA must be one of adapter, shared"):
        settings_from_env("", {"SGLANG_RELAY_LORA": "all"})


def test_sglangs_request_classes_have_what_the_split_reads():
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    assert missing_surface("TokenizedGenerateReqInput", TokenizedGenerateReqInput) == []
    assert "lora_id" in attributes("Req") and _req(_tokenized()).lora_id is None
