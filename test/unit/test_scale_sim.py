"""The scale-out simulation (research/studies/scale_sim.py) against independent references: a
replay of the span store on one worker, analytic hit rates of round robin and chain keys,
brute-force LRU and prefix-tree models, and the runtime's own ``SpanStore`` and
``DPRouter``."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "research" / "studies" / "scale_sim.py"
_SPEC = importlib.util.spec_from_file_location("scale_sim", _PATH)
sim = importlib.util.module_from_spec(_SPEC)
sys.modules["scale_sim"] = sim  # dataclasses resolve annotations through sys.modules
_SPEC.loader.exec_module(sim)

CHEAP = sim.Costs(standard=1e-5, relay=3e-6, prefix_hit=3e-6, decode=0.01)
PIPELINE2 = sim.Workload(mix=(("pipeline", 1.0),), pipeline_agents=(2, 2))


def _run(trace, n, policy, *, span_budget=10**9, pool_tokens=0, costs=CHEAP):
    """One simulation; ``pool_tokens=0`` turns SGLang's prefix cache off, so every reused
    pasted token is a relay."""
    pol = sim.make_policy(policy, n)
    return sim.Simulation(trace, n, pol, costs, span_budget, pool_tokens).run()


def _downstream(s):
    return [r for r in s.requests if r.relayable > 0]


def test_one_worker_every_policy_relays_what_a_replayed_store_holds():
    trace = sim.make_trace(sim.Workload(), 40, rate=0.5, seed=3)
    runs = {p: _run(trace, 1, p, span_budget=3000) for p in sim.POLICIES}
    relayed = {p: [(r.cid, r.agent, r.relayed) for r in s.requests] for p, s in runs.items()}
    assert len({tuple(v) for v in relayed.values()}) == 1  # one worker: routing is moot

    # Brute force: replay adds (output decoded) and uses (prefill start) in time order on a
    # plain list, oldest first, with the store's budget rule.
    s = runs["round_robin"]
    events = []
    for r in s.requests:
        agent = trace.chains[r.cid].agents[r.agent]
        finish = r.issued + r.ttft + CHEAP.decode * trace.seg_len[agent.out_seg]
        events.append((finish, 0, agent.out_seg, r))
        events.append((r.start, 1, agent.out_seg, r))
    events.sort(key=lambda e: (e[0], e[1]))
    store: list[int] = []
    want = {}
    for _, kind, out, r in events:
        if kind == 0:
            store.append(out)
            while sum(trace.seg_len[x] for x in store) > 3000 and len(store) > 1:
                store.pop(0)
        else:
            got = 0
            for span in r.spans:
                if span in store:
                    got += trace.seg_len[span]
                    store.remove(span)
                    store.append(span)
            want[r.cid, r.agent] = got
    assert [x for *_, x in relayed["round_robin"]] == [want[c, a] for c, a, _ in relayed["prefix"]]
    relayable = sum(r.relayable for r in _downstream(s))
    evicted = relayable - sum(want.values())
    assert evicted > 0  # the budget bit: the replay has misses to agree on
    assert sim.summarize(s, (0, 1))["hit_rate"] == pytest.approx(sum(want.values()) / relayable)


def test_one_worker_without_eviction_relays_everything():
    trace = sim.make_trace(sim.Workload(), 30, rate=0.5, seed=4)
    for policy in sim.POLICIES:
        s = _run(trace, 1, policy)
        assert all(r.relayed == r.relayable for r in s.requests)


def test_chain_key_relays_every_downstream_token_of_sequential_chains():
    trace = sim.make_trace(sim.Workload(mix=(("pipeline", 1.0),)), 200, rate=2.0, seed=5)
    keyed = _downstream(_run(trace, 8, "chain_key"))
    assert keyed and all(r.relayed == r.relayable for r in keyed)
    spread = _downstream(_run(trace, 8, "round_robin"))
    assert sum(r.relayed for r in spread) < 0.5 * sum(r.relayable for r in spread)


def test_round_robin_sends_a_lone_chains_next_agent_to_another_worker():
    trace = sim.make_trace(PIPELINE2, 30, rate=1e-4, seed=6)  # one chain at a time
    assert all(r.relayed == r.relayable for r in _downstream(_run(trace, 1, "round_robin")))
    for n in (2, 3):
        down = _downstream(_run(trace, n, "round_robin"))
        assert down and all(r.relayed == 0 for r in down)


@pytest.mark.parametrize("n", [2, 4])
def test_round_robin_with_many_concurrent_chains_hits_one_in_n(n):
    trace = sim.make_trace(PIPELINE2, 2000, rate=20.0, seed=7)  # hundreds in flight
    down = _downstream(_run(trace, n, "round_robin"))
    full = sum(r.relayed == r.relayable for r in down) / len(down)
    assert full == pytest.approx(1 / n, abs=0.04)


def test_span_lru_matches_a_brute_force_list_model():
    rng = random.Random(8)
    lru, model, sizes = sim.SpanLRU(budget=1000, min_span=32), [], {}
    for span in range(3000):
        if model and rng.random() < 0.4:  # use a stored span
            used = rng.choice(model)
            lru.touch(used)
            model.remove(used)
            model.append(used)
            continue
        sizes[span] = rng.choice([10, 31, 32, 100, 400, 900, 1500])
        recorded, dropped = lru.add(span, sizes[span])
        assert recorded == (sizes[span] >= 32)
        before = list(model)
        if recorded:
            model.append(span)
            while sum(sizes[s] for s in model) > 1000 and len(model) > 1:
                model.pop(0)
        assert dropped == [s for s in before if s not in model]
        assert list(lru.spans) == model and lru.tokens == sum(sizes[s] for s in model)


def test_span_lru_keeps_the_order_of_the_runtime_span_store():
    torch = pytest.importorskip("torch")
    from sglang_relay.runtime.cache.span_store import SpanStore

    rng = random.Random(9)
    real = SpanStore(min_match=32, max_tokens=2000, release_slots=lambda slots: None)
    mirror = sim.SpanLRU(budget=2000, min_span=32)
    tokens, ids = {}, {}
    for span in range(120):
        if ids and rng.random() < 0.4:
            used = rng.choice([s for s in ids if s in mirror])
            real.find(tokens[used], None)
            mirror.touch(used)
        else:
            n = rng.choice([20, 64, 200, 500, 900])
            tokens[span] = [rng.randrange(50_000) for _ in range(n)]
            z = torch.zeros(n, dtype=torch.int64)
            sid = real.add(tokens[span], z, z, z, None)
            if sid is not None:
                ids[span] = sid
            mirror.add(span, n)
        back = {sid: span for span, sid in ids.items()}
        assert [back[sid] for sid in real.spans] == list(mirror.spans)


class _Unrouted(sim.Policy):
    """Stands for the load-balance method: SGLang decides (DPRouter returns None)."""

    def choose(self, req, state):
        return None


def test_fingerprint_policy_agrees_with_the_runtime_dp_router(tmp_path):
    from sglang_relay.runtime.scale.dp_fingerprints import span_fingerprints
    from sglang_relay.runtime.scale.dp_routing import DPRouter

    rng = random.Random(11)
    n = 4
    router = DPRouter(n, str(tmp_path / "router"), max_imbalance=8)
    policy = sim.Fingerprints(n, _Unrouted(n), use_key=True, max_imbalance=8)
    seg_len, tokens, holders = [], [], {}
    for span in range(40):  # span = segment id; tokens drawn so that no window repeats
        length = rng.randint(40, 700)
        seg_len.append(length)
        tokens.append([rng.randrange(1, 1 << 40) for _ in range(length)])
        for w in rng.sample(range(n), rng.choice([0, 1, 1, 2])):
            router.apply(w, "add", span, span_fingerprints(tokens[span]))
            holders.setdefault(span, set()).add(w)
    compared = 0
    for case in range(300):
        pasted = tuple(rng.sample(range(40), rng.randint(0, 4)))
        prompt = [rng.randrange(1, 1 << 40) for _ in range(rng.randint(0, 50))]
        for span in pasted:
            prompt += tokens[span] + [rng.randrange(1, 1 << 40) for _ in range(rng.randint(0, 9))]
        loads = [rng.randint(0, 14) for _ in range(n)]
        want_held = {}
        for span in pasted:
            for w in holders.get(span, ()):
                want_held[w] = want_held.get(w, 0) + sim.fingerprint_tokens(seg_len[span])
        assert dict(router.held_tokens(prompt)) == want_held
        ranked = sorted(((h, -loads[w]) for w, h in want_held.items()), reverse=True)
        if len(ranked) > 1 and ranked[0] == ranked[1]:
            continue  # an exact tie: the two pick by different (arbitrary) orders
        key = f"chain-{case}" if case % 2 else None
        req = SimpleNamespace(spans=pasted, key=key)
        state = SimpleNamespace(
            trace=SimpleNamespace(seg_len=seg_len), holders=holders, loads=loads
        )
        assert policy.choose(req, state) == router.route(prompt, key, loads, list(range(n)))
        compared += 1
    assert compared > 250
    assert set(policy.decisions) == {"matched", "fallback_overloaded", "key", "fallback"}
    assert policy.decisions == router.decisions


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_prefix_policy_follows_cache_aware_against_brute_force_prefixes():
    rng = random.Random(12)
    n = 4
    seg_len = [rng.randint(10, 300) for _ in range(12)]
    trie = sim.SegmentTrie(seg_len)
    policy = sim.Prefix(n, threshold=0.5, abs_threshold=6, rel_threshold=1.5)
    seen: list[tuple[tuple[int, ...], int]] = []  # (prompt, worker) routed so far, in order
    for _ in range(400):
        prompt = tuple(rng.choice(range(12)) for _ in range(rng.randint(1, 4)))
        loads = [rng.randint(0, 12) for _ in range(n)]
        total = sum(seg_len[s] for s in prompt)
        req = SimpleNamespace(path=trie.path(prompt), prompt_tokens=total)
        got = policy.choose(req, SimpleNamespace(loads=loads, trie=trie))

        least = loads.index(min(loads))
        depth = max((_common(prompt, p) for p, _ in seen), default=0)
        # the deepest shared prefix answers with the first worker routed a prompt through it
        owner = next((w for p, w in seen if depth and _common(prompt, p) >= depth), None)
        if max(loads) - min(loads) > 6 and max(loads) > 1.5 * min(loads):
            want = least
        elif owner is not None and sum(seg_len[s] for s in prompt[:depth]) / total > 0.5:
            want = owner
        else:
            want = least
        assert got == want
        seen.append((prompt, got))
    assert set(policy.decisions) == {"imbalanced", "prefix_match", "least_load"}


def test_radix_lru_stays_prefix_closed_within_budget():
    rng = random.Random(13)
    seg_len = [rng.randint(5, 80) for _ in range(10)]
    trie = sim.SegmentTrie(seg_len)
    radix = sim.RadixLRU(300, trie)
    parent = {}
    for _ in range(500):
        prompt = tuple(rng.choice(range(10)) for _ in range(rng.randint(1, 5)))
        path = trie.path(prompt)
        for a, b in zip([-1, *path], path, strict=False):
            parent[b] = a
        radix.insert(path)
        assert radix.tokens == sum(trie.tokens[x] for x in radix.nodes) <= 300
        assert all(parent[x] == -1 or parent[x] in radix.nodes for x in radix.nodes)
        if sum(trie.tokens[x] for x in path) <= 300:
            assert radix.match(path) == len(path)  # what was just inserted is cached


def test_fit_costs_recovers_known_per_token_costs():
    std, rel, hit = 2e-3, 5e-4, 4e-4
    rows = []
    for prompt, span in ((300, 250), (600, 512), (1100, 1024)):
        rows.append({"method": "standard", "prompt_tokens": prompt, "ttft_median_s": std * prompt})
        rows.append(
            {
                "method": "relay",
                "prompt_tokens": prompt,
                "reused_tokens": span,
                "ttft_median_s": std * (prompt - span) + rel * span,
            }
        )
        rows.append(
            {"method": "stock_prefix_hit", "prompt_tokens": prompt, "ttft_median_s": hit * prompt}
        )
    costs = sim.fit_costs(
        rows, [{"batch": 4, "plain_tokens_per_s": 40.0}, {"batch": 1, "plain_tokens_per_s": 20.0}]
    )
    assert dataclasses.astuple(costs) == pytest.approx((std, rel, hit, 0.05))


def test_measured_costs_are_the_documented_ones():
    costs = sim.measured_costs()  # docs/scale-out.md quotes these
    assert round(costs.standard * 1e3, 2) == 1.71
    assert round(costs.relay * 1e3, 2) == 0.45
    assert round(costs.prefix_hit * 1e3, 2) == 0.45
    assert round(1 / costs.decode, 1) == 14.0


def test_offered_load_scales_with_n_and_runs_are_deterministic():
    small = sim.Point(2, "fingerprints", chains_per_worker=10, min_chains=20)
    a = sim.run_point(small, CHEAP, seed=1)
    assert a == sim.run_point(small, CHEAP, seed=1)
    assert a != sim.run_point(small, CHEAP, seed=2)
    big = sim.run_point(sim.Point(8, "fingerprints", chains_per_worker=10, min_chains=20), CHEAP, 1)
    assert big["chain_rate"] == pytest.approx(4 * a["chain_rate"])


def test_disaggregation_cost_against_hand_arithmetic():
    """Llama-3-8B on one GPU and Llama-3-70B on eight, worked by hand from their configs."""
    llama8, llama70 = sim.SHAPES
    # 8B: K and V of 8 heads x 128 dims in 32 layers, bf16; the hidden row (4096 x bf16)
    # and 12 bytes of mass and stamp
    r = sim.disagg_cost(llama8, 1, 400.0)
    assert r["bytes_per_token_per_gpu"] == 2 * 32 * 8 * 128 * 2 + 4096 * 2 + 12 == 139_276
    # its weights per layer: q 4096x4096, k and v 4096x1024, o 4096x4096, MLP 3x4096x14336
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    flops = 2 * 32 * per_layer + 4 * 32 * 32 * 128 * 2048
    assert r["prefill_gflop_per_token"] == round(flops / 1e9, 2)
    saved = 0.8 * flops / (989e12 * 0.5)
    move = 139_276 / 50e9  # 400 Gbit/s = 50 GB/s
    assert r["saved_us"] == pytest.approx(saved * 1e6, abs=0.01)
    assert r["move_us"] == pytest.approx(move * 1e6, abs=0.01)
    assert r["break_even_gbps"] == pytest.approx(139_276 * 8 / saved / 1e9, abs=0.1)
    # 70B at TP 8: one KV head per GPU; the hidden row is whole on every rank
    r70 = sim.disagg_cost(llama70, 8, 100.0)
    assert r70["bytes_per_token_per_gpu"] == 2 * 80 * 1 * 128 * 2 + 8192 * 2 + 12
    # more GPUs than KV heads: the heads are replicated, not split below one
    assert sim.disagg_cost(llama8, 16, 100.0)["bytes_per_token_per_gpu"] == (
        2 * 32 * 1 * 128 * 2 + 4096 * 2 + 12
    )
    # without stored hidden rows, and with an FP8 cache, fewer bytes; break-even scales
    lean = sim.disagg_cost(llama8, 1, 400.0, hidden_rows=False, kv_bytes=1)
    assert lean["bytes_per_token_per_gpu"] == 2 * 32 * 8 * 128 + 12
    assert lean["break_even_gbps"] < r["break_even_gbps"]
