"""The open-loop serving bench's arithmetic: arrivals, mix, percentiles, goodput, prompts."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_relay.bench import chain_kinds, serve, serve_report
from sglang_relay.bench.serve_report import ChainRun


def test_arrivals_are_a_poisson_process_at_the_rate():
    times = serve.arrivals(30.0, 20 * 60.0, seed=3)  # 30/min for 20 min: ~600 arrivals
    assert times == sorted(times) and 0 < times[0] and times[-1] < 1200
    assert len(times) == pytest.approx(600, rel=0.1)
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(2.0, rel=0.1)  # exponential: mean = sd = 60/rate
    assert gaps.std() == pytest.approx(2.0, rel=0.15)
    assert serve.arrivals(30.0, 60.0, seed=3) == serve.arrivals(30.0, 60.0, seed=3)
    assert serve.arrivals(0, 60.0, seed=1) == []


def test_mix_is_normalized_and_checked():
    assert chain_kinds.parse_mix("pipeline:3,plain:1") == {"pipeline": 0.75, "plain": 0.25}
    with pytest.raises(ValueError, match="unknown chain kind"):
        chain_kinds.parse_mix("pipeline:1,swarm:1")
    with pytest.raises(ValueError):
        chain_kinds.parse_mix("plain:0")


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(1.0, size=37))
    for q in (0, 50, 90, 99, 100):
        assert serve_report.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert serve_report.percentile([], 50) is None


def test_goodput_is_the_highest_rate_before_the_slo_is_first_missed():
    rows = [
        {"rate": 2, "ttft_p99": 0.4},
        {"rate": 4, "ttft_p99": 0.9},
        {"rate": 8, "ttft_p99": 3.0},
        {"rate": 16, "ttft_p99": 0.8},  # past saturation a lucky pass does not count
    ]
    assert serve_report.goodput(rows, 1.0) == 4
    assert serve_report.goodput(rows, 0.5) == 2
    assert serve_report.goodput(rows, 0.3) == 0
    assert (
        serve_report.goodput([{**r, "incomplete": 1} if r["rate"] == 4 else r for r in rows], 1.0)
        == 2
    )


def test_downstream_prompts_quote_earlier_outputs_verbatim():
    outs = ["first output text", "second output text", "third output text"]
    for kind, n in (("pipeline", 2), ("fanin", 3), ("groupchat", 3)):
        system, user, quotes = chain_kinds.chain_prompts(kind, 7, "B-trees", outs[:n])
        assert quotes and all(o in user for o in outs[:n]), (kind, user)
    _, user, quotes = chain_kinds.chain_prompts("plain", 7, "B-trees", [])
    assert not quotes and "B-trees" in user
    _, _, quotes = chain_kinds.chain_prompts("fanin", 7, "B-trees", outs[:1])  # an expert
    assert not quotes
    _, _, quotes = chain_kinds.chain_prompts("fanout", 7, "B-trees", [])  # the lead
    assert not quotes
    systems = set()
    for i in range(1, chain_kinds.AGENTS["fanout"]):  # every worker quotes the lead's brief
        system, user, quotes = chain_kinds.chain_prompts("fanout", 7, "B-trees", outs[:1], i)
        assert quotes and outs[0] in user and outs[1] not in user
        systems.add(system)
    # each worker its own role ahead of the brief: the prefix cache cannot serve the brief
    assert len(systems) == chain_kinds.AGENTS["fanout"] - 1


def test_summary_counts_relayed_tokens_and_fallbacks():
    rec = serve_report.Record
    chains = [
        ChainRun(0.0, "pipeline", 2, [rec(0, "pipeline", 0, False, 0.3, 1.0, 100),
                 rec(0, "pipeline", 1, True, 0.1, 1.0, 300,
                     {"reused_tokens": 150, "spans_matched": 1, "reuse_rate": 0.8})], 2.0),
        ChainRun(1.0, "plain", 1, [rec(1, "plain", 0, False, 0.5, 1.0, 100,
                                       {"fallback": "span_evicted: x"})], 4.0),
    ]  # fmt: skip
    row = serve_report.summarize("relay", 4.0, chains, [], arrived=3, incomplete=1, elapsed_s=60.0)
    assert row["completed"] == 2 and row["chains_per_min"] == 2.0 and row["incomplete"] == 1
    assert row["relayed_prompt_share"] == pytest.approx(150 / 500)
    assert row["fallbacks"] == {"span_evicted": 1}
    assert row["ttft_relayable_p50"] == pytest.approx(0.1)
    assert row["chain_latency_p50"] == pytest.approx(3.0)
    assert row["reuse_rate_mean"] == pytest.approx(0.8)


def test_only_the_last_agent_of_a_chain_answers_short():
    assert chain_kinds.output_lengths("pipeline", 256, 32) == [256, 256, 32]
    assert chain_kinds.output_lengths("fanin", 256, 32) == [256, 256, 256, 32]
    assert chain_kinds.output_lengths("groupchat", 96, None) == [96] * 4
    assert chain_kinds.output_lengths("plain", 256, 32) == [256]  # reads nothing: not an answer
    assert chain_kinds.output_lengths("fanout", 256, 16) == [256] + [16] * 4  # every worker answers


def test_tpot_and_per_kind_latency_are_reported():
    rec = serve_report.Record
    # 0.3 s to the first token, then 31 more tokens in 3.1 s: 100 ms per output token
    a = rec(0, "fanin", 0, False, 0.3, 3.4, 100, output_tokens=32)
    b = rec(0, "fanin", 1, True, 0.2, 0.2, 300, output_tokens=1)  # one token: no TPOT
    c = rec(1, "plain", 0, False, 0.5, 2.5, 100, output_tokens=11)  # 200 ms per token
    assert a.tpot_s == pytest.approx(0.1) and b.tpot_s is None
    chains = [ChainRun(0.0, "fanin", 2, [a, b], 4.0), ChainRun(1.0, "plain", 1, [c], 2.5),
              ChainRun(2.0, "fanin", 1, [a], 6.0)]  # fmt: skip
    row = serve_report.summarize("relay", 4.0, chains, [], arrived=3, incomplete=0, elapsed_s=60.0)
    assert row["tpot_p50"] == pytest.approx(0.1) and row["tpot_p99"] == pytest.approx(0.198)
    assert row["chain_ttfts"] == [[0.3, 0.2], [0.5], [0.3]]  # in arrival order
    assert row["chain_latency_p50_by_kind"] == {"fanin": pytest.approx(5.0), "plain": 2.5}


def test_goodput_curve_is_goodput_at_each_slo(tmp_path):
    rows = [
        {"method": m, "rate": rate, "ttft_p99": p99, "incomplete": 0,
         "chain_latency_p50": 10.0 * rate, "chain_latency_max": 20.0 * rate}
        for m, pts in (("standard", ((2, 1.5), (4, 3.0))), ("relay", ((2, 0.8), (4, 1.2))))
        for rate, p99 in pts
    ]  # fmt: skip
    curve = serve_report.goodput_curve(rows, [1.0, 2.0, 4.0])
    assert curve == {"standard": [0, 2, 4], "relay": [2, 4, 4]}
    pytest.importorskip("matplotlib")  # the bench extra
    out = tmp_path / "serve.png"
    serve_report.plot(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_tail_has_a_p99_only_from_a_hundred_requests():
    xs = [float(i) for i in range(99)]
    t = serve_report.tail(xs)
    assert t["p99"] is None and t["max"] == 98.0
    assert t["p90"] == pytest.approx(np.percentile(xs, 90))
    assert serve_report.tail(xs + [99.0])["p99"] == pytest.approx(np.percentile(xs + [99.0], 99))
    rows = [{"rate": 2, "ttft_p99": None, "ttft_p90": 1.0}, {"rate": 4, "ttft_p99": 2.0}]
    assert serve_report.tail_key(rows) == "ttft_p90"


def _run(method, rate, seed, chains):
    p90 = float(np.percentile([t for c in chains for t in c], 90))
    return {"method": method, "rate": rate, "seed": seed, "chain_ttfts": chains,
            "arrived_per_min": rate, "errors": 0, "incomplete": 0, "ttft_p90": p90,
            "ttft_p99": None}  # fmt: skip


def test_seeds_pool_into_a_ttft_ratio_whose_interval_resamples_chains():
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(3):  # standard twice as slow as relay, chain for chain
        slow = [list(rng.uniform(1.5, 2.5, size=5)) for _ in range(12)]
        rows += [_run("standard", 4, seed, slow),
                 _run("relay", 4, seed, [[t / 2 for t in c] for c in slow])]  # fmt: skip
    point = next(p for p in serve_report.seeded(rows, [1.0])["points"] if p["method"] == "relay")
    assert point["seeds"] == 3 and point["requests"] == 180
    ratio, lo, hi = point["ttft_p90_ratio"]
    assert ratio == pytest.approx(2.0)  # pooled p90 of halved values: exactly half
    assert lo < 2.0 < hi and lo > 1.5  # chains resampled independently per method
    same = [_run(m, 4, 0, [[1.0, 2.0, 3.0]] * 10) for m in ("standard", "relay")]
    point = serve_report.seeded(same, [1.0])["points"][0]
    assert point["ttft_p50_ratio"] == pytest.approx((1.0, 1.0, 1.0))  # nothing to resample
    summary = serve_report.seeded(rows, [1.0, 3.0])
    assert summary["goodput_key"] == "ttft_p90"  # no run holds 100 requests
    # relay's p90 is about 1.2 s, standard's about 2.4 s: goodput 4 at 3 s for both, at 1 s
    # neither
    assert summary["goodput_per_seed"]["0"] == {"standard": [0, 4], "relay": [0, 4]}
    assert "2.00 [" in serve_report.seeded_markdown(summary)


def test_a_request_that_never_finished_is_a_miss_of_every_slo():
    rec = serve_report.Record
    done = [ChainRun(float(k), "deep", 2, [rec(k, "deep", 1, True, 0.2, 1.0, 100),
                                           rec(k, "deep", 0, False, 0.4, 1.0, 100)], 5.0)
            for k in range(4)]  # fmt: skip
    stuck = ChainRun(9.0, "deep", 2, [rec(9, "deep", 0, False, 0.3, 1.0, 100)])  # one of two
    row = serve_report.summarize("relay", 6.0, [stuck, *done], [], 5, 1, 60.0)
    assert row["completed"] == 4 and row["censored"] == 1 and row["requests"] == 9
    # agent order within a chain, arrival order across chains, the censored one as None
    assert row["chain_ttfts_all"] == [[0.4, 0.2]] * 4 + [[0.3, None]]
    assert row["ttft_p90"] == pytest.approx(np.percentile([0.4, 0.2] * 4 + [0.3], 90))
    assert row["ttft_all_max"] is None  # beyond the run
    every = [0.4, 0.2] * 4 + [0.3, 1e9]  # numpy's p50 with a huge stand-in for the miss
    assert row["ttft_all_p50"] == pytest.approx(np.percentile(every, 50))
    assert row["ttft_all_p90"] is None  # one in ten censored: the p90 is a miss
    assert serve_report.percentile([1.0, float("inf")], 0) == 1.0
    assert serve_report.percentile([1.0, 2.0, float("inf")], 50) == 2.0


def test_deep_chains_and_tool_loops_quote_earlier_outputs_past_a_changed_head():
    outs = [f"output number {j}" for j in range(5)]
    for i in range(1, chain_kinds.AGENTS["deep"]):
        system, user, quotes = chain_kinds.chain_prompts("deep", 3, "B-trees", outs[:i])
        assert quotes and all(o in user for o in outs[:i]) and outs[i] not in user
    turns = [chain_kinds.chain_prompts("toolloop", 3, "B-trees", outs[:i])
             for i in range(chain_kinds.TOOL_TURNS)]  # fmt: skip
    assert [q for _, _, q in turns] == [False, True, True]
    assert len({system for system, _, _ in turns}) == 1  # the same agent every turn
    first, second, third = (user for _, user, _ in turns)
    assert first[:5] == second[:5] and first[:6] != second[:6]  # "Turn 1" / "Turn 2": no prefix
    assert outs[0] in second and outs[0] in third and outs[1] in third
    tool = chain_kinds.tool_output(3, 0)
    assert tool in second and tool == chain_kinds.tool_output(3, 0) != chain_kinds.tool_output(4, 0)
    assert chain_kinds.output_lengths("deep", 96, 16) == [96] * 4 + [16]
    assert chain_kinds.output_lengths("toolloop", 96, 16) == [96, 96, 16]
    rng = __import__("random").Random(0)
    pauses = serve.tool_pauses("toolloop", rng, (30.0, 120.0))
    assert len(pauses) == 2 and all(30 <= p <= 120 for p in pauses)
    assert serve.tool_pauses("deep", rng, (30.0, 120.0)) == []


def test_a_fixed_count_of_arrivals_takes_as_long_as_it_takes():
    times = serve.arrivals(6.0, 0.0, seed=5, count=30)
    assert len(times) == 30 and times == sorted(times)
    assert times == serve.arrivals(6.0, 3600.0, seed=5)[:30]  # the same process, cut by count
    # common random numbers: one seed's sequence at twice the rate is the same, twice as dense
    assert serve.arrivals(12.0, 0.0, seed=5, count=30) == pytest.approx([t / 2 for t in times])


def test_a_request_the_server_aborted_counts_only_if_a_token_came_first(monkeypatch):
    """The run's end aborts the server's stragglers; SGLang streams their abort as a normal
    final chunk, whose arrival is no first token unless a token came before it."""
    from sglang_relay.client import Generation

    tokens = {"n": 0}

    def fake(url, text, params):
        meta = {"finish_reason": {"type": "abort", "message": "Abort all requests."},
                "completion_tokens": tokens["n"]}  # fmt: skip
        return Generation(text="", ttft_s=0.01, latency_s=0.5, meta=meta)

    monkeypatch.setattr(serve, "generate", fake)
    monkeypatch.setattr(serve, "chat_prompt", lambda tok, system, user: user)
    seen = []
    record = lambda rec, at: seen.append((rec.agent, rec.ttft_s))  # noqa: E731
    with pytest.raises(RuntimeError, match="aborted"):
        serve.run_chain("http://x", None, "deep", 0, "B-trees", None, 40, on_record=record)
    assert seen == []  # no token: censored
    tokens["n"] = 3  # the first token came, then the abort: its TTFT is real, the chain ends
    with pytest.raises(RuntimeError, match="aborted"):
        serve.run_chain("http://x", None, "deep", 0, "B-trees", None, 40, on_record=record)
    assert seen == [(0, 0.01)]


def test_a_turn_still_waiting_for_its_tool_has_not_arrived():
    rec = serve_report.Record
    first = rec(0, "toolloop", 0, False, 0.2, 1.0, 100)
    pausing = ChainRun(0.0, "toolloop", 3, [first], pausing=True)  # the run ended in a pause
    stuck = ChainRun(1.0, "toolloop", 3, [first])  # its second turn never finished
    assert pausing.slots() == [0.2] and stuck.slots() == [0.2, float("inf"), float("inf")]
    fan = ChainRun(2.0, "fanout", 3, [rec(2, "fanout", 2, True, 0.5, 1.0, 9),
                                      rec(2, "fanout", 0, False, 0.1, 1.0, 9)])  # fmt: skip
    assert fan.slots() == [0.1, float("inf"), 0.5]  # each at its agent's place
    row = serve_report.summarize("relay", 6.0, [pausing, stuck, fan], [], 3, 2, 60.0)
    assert row["pending_tool"] == 2 and row["censored"] == 3
    assert row["chain_ttfts_all"] == [[0.2], [0.2, None, None], [0.1, None, 0.5]]


def test_the_host_watch_reports_the_runs_shares_of_steal_and_idle(tmp_path):
    from sglang_relay.bench.host import HostWatch

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n")
    watch = HostWatch(stat)
    # over the run: 300 user, 100 system, 400 idle, 0 iowait, 200 steal (1000 ticks)
    stat.write_text("cpu  400 0 150 1200 10 0 0 240 0 0\ncpu0 1 2 3\n")
    out = watch.summary()
    assert out["steal_share"] == 0.2 and out["idle_share"] == 0.4
    assert HostWatch(tmp_path / "absent").summary() == {}


def test_phase_times_are_the_relay_states_phase_keys_only():
    from sglang_relay.bench.traffic import phase_times

    state = {"phase_match_ms": 3.5, "phase_match_n": 2, "fallbacks": 1, "pool": {"total": 8}}
    assert phase_times(state) == {"match_ms": 3.5, "match_n": 2.0}


def test_a_runs_counters_are_deltas_with_fallback_reasons_and_host_tier_counts_that_moved():
    from sglang_relay.bench.traffic import SERVER_COUNTERS, counter_deltas

    before = {"recorded_spans": 4, "fallback_span_evicted": 1, "fallback_guard": 2,
              "host_restores": 3, "host_tokens": 900, "host_spans": 7, "host_ttl_s": 600.0,
              "host_flag": False, "hicache": True}  # fmt: skip
    after = {"recorded_spans": 10, "fallback_span_evicted": 4, "fallback_guard": 2,
             "host_restores": 5, "host_evicted_ttl": 2, "host_tokens": 100, "host_spans": 1,
             "host_ttl_s": 60.5, "host_flag": True, "demoted_spans": 3, "hicache": True,
             "pool": {"total": 8}}  # fmt: skip
    out = counter_deltas(before, after)
    # every named counter, moved or not; of the families only what moved, no gauge
    assert {k: out.pop(k) for k in SERVER_COUNTERS} == {k: 6 if k == "recorded_spans" else 0
                                                       for k in SERVER_COUNTERS}  # fmt: skip
    assert out == {"fallback_span_evicted": 3, "host_restores": 2, "host_evicted_ttl": 2,
                   "demoted_spans": 3}  # fmt: skip
