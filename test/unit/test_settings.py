"""Server relay settings from the environment (what `sglang-relay serve --relay-*` sets)."""

from __future__ import annotations

import json

import pytest

from sglang_relay.launch import split_relay_flags
from sglang_relay.runtime.config.settings import settings_from_env, shipped_profile

EMBEDDED = "/somewhere/SmolLM2-135M-Instruct"


def test_shipped_profile_is_the_default_for_the_embedded_model():
    assert shipped_profile(EMBEDDED) is not None
    cfg = settings_from_env(EMBEDDED, {}).config
    data = json.loads(shipped_profile(EMBEDDED).read_text())
    assert cfg.to_dict() == data["config"]
    assert settings_from_env("/models/other", {}).profile_path is None


def test_method_then_overrides():
    env = {"SGLANG_RELAY_METHOD": "epic", "SGLANG_RELAY_CONFIG": '{"first_k": 8}'}
    cfg = settings_from_env(EMBEDDED, env).config
    assert (cfg.method, cfg.first_k, cfg.l_start, cfg.l_det) == ("epic", 8, 0, 0)
    cb = settings_from_env(EMBEDDED, {"SGLANG_RELAY_METHOD": "cacheblend"}).config
    assert (cb.top_ratio, cb.signal, cb.first_k) == (0.15, "key", 0)


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"SGLANG_RELAY_CONFIG": "{nope"}, "not valid JSON"),
        ({"SGLANG_RELAY_CONFIG": "[1]"}, "JSON object"),
        ({"SGLANG_RELAY_METHOD": "magic"}, "method must be one of"),
        ({"SGLANG_RELAY_SPAN_TOKENS": "-5"}, "must be > 0"),
        ({"SGLANG_RELAY_PROFILE": "/nonexistent.json"}, "cannot read relay profile"),
        ({"SGLANG_RELAY_MIN_SHARE": "half"}, "MIN_SHARE must be a number"),
        ({"SGLANG_RELAY_MIN_SHARE": "1.5"}, r"MIN_SHARE must be in \[0, 1\]"),
        ({"SGLANG_RELAY_HOST_TOKENS": "-1"}, "HOST_TOKENS must be >= 0"),
        ({"SGLANG_RELAY_HOST_TOKENS": "1e3"}, "HOST_TOKENS must be an integer"),
        ({"SGLANG_RELAY_HOST_TTL": "0"}, "HOST_TTL must be > 0"),
        ({"SGLANG_RELAY_HOST_TTL": "nan"}, "HOST_TTL must be > 0"),
        ({"SGLANG_RELAY_HOST_PRIORITY": "fifo"}, "HOST_PRIORITY must be one of"),
    ],
)
def test_bad_settings_are_clear_errors(env, needle):
    with pytest.raises(ValueError, match=needle):
        settings_from_env(EMBEDDED, env)


def test_host_tier_settings_default_and_override():
    default = settings_from_env(EMBEDDED, {})
    assert (default.host_tokens, default.host_ttl, default.host_priority) == (
        None,
        600.0,
        "unconsumed",
    )
    _, env = split_relay_flags(
        ["--relay-host-tokens", "0", "--relay-host-ttl=30", "--relay-host-priority", "lru"]
    )
    got = settings_from_env(EMBEDDED, env)
    assert (got.host_tokens, got.host_ttl, got.host_priority) == (0, 30.0, "lru")


def test_min_share_default_and_override():
    assert settings_from_env(EMBEDDED, {}).min_share == 0.5
    assert settings_from_env(EMBEDDED, {"SGLANG_RELAY_MIN_SHARE": "0"}).min_share == 0.0
    _, env = split_relay_flags(["--relay-min-share", "0.3"])
    assert env == {"SGLANG_RELAY_MIN_SHARE": "0.3"}


def test_relay_flags_are_split_from_sglang_flags():
    rest, env = split_relay_flags(
        [
            "--port",
            "1",
            "--relay-method=naive",
            "--relay-span-tokens",
            "99",
            "--relay-allow-approx-prefix",
            "--dtype",
            "float32",
        ]
    )
    assert rest == ["--port", "1", "--dtype", "float32"]
    assert env == {
        "SGLANG_RELAY_METHOD": "naive",
        "SGLANG_RELAY_SPAN_TOKENS": "99",
        "SGLANG_RELAY_ALLOW_APPROX_PREFIX": "1",
    }
