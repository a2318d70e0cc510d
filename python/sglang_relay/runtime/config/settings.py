"""Server-level relay settings: the RelayConfig plus runtime knobs, read from the environment.

``sglang-relay serve`` turns its ``--relay-*`` flags into these variables before SGLang
starts, so that the spawned scheduler process sees them too; with SGLang's own launcher,
set them directly:

* ``SGLANG_RELAY_METHOD``: standard | naive | cacheblend | epic | relay (default relay)
* ``SGLANG_RELAY_PROFILE``: a profile JSON (default: the profile shipped for the model,
  else the built-in defaults)
* ``SGLANG_RELAY_REUSE``: the server's default operating point: a reuse target in (0, 1) or
  a level name (fidelity 0.80, balanced 0.90, speed 0.95), mapped to a config by the
  profile's frontier (:mod:`sglang_relay.core.operating`); default: the profile's chosen
  config, or 0.80 on a model without a profile
* ``SGLANG_RELAY_CONFIG``: JSON object of RelayConfig fields overriding the profile
* ``SGLANG_RELAY_SCOPE``: who may reuse whose spans: ``shared`` (default: every request
  of the same SGLang isolation keys, ``cache_salt`` / LoRA, and relay key, which the client
  asserts in its body), ``key`` (only requests carrying the same ``cache_salt`` or relay
  key; requests with neither store and reuse nothing) or ``header:<Name>`` (the tenant is
  the value of the HTTP header ``<Name>``, which the operator's gateway sets and the
  client cannot forge past it: requests of different tenants never share a span, whatever
  their body says; a request without the header stores and reuses nothing)
* ``SGLANG_RELAY_META``: what ``meta_info["relay"]`` shows a client: ``full`` (default:
  every field), ``counts`` (the method, reused and selected tokens, the reuse rate and the
  fallback reason) or ``off`` (no relay field in any response)
* ``SGLANG_RELAY_LORA``: spans across LoRA adapters: ``adapter`` (default: a request under
  adapter X reuses only KV decoded under X, base-model requests only the base model's) or
  ``shared`` (every adapter and the base model reuse each other's spans; the selected rows
  are recomputed under the requesting adapter, the rest keep the other adapter's KV)
* ``SGLANG_RELAY_MIN_SHARE``: relatedness rule: a stored span relays into a prompt only
  if the prompt holds at least this share of it (default 0.5) or a run of at least 256
  of its tokens (:func:`sglang_relay.core.relatedness.related_spans`); 0 relays any match
* ``SGLANG_RELAY_REASONING_REUSE``: the reuse target for the answers of a reasoning model
  (spans stored with reasoning before the answer; needs SGLang's ``--reasoning-parser``):
  their runs are capped for this target apart from the request's other runs when it is
  below the request's (default 0.60, measured: docs/fidelity.md "Reasoning answers");
  ``off``: answers get the request's target
* ``SGLANG_RELAY_SPAN_TOKENS``: token budget of recorded spans (default 1/4 of the pool)
* ``SGLANG_RELAY_HOST_TOKENS``: with HiCache (``--enable-hierarchical-cache``), the
  relay host tier's capacity in tokens: recorded spans are copied there and come back
  when their device slots are gone (default: twice the span budget; 0: no tier,
  :mod:`sglang_relay.runtime.cache.host_tier`)
* ``SGLANG_RELAY_HOST_TTL``: seconds after which a host copy no prompt used is freed
  (default 600)
* ``SGLANG_RELAY_HOST_PRIORITY``: which host copies give way when the tier is full:
  ``unconsumed`` (default: spans no prompt used yet are kept longest)
  or ``lru``
* ``SGLANG_RELAY_SHIP_TO``: span shipping, publisher side (a PD decode server): the
  ``HOST:PORT`` (comma-separated) of each receiver its recorded spans are offered to
* ``SGLANG_RELAY_SHIP_LISTEN``: span shipping, receiver side (a PD prefill server): the
  ``HOST:PORT`` it takes offers on (:mod:`sglang_relay.runtime.scale.ship`)
* ``SGLANG_RELAY_SHIP_LEASE``: seconds a publisher keeps an offered host copy unchanged
  for its receivers (default 60)
* ``SGLANG_RELAY_SHIP_SECRET``: a receiver's secret; it refuses a publisher whose hello is
  not signed with the key the secret gives that publisher's name (the traffic is signed, not
  encrypted). Needed to listen beyond loopback; never set on a publisher.
* ``SGLANG_RELAY_SHIP_NAME``: a publisher's name (receivers map it to a namespace)
* ``SGLANG_RELAY_SHIP_KEY``: a publisher's own signing key, ``sglang-relay ship-key --name
  NAME`` with the receivers' secret in the environment (unset: the key of no secret, which
  a loopback receiver without a secret takes)
* ``SGLANG_RELAY_SHIP_PUBLISHERS``: a receiver's map ``NAME=*|NAME=TENANT[,...]`` of the
  publishers it takes spans from: ``*`` files a span under the namespace it was offered
  with, ``TENANT`` under that tenant (a ``header:`` scope) whatever the offer says
* ``SGLANG_RELAY_SHIP_STAGING``: tokens of KV the staging region holds, the only memory a
  shipping server registers with the transfer engine (default 8192)
* ``SGLANG_RELAY_SHIP_PROTOCOL``: the transfer engine's protocol, ``tcp`` (default) or
  ``rdma`` (not run here)
* ``SGLANG_RELAY_ALLOW_APPROX_PREFIX``: 1 lets relayed (approximate) KV enter the radix
  tree, where exact prefix hits may return it (default 0: exact stays exact)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from sglang_relay.core.config import RelayConfig, load_profile
from sglang_relay.core.operating import Frontier, OperatingPoint, answer_cap, parse_target
from sglang_relay.runtime.state import STATE

ENV_METHOD = "SGLANG_RELAY_METHOD"
ENV_PROFILE = "SGLANG_RELAY_PROFILE"
ENV_CONFIG = "SGLANG_RELAY_CONFIG"
ENV_REUSE = "SGLANG_RELAY_REUSE"
ENV_SCOPE = "SGLANG_RELAY_SCOPE"
ENV_LORA = "SGLANG_RELAY_LORA"
ENV_MIN_SHARE = "SGLANG_RELAY_MIN_SHARE"
ENV_REASONING_REUSE = "SGLANG_RELAY_REASONING_REUSE"
# reasoning answers at reuse 0.60 match plain answers at the default 0.80 on first-token KL
# (0.015 vs 0.017) and top-1 (0.91 vs 0.81): research/studies/reasoning_fidelity.py, 32 questions
DEFAULT_REASONING_REUSE = 0.60
DEFAULT_MIN_SHARE = 0.5  # real relays: every pasted output >= 0.72 (docs/configuration.md)
SCOPES = ("shared", "key")  # and "header:<Name>" (:func:`scope_header`)
ENV_META = "SGLANG_RELAY_META"
METAS = ("full", "counts", "off")
# the fields meta_info["relay"] keeps under SGLANG_RELAY_META=counts
META_COUNTS = ("method", "reused_tokens", "selected_tokens", "reuse_rate", "fallback")
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_SHIP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def ship_name_ok(name: object) -> bool:
    """Whether ``name`` is a ship publisher's name: 1-64 letters, digits, ``.``, ``_``,
    ``-`` (the one rule: the settings here, the wire's hello and ``ship-key``)."""
    return isinstance(name, str) and _SHIP_NAME.fullmatch(name) is not None


def scope_header(scope: str) -> str | None:
    """The (lower-case) HTTP header a ``header:<Name>`` scope takes the tenant from; None
    for the other scopes."""
    return scope[len("header:") :].lower() if scope.startswith("header:") else None


LORA_MODES = ("adapter", "shared")

# Without a profile nothing is known about the model's layers: no hidden state is stored
# (no side memory, nothing to calibrate), layer 0 is recomputed densely, value deviation at
# layer 1 plus the first 16 tokens of each span select, capped for UNPROFILED_REUSE. On the
# embedded model and the evaluation workloads this sits between the profiled rule and the
# baselines at 0.80; a request above 1 - 5/L reuse runs the first tokens of each span
# instead (core/operating.py, MAX_DENSE_SHARE; docs/fidelity.md, "Models without a profile").
UNPROFILED = RelayConfig(l_start=0, l_det=1, l_end=-1, tau_dev=1.0, l_suf=0, first_k=16)
UNPROFILED_REUSE = 0.80
# the early-stop guard's window (runtime/sched/guard.py, SGLANG_RELAY_GUARD_TOKENS)
DEFAULT_GUARD_TOKENS = 4
# RelayConfig fields that make a layer schedule (an operator who sets one keeps it)
SCHEDULE_FIELDS = frozenset({"l_start", "l_det", "l_end", "signal"})
ENV_SPAN_TOKENS = "SGLANG_RELAY_SPAN_TOKENS"
ENV_ALLOW_APPROX = "SGLANG_RELAY_ALLOW_APPROX_PREFIX"
ENV_HOST_TOKENS = "SGLANG_RELAY_HOST_TOKENS"
ENV_HOST_TTL = "SGLANG_RELAY_HOST_TTL"
ENV_HOST_PRIORITY = "SGLANG_RELAY_HOST_PRIORITY"
DEFAULT_HOST_TTL = 600.0
ENV_SHIP_TO = "SGLANG_RELAY_SHIP_TO"
ENV_SHIP_LISTEN = "SGLANG_RELAY_SHIP_LISTEN"
ENV_SHIP_LEASE = "SGLANG_RELAY_SHIP_LEASE"
ENV_SHIP_PROTOCOL = "SGLANG_RELAY_SHIP_PROTOCOL"
ENV_SHIP_SECRET = "SGLANG_RELAY_SHIP_SECRET"
ENV_SHIP_NAME = "SGLANG_RELAY_SHIP_NAME"
ENV_SHIP_KEY = "SGLANG_RELAY_SHIP_KEY"
ENV_SHIP_PUBLISHERS = "SGLANG_RELAY_SHIP_PUBLISHERS"
ENV_SHIP_STAGING = "SGLANG_RELAY_SHIP_STAGING"
DEFAULT_SHIP_STAGING = 8192  # tokens of KV each shipping server exposes to the engine
SHIP_PROTOCOLS = ("tcp", "rdma")
HOST_PRIORITIES = ("unconsumed", "lru")


@dataclass(frozen=True, slots=True)
class RelaySettings:
    config: RelayConfig
    span_tokens: int | None = None
    allow_approx_prefix: bool = False
    profile_path: str | None = None
    frontier: Frontier = Frontier()
    reuse_target: float | None = None  # default operating point (None: ``config`` as is)
    overrides: tuple[tuple[str, object], ...] = ()  # SGLANG_RELAY_CONFIG, applied last
    scope: str = "shared"  # SGLANG_RELAY_SCOPE
    meta: str = "full"  # SGLANG_RELAY_META
    lora: str = "adapter"  # SGLANG_RELAY_LORA
    min_share: float = DEFAULT_MIN_SHARE  # SGLANG_RELAY_MIN_SHARE
    reasoning_reuse: float | None = DEFAULT_REASONING_REUSE  # SGLANG_RELAY_REASONING_REUSE
    host_tokens: int | None = None  # SGLANG_RELAY_HOST_TOKENS (None: 2x the span budget)
    host_ttl: float = DEFAULT_HOST_TTL  # SGLANG_RELAY_HOST_TTL
    host_priority: str = "unconsumed"  # SGLANG_RELAY_HOST_PRIORITY
    ship_to: tuple[str, ...] = ()  # SGLANG_RELAY_SHIP_TO
    ship_listen: str | None = None  # SGLANG_RELAY_SHIP_LISTEN
    ship_lease: float = 60.0  # SGLANG_RELAY_SHIP_LEASE
    ship_protocol: str = "tcp"  # SGLANG_RELAY_SHIP_PROTOCOL
    ship_secret: str = field(default="", repr=False)  # SGLANG_RELAY_SHIP_SECRET (receiver)
    ship_name: str = ""  # SGLANG_RELAY_SHIP_NAME (publisher)
    ship_key: str = field(default="", repr=False)  # SGLANG_RELAY_SHIP_KEY (publisher, hex)
    ship_publishers: tuple[tuple[str, str], ...] = ()  # SGLANG_RELAY_SHIP_PUBLISHERS
    ship_staging: int = DEFAULT_SHIP_STAGING  # SGLANG_RELAY_SHIP_STAGING

    @property
    def ship_role(self) -> str | None:
        """``publisher``, ``receiver`` or None (no span shipping)."""
        return "publisher" if self.ship_to else "receiver" if self.ship_listen else None

    @property
    def profiled(self) -> bool:
        return self.profile_path is not None

    def point(self, target: float, num_layers: int) -> OperatingPoint:
        """The operating point for ``target`` (ValueError if out of the rule's reach). A
        layer schedule the operator set (``SGLANG_RELAY_CONFIG`` with ``l_start``,
        ``l_det``, ``l_end`` or ``signal``) is kept as set: no position-rule fallback."""
        base = RelayConfig.from_dict({**self.config.to_dict(), "method": "relay"})
        chosen = SCHEDULE_FIELDS.intersection(dict(self.overrides))
        point = self.frontier.point(base, target, num_layers, position_fallback=not chosen)
        if "answer_max_ratio" in dict(self.overrides):
            return point
        cfg = answer_cap(point.config, num_layers, self.reasoning_reuse)
        return replace(point, config=cfg)


def shipped_profile(model_name: str) -> Path | None:
    """The profile shipped in the package for a model directory's name, if any."""
    name = Path(model_name.rstrip("/")).name
    candidate = resources.files("sglang_relay.data").joinpath(f"profile_{name}.json")
    return Path(str(candidate)) if candidate.is_file() else None


def settings_from_env(model_path: str = "", env: dict[str, str] | None = None) -> RelaySettings:
    """Build and validate the settings; raises ValueError with a clear message."""
    env = os.environ if env is None else env
    profile = env.get(ENV_PROFILE) or (str(shipped_profile(model_path) or "") or None)
    config, frontier = UNPROFILED, Frontier()
    if profile:
        config, data = load_profile(profile)
        frontier = Frontier.from_profile(data)
    raw_reuse = env.get(ENV_REUSE)
    reuse = parse_target(raw_reuse) if raw_reuse else None
    if reuse is None and not profile:
        reuse = UNPROFILED_REUSE
    method = env.get(ENV_METHOD)
    if method:
        if method in ("cacheblend", "epic"):
            config = config.for_method(method)
        else:
            config = RelayConfig.from_dict({**config.to_dict(), "method": method})
    raw = env.get(ENV_CONFIG)
    overrides: dict = {}
    if raw:
        try:
            overrides = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{ENV_CONFIG} is not valid JSON: {exc}") from exc
        if not isinstance(overrides, dict):
            raise ValueError(f"{ENV_CONFIG} must be a JSON object")
        config = RelayConfig.from_dict({**config.to_dict(), **overrides})
    if raw_reuse and config.method != "relay":
        raise ValueError(f"{ENV_REUSE} applies to method relay; the server runs {config.method}")
    scope = env.get(ENV_SCOPE) or "shared"
    header = scope_header(scope)
    if scope not in SCOPES and (header is None or not _HEADER_NAME.fullmatch(header)):
        raise ValueError(f"{ENV_SCOPE} must be one of {', '.join(SCOPES)} or header:<Name> "
                         f"(an HTTP header name); got {scope!r}")  # fmt: skip
    meta = env.get(ENV_META) or "full"
    if meta not in METAS:
        raise ValueError(f"{ENV_META} must be one of {', '.join(METAS)}; got {meta!r}")
    lora = env.get(ENV_LORA) or "adapter"
    if lora not in LORA_MODES:
        raise ValueError(f"{ENV_LORA} must be one of {', '.join(LORA_MODES)}; got {lora!r}")
    raw_share = env.get(ENV_MIN_SHARE)
    try:
        min_share = float(raw_share) if raw_share else DEFAULT_MIN_SHARE
    except ValueError as exc:
        raise ValueError(f"{ENV_MIN_SHARE} must be a number; got {raw_share!r}") from exc
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"{ENV_MIN_SHARE} must be in [0, 1]; got {min_share}")
    raw_reasoning = env.get(ENV_REASONING_REUSE)
    if raw_reasoning is None or raw_reasoning == "":
        reasoning: float | None = DEFAULT_REASONING_REUSE
    elif raw_reasoning == "off":
        reasoning = None
    else:
        try:
            reasoning = parse_target(float(raw_reasoning))
        except ValueError as exc:
            raise ValueError(
                f"{ENV_REASONING_REUSE} must be a number in (0, 1) or off; got {raw_reasoning!r}"
            ) from exc
    budget = _number(env, ENV_SPAN_TOKENS, int, minimum=0, strict=True)
    host_tokens = _number(env, ENV_HOST_TOKENS, int, minimum=0)
    host_ttl = _number(env, ENV_HOST_TTL, float, minimum=0, strict=True)
    host_priority = env.get(ENV_HOST_PRIORITY) or "unconsumed"
    if host_priority not in HOST_PRIORITIES:
        raise ValueError(
            f"{ENV_HOST_PRIORITY} must be one of {', '.join(HOST_PRIORITIES)}; "
            f"got {host_priority!r}"
        )
    ship_to = tuple(a.strip() for a in (env.get(ENV_SHIP_TO) or "").split(",") if a.strip())
    ship_listen = (env.get(ENV_SHIP_LISTEN) or "").strip() or None
    for address in (*ship_to, *([ship_listen] if ship_listen else [])):
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"a ship address is HOST:PORT; got {address!r}")
    if ship_to and ship_listen:
        raise ValueError(
            f"{ENV_SHIP_TO} (a publisher: a decode server) and {ENV_SHIP_LISTEN} (a "
            "receiver: a prefill server) are two roles; give a server one"
        )
    ship_lease = _number(env, ENV_SHIP_LEASE, float, minimum=0, strict=True)
    ship_protocol = env.get(ENV_SHIP_PROTOCOL) or "tcp"
    if ship_protocol not in SHIP_PROTOCOLS:
        raise ValueError(
            f"{ENV_SHIP_PROTOCOL} must be one of {', '.join(SHIP_PROTOCOLS)}; got {ship_protocol!r}"
        )
    ship_secret = env.get(ENV_SHIP_SECRET) or ""
    loopback = ("127.0.0.1", "localhost", "::1", "[::1]")
    if ship_listen and not ship_secret and ship_listen.rpartition(":")[0] not in loopback:
        raise ValueError(
            f"{ENV_SHIP_LISTEN} {ship_listen} listens beyond loopback without "
            f"{ENV_SHIP_SECRET}: any host that reaches it could offer spans; set a secret "
            "on the receiver and give each publisher its key (sglang-relay ship-key; neither "
            "is a flag: they stay out of process listings), or listen on 127.0.0.1"
        )
    ship = _ship_identity(env, ship_to, ship_listen, ship_secret, scope)
    return RelaySettings(
        config=config,
        span_tokens=budget,
        allow_approx_prefix=env.get(ENV_ALLOW_APPROX, "0") == "1",
        profile_path=profile,
        frontier=frontier,
        reuse_target=reuse if config.method == "relay" else None,
        overrides=tuple(overrides.items()),
        scope=scope,
        meta=meta,
        lora=lora,
        min_share=min_share,
        reasoning_reuse=reasoning,
        host_tokens=host_tokens,
        host_ttl=DEFAULT_HOST_TTL if host_ttl is None else host_ttl,
        host_priority=host_priority,
        ship_to=ship_to,
        ship_listen=ship_listen,
        ship_lease=60.0 if ship_lease is None else ship_lease,
        ship_protocol=ship_protocol,
        ship_secret=ship_secret,
        **ship,
    )


