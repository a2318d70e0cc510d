"""Operating points: reuse targets -> configs (core/operating.py, settings, per-request
options). References: METHOD.md's token-layer count done by hand over real selections, and
brute-force searches over the frontier."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.operating import (
    LEVELS,
    Frontier,
    answer_cap,
    at_target,
    parse_target,
    reuse_cap,
)
from sglang_relay.core.selection import select_runs, select_tokens
from sglang_relay.runtime.config.settings import UNPROFILED, settings_from_env, shipped_profile
from sglang_relay.runtime.sched.options import resolve_config

EMBEDDED = "/somewhere/SmolLM2-135M-Instruct"


def _span_reuse(cfg: RelayConfig, num_layers: int, n: int, rng: random.Random) -> float:
    """Reuse of one span of ``n`` tokens under ``cfg``, from a real selection, counted by
    hand: dense layers recompute every token, sparse layers the selected ones."""
    dev = torch.tensor([rng.random() ** 3 for _ in range(n)])
    mask = select_tokens(cfg, n, dev if cfg.detects or cfg.ranks_context else None)
    s, d, e = (x % num_layers for x in (cfg.l_start, cfg.l_det, cfg.l_end))
    recomputed = n * (d - s) + int(mask.sum()) * (e - d + 1)
    return 1 - recomputed / (n * num_layers)


@pytest.mark.parametrize("num_layers", [24, 30, 32, 80])
def test_every_span_keeps_the_target(num_layers):
    rng = random.Random(num_layers)
    rules = [
        RelayConfig(l_start=3, l_det=4, l_end=-1, tau_dev=0.0, first_k=24),
        RelayConfig(l_start=0, l_det=1, l_end=-1, tau_dev=1.0, first_k=16),
        RelayConfig(l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=2, tau_dev=0.0),
        RelayConfig(l_start=0, l_det=0, l_end=-1, signal="none", first_k=10_000),
    ]
    for rule in rules:
        for target in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98):
            try:
                cfg = at_target(rule, num_layers, target)
            except ValueError as exc:
                dense = rule.l_det - rule.l_start
                assert dense / num_layers > 1 - target - 1e-3, exc  # only if truly out of reach
                continue
            for n in (32, 33, 57, 200, 511, 2048):
                assert _span_reuse(cfg, num_layers, n, rng) >= target - 1e-9, (rule, target, n)
            # and the cap is the largest one with that guarantee (3 decimals)
            looser = cfg.max_ratio + 0.002
            if looser <= 1:
                dense = rule.l_det - rule.l_start
                sparse = num_layers - 1 - rule.l_det + 1
                assert dense + looser * sparse > (1 - target) * num_layers


def test_parse_target():
    assert parse_target("speed") == LEVELS["speed"] == 0.95
    assert parse_target("0.875") == 0.875 and parse_target(0.9) == 0.9
    for bad in (0, 1, 1.5, -0.1, True, "fast-ish", None, [0.9]):
        with pytest.raises(ValueError, match="reuse target"):
            parse_target(bad)


def _frontier(targets):
    rows = []
    for i, t in enumerate(targets):
        cfg = at_target(RelayConfig(l_start=3, l_det=4, first_k=i), 30, t)
        rows.append({"target": t, "config": cfg.to_dict()})
    random.Random(1).shuffle(rows)
    return Frontier.from_profile({"frontier": rows})


def test_point_is_the_smallest_profiled_target_at_or_above():
    targets = [0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    frontier = _frontier(targets)
    base = RelayConfig(l_start=0, l_det=1)
    for asked in [0.5, 0.7, 0.71, 0.8, 0.849, 0.85, 0.93, 0.95]:
        point = frontier.point(base, asked, 30)
        want = min(t for t in targets if t >= asked)  # brute force
        assert point.profiled == want and point.target == asked
        assert point.config.first_k == targets.index(want)
    # beyond the last point its rule's dense layer would take 1 of the 1.2 token-layers
    # per token at 0.96: the position rule runs, capped for 0.96
    beyond = frontier.point(base, 0.96, 30)
    assert beyond.profiled is None and beyond.rule == "first_k"
    assert beyond.config.max_ratio == reuse_cap(beyond.config, 30, 0.96)
    # a last rule with no dense layer is kept, its cap solved for the target
    ctx = at_target(RelayConfig(l_start=0, l_det=0, signal="context", l_ctx=2), 30, 0.9)
    kept = Frontier(((0.9, ctx),)).point(base, 0.97, 30)
    assert kept.profiled is None and kept.rule == "context"
    assert kept.config.max_ratio == reuse_cap(ctx, 30, 0.97)
    empty = Frontier().point(base, 0.8, 30)
    assert empty.profiled is None and empty.config.l_det == 1
    assert empty.config.max_ratio == reuse_cap(base, 30, 0.8)
    with pytest.raises(ValueError, match="out of reach"):
        at_target(RelayConfig(l_start=0, l_det=5), 30, 0.9)
    # a rule whose 5 dense layers exceed the 0.90 budget runs the position rule instead
    assert Frontier().point(RelayConfig(l_start=0, l_det=5), 0.9, 30).rule == "first_k"


@pytest.mark.parametrize("num_layers", [24, 30, 32, 80])
def test_without_a_point_a_rule_whose_dense_layers_eat_the_budget_runs_by_position(num_layers):
    """Beyond the profiled points (or with none), a rule whose dense layers would take more
    than a fifth of ``(1 - target) L`` token-layers per token gives way to the first tokens
    of each span: counted by hand, per span, with the reuse kept."""
    rng = random.Random(num_layers)
    rules = [UNPROFILED, RelayConfig(l_start=3, l_det=4, l_end=-1, tau_dev=1.0, first_k=24)]
    for rule in rules:
        for target in (0.5, 0.7, 0.8, 0.83, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99):
            point = Frontier().point(rule, target, num_layers)
            dense = rule.l_det - rule.l_start
            budget = (1 - target) * num_layers  # token-layers per span token
            if 5 * dense <= budget:
                assert point.rule == "deviation" and point.config.l_det == rule.l_det
                continue
            assert point.rule == "first_k", (rule, target)
            cfg = point.config
            for n in (32, 57, 300, 2048):
                want = torch.zeros(n, dtype=torch.bool)
                want[: int(cfg.max_ratio * n)] = True  # the first floor(cap n) tokens
                assert torch.equal(select_tokens(cfg, n), want)
                assert _span_reuse(cfg, num_layers, n, rng) >= target - 1e-9
            # two spans of one request each keep their own first tokens
            a, b = select_runs(cfg, [400, 1200])
            assert int(a.sum()) == int(cfg.max_ratio * 400) >= 1 and bool(a[0] and b[0])


def test_bad_frontier_is_refused():
    with pytest.raises(ValueError, match="capped relay"):
        Frontier.from_profile({"frontier": [{"target": 0.9, "config": {"method": "relay"}}]})
    with pytest.raises(ValueError, match="bad profile frontier"):
        Frontier.from_profile({"frontier": [{"config": {}}]})


def test_shipped_profile_frontier():
    """Every shipped point keeps its target and stores hidden states at one layer at most."""
    data = json.loads(shipped_profile(EMBEDDED).read_text())
    frontier = Frontier.from_profile(data)
    assert [t for t, _ in frontier.points] == sorted(p["target"] for p in data["frontier"])
    assert len({cfg.stored_layer(30) for cfg in frontier.configs()} - {None}) <= 1
    rng = random.Random(0)
    for target, cfg in frontier.points:
        for n in (32, 100, 300, 1000):
            assert _span_reuse(cfg, 30, n, rng) >= target - 1e-9


def test_settings_reuse_and_unprofiled_defaults():
    plain = settings_from_env(EMBEDDED, {})
    assert plain.profiled and plain.reuse_target is None and plain.frontier.points
    fast = settings_from_env(EMBEDDED, {"SGLANG_RELAY_REUSE": "balanced"})
    assert fast.reuse_target == 0.9
    other = settings_from_env("/models/Qwen2-0.5B", {})
    assert not other.profiled and other.reuse_target == 0.8 and other.config == UNPROFILED
    assert not other.frontier.points
    point = other.point(0.8, 24)  # no hidden state needed on an unknown model
    assert point.config.l_start == 0 and _span_reuse(point.config, 24, 300, random.Random()) >= 0.8
    # a request for 0.95 on that server: its dense layer 0 would take 1 of 1.2 token-layers
    # per token, so the first tokens of each span run (nothing stored, nothing recorded)
    unknown = {"num_layers": 24, "capture_layer": None, "context_layer": None}
    cfg, point = resolve_config(other, {"reuse": "speed"}, **unknown)
    assert point.rule == "first_k" and cfg == point.config and cfg.stored_layer(24) is None
    assert _span_reuse(cfg, 24, 300, random.Random()) >= 0.95
    for env, needle in [
        ({"SGLANG_RELAY_REUSE": "1.2"}, "reuse target"),
        ({"SGLANG_RELAY_REUSE": "0.9", "SGLANG_RELAY_METHOD": "epic"}, "applies to method"),
    ]:
        with pytest.raises(ValueError, match=needle):
            settings_from_env(EMBEDDED, env)


def test_request_reuse_option():
    settings = settings_from_env(EMBEDDED, {})
    # the shipped profile's server: it stores the stream entering 12 and masses at 12
    SHIPPED = {"num_layers": 30, "capture_layer": 12, "context_layer": 12}  # noqa: N806
    cfg, point = resolve_config(settings, {"reuse": "speed"}, **SHIPPED)
    assert point.profiled == 0.95 and cfg == point.config
    cfg, point = resolve_config(settings, None, **SHIPPED)
    # no target: the profile's config, its reasoning answers capped for reuse 0.60
    assert point is None and cfg == answer_cap(settings.config, 30, 0.60)
    over = {"reuse": 0.8, "config": {"first_k": 3}}
    cfg, point = resolve_config(settings, over, **SHIPPED)
    assert cfg.first_k == 3 and cfg.max_ratio == point.config.max_ratio
    with pytest.raises(ValueError, match="applies to method relay"):
        resolve_config(settings, {"method": "epic", "reuse": 0.9}, **SHIPPED)
    with pytest.raises(ValueError, match="reuse target"):
        resolve_config(settings, {"reuse": "max"}, **SHIPPED)
    assert resolve_config(settings, "off", **SHIPPED) == (None, None)
    # a context rule must use the layer whose masses the server records with its spans
    ctx = {"config": {"signal": "context", "l_ctx": 5, "l_start": 0, "l_det": 0}}
    cfg, _ = resolve_config(settings, ctx, num_layers=30, capture_layer=5, context_layer=5)
    assert cfg.ranks_context and cfg.l_ctx == 5
    with pytest.raises(ValueError, match="l_ctx must be 12"):
        resolve_config(settings, ctx, num_layers=30, capture_layer=5, context_layer=12)
    with pytest.raises(ValueError, match="records none"):
        resolve_config(settings, ctx, num_layers=30, capture_layer=5)


def test_reasoning_answers_get_their_own_reuse_target():
    """Answers are capped for SGLANG_RELAY_REASONING_REUSE (default 0.60) where the request's
    target is higher; the cap is the largest (3 decimals) whose dense + cap * sparse
    token-layers stay within 1 - 0.60 of the layers (counted here from the schedule)."""
    settings = settings_from_env(EMBEDDED, {})
    assert settings.reasoning_reuse == 0.60
    shipped = {"num_layers": 30, "capture_layer": 12, "context_layer": 12}
    for reuse in (0.8, 0.9, "speed"):
        cfg, point = resolve_config(settings, {"reuse": reuse}, **shipped)
        sched = cfg.schedule(30)
        dense, sparse = sched.dense_layers, sched.sparse_layers
        ratio = cfg.answer_max_ratio
        assert ratio > cfg.max_ratio and cfg == point.config
        assert dense + ratio * sparse <= 0.4 * 30 + 1e-9 < dense + (ratio + 0.002) * sparse
    # a request whose own cap already recomputes as much: one cap for all
    loose = {"reuse": 0.8, "config": {"max_ratio": 0.5}}
    assert resolve_config(settings, loose, **shipped)[0].answer_max_ratio is None
    # off, another target, and a request that sets the cap itself
    off = settings_from_env(EMBEDDED, {"SGLANG_RELAY_REASONING_REUSE": "off"})
    assert resolve_config(off, {"reuse": 0.8}, **shipped)[0].answer_max_ratio is None
    seventy = settings_from_env(EMBEDDED, {"SGLANG_RELAY_REASONING_REUSE": "0.7"})
    high = resolve_config(seventy, {"reuse": 0.8}, **shipped)[0].answer_max_ratio
    assert high < resolve_config(settings, {"reuse": 0.8}, **shipped)[0].answer_max_ratio
    own = {"reuse": 0.8, "config": {"answer_max_ratio": 0.2}}
    assert resolve_config(settings, own, **shipped)[0].answer_max_ratio == 0.2
    for bad in ("1.2", "fast"):
        with pytest.raises(ValueError, match="SGLANG_RELAY_REASONING_REUSE"):
            settings_from_env(EMBEDDED, {"SGLANG_RELAY_REASONING_REUSE": bad})
    # baselines are not relay: never capped apart
    cfg, _ = resolve_config(settings, "epic", **shipped)
    assert cfg.answer_max_ratio is None


def test_bench_ttft_operating_point_methods_are_requests_the_server_takes():
    """``bench ttft --methods relay@T``: the request option it sends maps to the point a
    server resolves for ``T`` (a number or a level name), the plain names stay names."""
    from sglang_relay.bench.ttft import _relay_option

    settings = settings_from_env(EMBEDDED, {})
    shipped = {"num_layers": 30, "capture_layer": 12, "context_layer": 12}
    for name, target in (("relay@0.95", 0.95), ("relay@speed", 0.95), ("relay@0.9", 0.90)):
        _, point = resolve_config(settings, _relay_option(name), **shipped)
        assert point is not None and point.profiled == target
    probed, _ = resolve_config(settings, _relay_option("relay@0.9"), **shipped)
    plain, _ = resolve_config(settings, _relay_option("relay@0.9:noprobe"), **shipped)
    assert probed.probes and not plain.probes and plain == replace(probed, probe=None)
    with pytest.raises(ValueError, match="variant"):
        _relay_option("relay@0.9:fast")
    assert _relay_option("epic") == "epic" and _relay_option("stock_prefix_hit") == "standard"


def test_position_only_rule_is_epics_selection():
    """``signal="none"`` selects exactly what EPIC's first-k rule selects (by brute force:
    the first min(k, cap) tokens), without any deviation scores."""
    for n, k, cap in [(50, 16, None), (300, 24, 0.05), (40, 100, 0.5), (33, 0, None)]:
        rule = RelayConfig(l_start=0, l_det=0, l_suf=0, signal="none", first_k=k, max_ratio=cap)
        epic = RelayConfig().for_method("epic")
        mask = select_tokens(rule, n)
        want = min(k, n) if cap is None else min(k, n, int(cap * n))
        assert mask.tolist() == [i < want for i in range(n)]
        if cap is None:
            from dataclasses import replace

            assert mask.equal(select_tokens(replace(epic, first_k=k), n))


def test_namespaces_and_storing_by_brute_force():
    """``options.namespace`` / ``stores_spans`` against the rule written out by hand."""
    from itertools import product

    from sglang_relay.runtime.sched.options import namespace, stores_spans

    methods = [None, "relay", "standard", "off", "epic"]
    for scope, salt, key, method, store in product(
        ["shared", "key"], [None, "", "s"], [None, "k"], methods, [None, True, False]
    ):
        option: dict = {}
        if key:
            option["key"] = key
        if method:
            option["method"] = method
        if store is not None:
            option["store"] = store
        opt = option or None
        ns = namespace(scope, ("lora0", salt), opt)
        explicit = bool(salt) or bool(key)
        assert (ns is None) == (scope == "key" and not explicit)
        if ns is not None:
            assert ns == ("lora0", salt, key)
        opted_out = method in ("standard", "off")
        assert stores_spans(opt) == (store is True if store is not None else not opted_out)
    assert not stores_spans("off") and stores_spans("relay") and stores_spans(None)
    for bad in ["", 5, "x" * 300]:
        with pytest.raises(ValueError, match="relay key"):
            namespace("shared", (None, None), {"key": bad})


def test_server_overrides_are_in_a_formula_point_once():
    """An unprofiled server with SGLANG_RELAY_CONFIG: its overrides shape the rule the point
    is solved from and are not applied again on top of it (which would undo the position
    rule at a high target or the cap at any), so every target keeps its reuse."""
    rng = random.Random(3)
    # no schedule set: the unprofiled rule, the position rule at 0.95
    settings = settings_from_env("/models/M", {"SGLANG_RELAY_CONFIG": '{"max_ratio": 0.5}'})
    server = {"num_layers": 30, "capture_layer": None, "context_layer": None}
    for target, rule in [(0.8, "deviation"), (0.95, "first_k")]:
        cfg, point = resolve_config(settings, {"reuse": target}, **server)
        assert point.rule == rule and cfg == point.config, (target, cfg)
        assert cfg.max_ratio < 0.5
        for n in (40, 300, 1000):
            assert _span_reuse(cfg, 30, n, rng) >= target - 1e-9
    # a schedule the operator set is kept at every target it can reach
    env = {"SGLANG_RELAY_CONFIG": '{"l_start": 2, "l_det": 3, "first_k": 4, "max_ratio": 0.5}'}
    settings = settings_from_env("/models/M", env)
    server = {"num_layers": 30, "capture_layer": 2, "context_layer": None}
    for target in (0.8, 0.95):
        cfg, point = resolve_config(settings, {"reuse": target}, **server)
        assert point.rule == "deviation" and cfg == point.config
        assert (cfg.l_start, cfg.l_det, cfg.first_k) == (2, 3, 4) and cfg.max_ratio < 0.5
        for n in (40, 300, 1000):
            assert _span_reuse(cfg, 30, n, rng) >= target - 1e-9
    # a request's own overrides still apply on top
    cfg, _ = resolve_config(settings, {"reuse": 0.8, "config": {"first_k": 9}}, **server)
    assert cfg.first_k == 9
