"""Server-level relay settings: the RelayConfig plus runtime knobs, read from the environment.

``sglang-relay serve`` turns its ``--relay-*`` flags into these variables before SGLang
starts, so that the spawned scheduler process sees them too; with SGLang's own launcher,
set them directly:

* ``SGLANG_RELAY_METHOD``: standard | naive | cacheblend | epic | relay (default relay)
* ``SGLANG_RELAY_PROFILE``: a profile JSON (default: the profile shipped for the model,
  else the built-in defaults)
* ``SGLANG_RELAY_CONFIG``: JSON object of RelayConfig fields overriding the profile
* ``SGLANG_RELAY_SPAN_TOKENS``: token budget of recorded spans (default 1/4 of the pool)
* ``SGLANG_RELAY_ALLOW_APPROX_PREFIX``: 1 lets relayed (approximate) KV enter the radix
  tree, where exact prefix hits may return it (default 0: exact stays exact)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sglang_relay.core.config import RelayConfig, load_profile

ENV_METHOD = "SGLANG_RELAY_METHOD"
ENV_PROFILE = "SGLANG_RELAY_PROFILE"
ENV_CONFIG = "SGLANG_RELAY_CONFIG"
ENV_SPAN_TOKENS = "SGLANG_RELAY_SPAN_TOKENS"
ENV_ALLOW_APPROX = "SGLANG_RELAY_ALLOW_APPROX_PREFIX"


@dataclass(frozen=True, slots=True)
class RelaySettings:
    config: RelayConfig
    span_tokens: int | None = None
    allow_approx_prefix: bool = False
    profile_path: str | None = None


def shipped_profile(model_name: str) -> Path | None:
    """The profile shipped in the package for a model directory's name, if any."""
    name = Path(model_name.rstrip("/")).name
    candidate = resources.files("sglang_relay.data").joinpath(f"profile_{name}.json")
    return Path(str(candidate)) if candidate.is_file() else None


def settings_from_env(model_path: str = "", env: dict[str, str] | None = None) -> RelaySettings:
    """Build and validate the settings; raises ValueError with a clear message."""
    env = os.environ if env is None else env
    profile = env.get(ENV_PROFILE) or (str(shipped_profile(model_path) or "") or None)
    config = RelayConfig()
    if profile:
        config, _ = load_profile(profile)
    method = env.get(ENV_METHOD)
    if method:
        if method in ("cacheblend", "epic"):
            config = config.for_method(method)
        else:
            config = RelayConfig.from_dict({**config.to_dict(), "method": method})
    raw = env.get(ENV_CONFIG)
    if raw:
        try:
            overrides = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{ENV_CONFIG} is not valid JSON: {exc}") from exc
        if not isinstance(overrides, dict):
            raise ValueError(f"{ENV_CONFIG} must be a JSON object")
        config = RelayConfig.from_dict({**config.to_dict(), **overrides})
    span_tokens = env.get(ENV_SPAN_TOKENS)
    try:
        budget = int(span_tokens) if span_tokens else None
    except ValueError as exc:
        raise ValueError(f"{ENV_SPAN_TOKENS} must be an integer; got {span_tokens!r}") from exc
    if budget is not None and budget <= 0:
        raise ValueError(f"{ENV_SPAN_TOKENS} must be > 0; got {budget}")
    return RelaySettings(
        config=config,
        span_tokens=budget,
        allow_approx_prefix=env.get(ENV_ALLOW_APPROX, "0") == "1",
        profile_path=profile,
    )