def _ship_identity(env, ship_to, ship_listen, secret: str, scope: str) -> dict:
    """Who a shipping server is: a publisher's name and its own key; a receiver's map of
    the publishers it takes spans from (name -> tenant, or ``*``), and the staging size."""
    staging = _number(env, ENV_SHIP_STAGING, int, minimum=0, strict=True)
    out: dict = {"ship_staging": staging or DEFAULT_SHIP_STAGING}
    name, key = (env.get(ENV_SHIP_NAME) or "").strip(), (env.get(ENV_SHIP_KEY) or "").strip()
    if ship_to:
        if not ship_name_ok(name):
            raise ValueError(
                f"a publisher (--relay-ship-to) names itself: --relay-ship-name NAME (1-64 "
                f"letters, digits, '.', '_', '-'; receivers map it to a namespace); got {name!r}"
            )
        if secret:
            raise ValueError(
                f"a publisher holds its own key, not the deployment's {ENV_SHIP_SECRET} (with "
                f"it a publisher could sign as any other): set {ENV_SHIP_KEY}=$(sglang-relay "
                f"ship-key --name {name}) from the secret, on the publisher only"
            )
        if key and not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"{ENV_SHIP_KEY} is 64 hex digits (sglang-relay ship-key prints it)")
        return out | {"ship_name": name, "ship_key": key}
    if not ship_listen:
        return out
    raw = env.get(ENV_SHIP_PUBLISHERS) or ""
    pairs = [item.strip().partition("=") for item in raw.split(",") if item.strip()]
    publishers = tuple((n.strip(), rule.strip()) for n, _, rule in pairs)
    bad = [f"{n}={r}" for n, r in publishers
           if not ship_name_ok(n) or not r]  # fmt: skip
    if not publishers or bad or len({n for n, _ in publishers}) != len(publishers):
        raise ValueError(
            "a receiver (--relay-ship-listen) names the publishers it takes spans from and "
            "where it files them: --relay-ship-publishers NAME=*|NAME=TENANT[,...] (* keeps "
            "the namespace a publisher sends: a PD pair behind one gateway; TENANT files all "
            f"of its spans under that tenant of a header scope); got {raw!r}"
        )
    tenants = [n for n, r in publishers if r != "*"]
    if tenants and scope_header(scope) is None:
        raise ValueError(
            f"--relay-ship-publishers maps {', '.join(tenants)} to a tenant, which needs a "
            f"tenant scope (--relay-scope header:NAME); this server's scope is {scope}"
        )
    return out | {"ship_publishers": publishers}


def ship_role(env: dict[str, str] | None = None) -> str | None:
    """The span-shipping role the environment asks for (before the full settings are read:
    the launcher's mode check)."""
    env = os.environ if env is None else env
    return "publisher" if env.get(ENV_SHIP_TO) else "receiver" if env.get(ENV_SHIP_LISTEN) else None


def _number(env, name: str, kind: type, *, minimum: float, strict: bool = False):
    """``env[name]`` as ``kind`` (None when unset); at least ``minimum`` (above it when
    ``strict``); a ValueError naming the variable otherwise."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError as exc:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what}; got {raw!r}") from exc
    if value < minimum or (strict and value == minimum) or value != value:
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}; got {raw!r}")
    return value


def server_settings(model_path: str) -> RelaySettings:
    """This process's settings for ``model_path``: read from the environment once and shared
    by every hook that needs them (the tokenizer's trust boundary, the KV budget, the decode
    capture, the cache factory), so they all see one object. A changed ``SGLANG_RELAY_*``
    variable (tests) reads them again."""
    key = (
        str(model_path),
        tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("SGLANG_RELAY_"))),
    )
    if key not in STATE.settings:
        STATE.settings[key] = settings_from_env(str(model_path))
    return STATE.settings[key]
