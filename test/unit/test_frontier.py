"""``bench fidelity --frontier``: the knob sweep, the reuse it produces, the CLI flag and the
packaged evaluation workloads. Seconds: a tiny randomly initialised Llama, no weights."""

from __future__ import annotations

import re

import pytest
import torch

from sglang_relay.bench.frontier import evaluate_points, sweep_points
from sglang_relay.bench.workload import Agent, Case, RelayCase, load_workload
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference import RefModel, SpanOccurrence, generate

# the shipped profile's rule for the 30-layer embedded model: (3, 4, 29), first 24, tau 1.0
PROFILE_30 = RelayConfig(l_start=3, l_det=4, l_end=29, tau_dev=1.0, l_suf=0, first_k=24)


def test_knobs_invert_the_reuse_formula():
    """reuse = 1 - (|S| dense + |I| sparse) / (|S| L), solved for |I| / |S| by hand:
    CacheBlend (0, 1, 29): dense 1, sparse 29; EPIC (0, 0, 29): sparse 30; relay (3, 4, 29):
    dense 1, sparse 26. Ratios are rounded down to 3 decimals (the profiler's cap rule), k
    to the nearest token at a 200-token mean span."""
    points = sweep_points(PROFILE_30, 30, 200.0, [0.98, 0.70, 0.80, 0.90])
    got: dict[str, list] = {}
    for p in points:
        got.setdefault(p.method, []).append((p.target, p.value))
        assert getattr(p.config, p.knob) == p.value if p.knob else p.value is None
    assert got["naive"] == [(None, None)]
    # 0.98 is out of reach for both: their dense layer alone recomputes 1/30 > 0.02
    assert got["cacheblend"] == [(0.70, 0.275), (0.80, 0.172), (0.90, 0.068)]  # 8/29 5/29 2/29
    assert got["epic"] == [(0.70, 60), (0.80, 40), (0.90, 20), (0.98, 4)]
    # relay at 0.90 and 0.98: its dense layer would take more than a fifth of the 3 and 0.6
    # token-layers per token, so the position rule runs (30 sparse layers): 3/30, 0.6/30
    assert got["relay"] == [(0.70, 0.307), (0.80, 0.192), (0.90, 0.099), (0.98, 0.019)]
    position = [p.target for p in points if p.method == "relay" and p.config.signal == "none"]
    assert position == [0.90, 0.98]
    # up to 0.80 relay's sweep keeps the profile's rule and moves the cap only (8/26 5/26)
    relay_cfgs = [p.config for p in points if p.method == "relay" and p.target <= 0.8]
    assert {(c.l_start, c.l_det, c.l_end, c.tau_dev, c.first_k) for c in relay_cfgs} == {
        (3, 4, 29, 1.0, 24)
    }
    cb = next(p.config for p in points if p.method == "cacheblend")
    assert (cb.l_start, cb.l_det, cb.l_end, cb.signal) == (0, 1, -1, "key")
    # a knob value that repeats is run once
    dup = sweep_points(PROFILE_30, 30, 10.0, [0.80, 0.81], methods=["epic"])
    assert [(p.target, p.value) for p in dup] == [(0.80, 2)]  # round(2.0), round(1.9)
    assert sweep_points(PROFILE_30, 30, 10.0, [0.96], methods=["epic"]) == []  # k 0


@pytest.fixture(scope="module")
def tiny() -> RefModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    return RefModel(LlamaForCausalLM(cfg).float())


def _relay(ref: RefModel, n: int, seed: int) -> RelayCase:
    """An upstream decode of ``n + 1`` forced tokens whose first ``n`` reappear behind a
    different prefix in the downstream prompt."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 96, (n + 1,), generator=g).tolist()
    up_prompt = torch.randint(3, 96, (7,), generator=g).tolist()
    (rec,) = generate(ref, [up_prompt], n + 1, force=[text])
    prompt = torch.randint(3, 96, (11,), generator=g).tolist() + text[:n] + [5, 6, 7]
    (cont,) = generate(ref, [prompt], 4, capture=False)
    case = Case(f"t{seed}", "t", "", (Agent("A", "", ""),), Agent("B", "", "{A}"))
    return RelayCase(case, [rec], prompt, cont.output, [SpanOccurrence(11, rec, 0, n)])


def test_measured_reuse_matches_the_formula_and_is_monotone(tiny):
    """On two relays (spans of 41 and 57 tokens) through the reference executor, each
    point's pooled reuse equals METHOD.md's formula with the token counts each rule must
    pick: CacheBlend round(r n) (>= 1), EPIC min(k, n), relay's cap floor(cap n) (threshold 0:
    every token qualifies, so the cap binds); and it rises as the knob falls."""
    lengths = (41, 57)
    relays = [_relay(tiny, n, seed) for seed, n in enumerate(lengths)]
    relay_cfg = RelayConfig(l_start=1, l_det=2, l_end=-1, tau_dev=0.0, l_suf=0, first_k=0)
    targets = [0.35, 0.55, 0.65, 0.85]
    points = sweep_points(relay_cfg, 10, 49.0, targets)
    rows = evaluate_points(tiny, iter(relays), points)
    layers, total = 10, sum(lengths)

    def pooled(per_span) -> float:
        return 1.0 - sum(per_span(n) for n in lengths) / (total * layers)

    by_method: dict[str, list[tuple]] = {}
    for p, row in zip(points, rows, strict=True):
        assert row["n_relays"] == 2 and row["label"] == p.label
        if p.method == "naive":
            want = 1.0
        elif p.method == "cacheblend":  # layer 0 dense, then 9 sparse layers
            want = pooled(lambda n, r=p.value: n * 1 + max(1, round(r * n)) * 9)
        elif p.method == "epic":  # 10 sparse layers
            want = pooled(lambda n, k=p.value: min(k, n) * 10)
        elif p.config.signal == "none":  # relay's position rule (1 dense > budget / 5)
            assert p.target > 0.35
            want = pooled(lambda n, c=p.value: int(c * n) * 10)
        else:  # relay (1, 2, 9): layer 1 dense, 8 sparse
            want = pooled(lambda n, c=p.value: n * 1 + int(c * n) * 8)
        assert row["reuse_rate"] == pytest.approx(want, abs=1e-12), p.label
        assert row["first_token_kl"] >= 0.0 and 0.0 <= row["tf_top1_agreement_64"] <= 1.0
        by_method.setdefault(p.method, []).append((p.value, row["reuse_rate"], p.target))
    for method in ("cacheblend", "epic", "relay"):
        pts = by_method[method]
        assert len(pts) >= 3, method
        knobs = [v for v, _, _ in pts]
        reuses = [r for _, r, _ in pts]
        assert knobs == sorted(knobs, reverse=True) and reuses == sorted(reuses), method
        assert len(set(reuses)) == len(reuses), method
        for _, reuse, target in pts:  # each point lands near its target
            assert abs(reuse - target) < 0.03, (method, reuse, target)


def test_relay_points_follow_the_profile_frontier(tiny):
    """With a profile frontier, relay's point for a target is the frontier's (here the
    position-only rule above 0.7): its reuse is the formula's with min(k, floor(cap n))
    tokens in all 10 layers, and its logits are EPIC's with that k where the cap does not
    bind (the same tokens in the same layers: signal "none" needs no detection pass)."""
    from dataclasses import replace

    from sglang_relay.core.operating import Frontier, at_target
    from sglang_relay.core.reference import relay_prefill

    lengths = (41, 57)
    relays = [_relay(tiny, n, seed) for seed, n in enumerate(lengths)]
    dev_rule = RelayConfig(l_start=1, l_det=2, l_end=-1, tau_dev=0.0, l_suf=0, first_k=0)
    pos_rule = RelayConfig(l_start=0, l_det=0, l_end=-1, signal="none", l_suf=0, first_k=6)
    rows = [
        {"target": 0.6, "config": at_target(dev_rule, 10, 0.6).to_dict()},
        {"target": 0.8, "config": at_target(pos_rule, 10, 0.8).to_dict()},
    ]
    frontier = Frontier.from_profile({"frontier": rows})
    points = sweep_points(dev_rule, 10, 49.0, [0.6, 0.75], ["relay"], frontier=frontier)
    assert [p.config for p in points] == [frontier.points[0][1], frontier.points[1][1]]
    row = evaluate_points(tiny, iter(relays), points)[1]
    cap = frontier.points[1][1].max_ratio
    want = 1 - sum(min(6, int(cap * n)) * 10 for n in lengths) / (sum(lengths) * 10)
    assert row["reuse_rate"] == pytest.approx(want, abs=1e-12)
    epic = replace(RelayConfig().for_method("epic"), first_k=6)
    for relay in relays:
        mine = relay_prefill(tiny, relay.prompt, relay.spans, points[1].config)
        theirs = relay_prefill(tiny, relay.prompt, relay.spans, epic)
        assert mine.deviation is None and mine.selected == theirs.selected
        assert torch.equal(mine.logits, theirs.logits)


def test_cli_frontier_flag(capsys):
    """The flag is wired through ``sglang-relay bench fidelity`` and rejects bad targets
    and methods before loading any model."""
    from sglang_relay.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "fidelity", "--help"])
    assert "--frontier" in capsys.readouterr().out
    assert main(["bench", "fidelity", "--frontier", "--reuse-targets", "0.8,1.2"]) == 2
    assert "(0, 1)" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--frontier", "--methods", "relay,nope"]) == 2
    assert main(["bench", "fidelity", "--frontier", "--workload", "no_such.jsonl"]) == 2


def test_packaged_evaluation_workloads_are_disjoint_from_calibration():
    """The held-out and HumanEval workloads: other tasks, other agent roles and templates
    than the calibration set, the first evaluation set and each other; no HumanEval
    problem anywhere in calibration (its function names included). The 72-relay held-out
    set shares nothing with any of them: six kinds of its own, twelve relays each. The
    calibration relays count both packaged calibration files (the profiler's default); the
    64 list-heavy ones are eight kinds no evaluation set has, eight relays each."""
    first = load_workload()
    loops = load_workload(name="calibration_loops_workload.jsonl")
    calibration = load_workload(name="calibration_workload.jsonl") + loops
    heldout = load_workload(name="heldout_workload.jsonl")
    humaneval = load_workload(name="humaneval_workload.jsonl")
    large = load_workload(name="humaneval82_workload.jsonl")
    heldout72 = load_workload(name="heldout72_workload.jsonl")

    def agents(cases):
        return [a for c in cases for a in (*c.upstream, c.downstream)]

    for evaluation, sizes, others in (
        (heldout, range(16, 25), (first, calibration)),
        (humaneval, range(16, 25), (first, calibration, heldout)),
        (heldout72, (72,), (first, calibration, heldout, humaneval, large)),
    ):
        assert len(evaluation) in sizes and len({c.id for c in evaluation}) == len(evaluation)
        for other in others:
            assert not {c.task for c in evaluation} & {c.task for c in other}
            for field in ("name", "template", "system"):
                mine = {getattr(a, field) for a in agents(evaluation)}
                assert not mine & {getattr(a, field) for a in agents(other)}, field
        for case in evaluation:
            names = {"task": case.task} | {a.name: "x" for a in case.upstream}
            for agent in (*case.upstream, case.downstream):
                agent.template.format(**names)  # every field is known
            assert all("{" + a.name + "}" in case.downstream.template for a in case.upstream)
    functions = {re.search(r"def (\w+)\(", c.task).group(1) for c in humaneval}
    assert len(functions) == len(humaneval)
    assert not any(f + "(" in c.task for f in functions for c in calibration)
    # the larger HumanEval set (every second problem, >= 64 relays): no calibration task or
    # function, the same roles as the 20-case set, and it contains that set's problems
    assert len(large) == 82 and len({c.id for c in large}) == 82
    assert {c.task for c in humaneval} <= {c.task for c in large}
    assert not {c.task for c in large} & {c.task for c in calibration}
    large_functions = {re.search(r"def (\w+)\(", c.task).group(1) for c in large}
    assert not any(f + "(" in c.task for f in large_functions for c in calibration)
    # the 72-relay held-out set: distinct tasks, 6 new kinds x 12, >= 12 two-upstream relays
    assert len({c.task for c in heldout72}) == 72
    kinds = [c.kind for c in heldout72]
    assert len(set(kinds)) == 6 and all(kinds.count(k) == 12 for k in kinds)
    used = {c.kind for s in (first, calibration, heldout, humaneval, large) for c in s}
    assert not set(kinds) & used
    assert sum(len(c.upstream) == 2 for c in heldout72) >= 12
    loop_kinds = [c.kind for c in loops]
    assert len({c.task for c in loops}) == 64 and len({c.id for c in loops}) == 64
    assert len(set(loop_kinds)) == 8 and all(loop_kinds.count(k) == 8 for k in loop_kinds)
    assert not set(loop_kinds) & {
        c.kind for s in (first, heldout, humaneval, large, heldout72) for c in s
    }


def _rows(method: str, kls: list[float], top1: list[int]) -> dict:
    from sglang_relay.bench.evaluation import summarize

    per = [
        {
            "id": f"r{i}",
            "first_token_kl": kl,
            "top1": t,
            "tf_top1": 0.9,
            "greedy_prefix": 0.5,
            "first_divergence": 3,
            "tf_tokens": 64,
            "reuse_rate": 0.9,
            "span_tokens": 100,
            "selected": 10,
            "seconds": 0.1,
            "collapsed": 0,
            "rouge_l": 0.5,
        }  # fmt: skip
        for i, (kl, t) in enumerate(zip(kls, top1, strict=True))
    ]
    row = summarize(method, per, 30)
    row.update(method=method, target=0.9, per_relay=per)
    return row


def test_verdicts_compare_relay_with_the_best_baseline_of_each_measure_paired():
    from sglang_relay.bench.frontier_report import measure_verdicts, verdict_table

    n = 24
    relay = _rows("relay", [0.01 * (1 + i % 5) for i in range(n)], [1] * (n - 6) + [0] * 6)
    epic = _rows("epic", [0.02 * (1 + i % 5) for i in range(n)], [1] * n)
    blend = _rows("cacheblend", [0.03 * (1 + i % 5) for i in range(n)], [1] * (n - 1) + [0])
    found = {m: (base, word) for m, base, _, word in measure_verdicts(relay, [epic, blend])}
    assert found["first_token_kl"] == ("epic", "better")  # half of epic's on every relay
    assert found["top1_agreement"] == ("epic", "worse")  # 6 of 24 flipped, epic none
    assert found["tf_top1_agreement_64"][1] == "tie"  # equal everywhere
    assert found["collapse_rate"][1] == "tie"
    assert "ci" in relay and relay["ci"]["first_token_kl"][0] < relay["first_token_kl"]
    table = verdict_table([relay, epic, blend])
    assert "| 0.90 | first_token_kl | epic |" in table and "worse" in table


def test_profiler_frontier_tries_a_head_floor_under_the_context_rules(tiny):
    """The profiler's operating points (``run_frontier`` on two relays, targets 0.7 and
    0.9, ``--head-floors 8``): beside the plain context and probe rules each target tries
    them with the head floor. A head-floor candidate recomputes each span's first tokens,
    then the highest context masses, inside the same cap: checked against a brute-force
    pick from the masses the plain context rule reports. Every point keeps its target on
    every relay."""
    from dataclasses import replace
    from types import SimpleNamespace

    from sglang_relay.core.operating import rule_name
    from sglang_relay.core.reference import exact_prefill, relay_prefill
    from sglang_relay.profiler.rules import context_rule, run_frontier
    from sglang_relay.profiler.search import Search

    relays = [_relay(tiny, n, seed) for seed, n in enumerate((41, 57))]
    exacts = [exact_prefill(tiny, r.prompt, forced=r.continuation[:-1]) for r in relays]

    def replace_k(cfg: RelayConfig, k: int) -> RelayConfig:
        return replace(cfg, first_k=k)

    bar = SimpleNamespace(update=lambda _n: None, set_postfix_str=lambda _s: None)
    search = Search(tiny, relays, exacts, 0.8, bar)
    rule = RelayConfig(l_start=1, l_det=2, l_end=-1, tau_dev=0.0, l_suf=0, first_k=0)
    points = run_frontier(search, rule, 10, 49.0, [0.7, 0.9], quick=True, head_floors=(8,))
    assert [p["target"] for p in points] == [0.7, 0.9]
    tried = [RelayConfig.from_dict(e["config"]) for e in search.log]
    for target, point in zip((0.7, 0.9), points, strict=True):
        assert point["metrics"]["reuse_min"] >= target
    head = 8
    heads = [c for c in tried if c.ranks_context and c.first_k == head]
    assert len({c.l_ctx for c in heads}) == 1  # at the picked layer only
    for target in (0.7, 0.9):
        cap = context_rule(10, target, heads[0].l_ctx).max_ratio
        at = [c for c in heads if c.max_ratio == cap]
        assert sorted(c.probes for c in at) == [False, True]
        assert all(replace_k(c, 0) in tried for c in at)  # beside the plain rule
    ctx = replace_k(next(c for c in heads if not c.probes), 0)
    for relay in relays:
        n = relay.spans[0].length
        masses = relay_prefill(tiny, relay.prompt, relay.spans, ctx).deviation
        got = relay_prefill(tiny, relay.prompt, relay.spans, replace_k(ctx, head))
        cap = int(ctx.max_ratio * n)
        want = torch.zeros(n, dtype=torch.bool)
        want[:head] = True
        rest = masses.clone()
        rest[:head] = float("-inf")
        want[rest.topk(cap - head).indices] = True
        assert cap > head and torch.equal(got.selected_mask, want)
        assert rule_name(replace_k(ctx, head)) == "context+head"
