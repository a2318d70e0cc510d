"""Capacity from censored runs: attainment and goodput at the achieved rate against
brute-force counts, block resampling, paired intervals keyed by (rate, seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_relay.bench import capacity


def _row(method, rate, seed, chains, achieved=None, workload="fanout"):
    return {"workload": workload, "method": method, "rate": rate, "seed": seed,
            "arrived_per_min": rate if achieved is None else achieved,
            "chain_ttfts_all": chains}  # fmt: skip


def _brute_share(runs, slo):  # independent: count by hand, a miss (None) never within
    vals = [t for r in runs for c in r["chain_ttfts_all"] for t in c]
    return sum(t is not None and t <= slo for t in vals) / len(vals)


def test_goodput_is_the_highest_achieved_rate_before_the_first_rate_that_misses():
    rng = np.random.default_rng(0)
    rows = []
    for rate, scale, achieved in ((4, 0.5, 3.1), (8, 1.0, 7.4), (16, 3.0, 15.2), (32, 0.4, 30.0)):
        for seed in range(3):  # 32/min "passes" by luck past saturation: does not count
            chains = [list(rng.uniform(0.5, 1.0, 4) * scale) for _ in range(30)]
            rows.append(_row("standard", rate, seed, chains, achieved + seed * 0.1))
    per_rate = capacity.by_workload(rows)["fanout"]["standard"]
    slos = [0.3, 1.5, 10.0]
    curve = capacity.Curve(per_rate, slos)
    share = curve.attainment()
    assert curve.achieved == pytest.approx([3.2, 7.5, 15.3, 30.1])  # the seeds' mean
    for i, rate in enumerate((4, 8, 16, 32)):
        for j, slo in enumerate(slos):
            assert share[i, j] == pytest.approx(_brute_share(per_rate[rate], slo))
    assert list(curve.goodput(share)) == pytest.approx([0.0, 7.5, 30.1])


def test_one_censored_request_in_ten_does_not_fail_a_rate_that_ninety_percent_met():
    ok = [[0.2, 0.3]] * 10
    tenth = [[0.2, 0.3]] * 9 + [[0.2, None]]  # 1 of 20 censored: 95 % within
    stuck = [[0.2, 0.3]] * 8 + [[0.2, None], [None, None]]  # 3 of 20: 85 %
    rows = [_row("relay", 2, 0, ok), _row("relay", 4, 0, tenth), _row("relay", 8, 0, stuck),
            _row("relay", 16, 0, ok)]  # fmt: skip
    curve = capacity.Curve(capacity.by_workload(rows)["fanout"]["relay"], [100.0])
    assert curve.goodput(curve.attainment())[0] == 4  # 8 misses; 16 after it does not count
    (p,) = [p for p in capacity.points(rows) if p["offered"] == 8]
    assert p["censored"] == 3 and p["requests"] == 20 and p["chains"] == 10
    assert p["p90"] == math.inf and "miss" in capacity.markdown(rows, [1.0])


def test_blocks_are_runs_of_consecutive_chains():
    rng = np.random.default_rng(0)
    picks = capacity.block_picks(12, rng, block=5)
    assert len(picks) == 12 and picks.min() >= 0 and picks.max() < 12
    for start in range(0, 10, 5):  # each block: five consecutive chains, circularly
        block = picks[start : start + 5]
        assert all((b - a) % 12 == 1 for a, b in zip(block, block[1:], strict=False))
    assert len(capacity.block_picks(3, rng, block=5)) == 3


def test_the_ratio_to_the_baseline_resamples_the_same_chains():
    rows = []
    for seed in range(3):
        for rate, std in ((4, 0.8), (8, 2.0)):  # every chain alike: nothing to resample
            rows.append(_row("standard", rate, seed, [[std, std]] * 30))
            rows.append(_row("relay", rate, seed, [[std / 2.5, std / 2.5]] * 30))
    table = capacity.goodput_table(rows, [1.0, 5.0], resamples=200)
    at = {(t["method"], t["slo_s"]): t for t in table}
    assert at["standard", 1.0]["goodput"] == 4 and at["relay", 1.0]["goodput"] == 8
    assert at["relay", 1.0]["interval"] == (8.0, 8.0)
    assert at["relay", 1.0]["ratio"] == (2.0, 2.0, 2.0) and "ratio" not in at["standard", 1.0]
    assert at["relay", 5.0]["ratio"] == (1.0, 1.0, 1.0)
    rng = np.random.default_rng(3)  # noisy chains: the interval holds the point
    noisy = [_row(m, rate, s, [list(rng.uniform(0.1, 1.2, 3) * f * rate / 4) for _ in range(30)])
             for s in range(3) for rate in (4, 8, 16) for m, f in (("standard", 1.0),
                                                                  ("relay", 0.5))]  # fmt: skip
    for t in capacity.goodput_table(noisy, [1.0, 2.0], resamples=300):
        assert t["interval"][0] <= t["goodput"] <= t["interval"][1]
        if "ratio" in t and not math.isnan(t["ratio"][1]):
            assert t["ratio"][1] <= t["ratio"][0] <= t["ratio"][2]


def test_runs_that_are_not_the_same_chains_are_refused():
    rows = [_row("standard", 4, 0, [[1.0]] * 30), _row("relay", 4, 0, [[0.5]] * 29)]
    with pytest.raises(ValueError, match="not the same runs"):
        capacity.goodput_table(rows, [1.0], resamples=10)


def test_a_baseline_without_goodput_gives_an_unbounded_ratio_and_0_over_0_none():
    rows = [_row("standard", 4, 0, [[5.0]] * 30), _row("relay", 4, 0, [[0.5]] * 30)]
    table = capacity.goodput_table(rows, [1.0, 0.1], resamples=50)
    relay = {t["slo_s"]: t for t in table if t["method"] == "relay"}
    assert relay[1.0]["goodput"] == 4 and relay[1.0]["ratio"][0] == math.inf
    assert math.isnan(relay[0.1]["ratio"][0]) and relay[0.1]["ratio_undefined"] == 50
    assert "resamples 0 / 0" in capacity.markdown(rows, [1.0, 0.1])


def test_a_ratio_with_one_side_at_the_highest_rate_tested_is_marked_a_bound():
    fast, slow = [[0.5]] * 30, [[5.0]] * 30
    rows = [_row("standard", 4, 0, fast), _row("standard", 8, 0, slow),
            _row("relay", 4, 0, fast), _row("relay", 8, 0, fast),  # meets both rates: >= 8
            _row("epic", 4, 0, slow), _row("epic", 8, 0, slow)]  # fmt: skip
    table = capacity.goodput_table(rows, [1.0], resamples=20)
    got = {t["method"]: t for t in table}
    assert got["relay"]["at_top"] and not got["standard"]["at_top"]
    assert capacity.bound(got["relay"], got["standard"]) == ">= "  # 8 / 4: at least 2
    assert capacity.bound(got["standard"], got["relay"]) == "<= "
    assert capacity.bound(got["epic"], got["standard"]) == ""
    goodputs = capacity.markdown(rows, [1.0]).split("goodput [95 % CI]")[1]  # its second table
    line = next(x for x in goodputs.splitlines() if "| relay |" in x)
    assert "; >= 2.00 [" in line


def test_points_give_the_median_over_seeds_of_each_runs_time_per_output_token():
    """The table's decode column: each run's ``tpot_p50``, their median over the seeds (a run
    without one, no finished output, is left out; none at all prints ``-``)."""
    chains = [[0.2, 0.3]] * 4
    rows = [_row("relay", 4, s, chains) | {"tpot_p50": t} for s, t in enumerate((0.3, 0.1, 0.2))]
    rows += [_row("relay", 8, 0, chains) | {"tpot_p50": None}]
    rows += [_row("relay", 8, 1, chains) | {"tpot_p50": 0.5}, _row("relay", 16, 0, chains)]
    got = {p["offered"]: p["tpot"] for p in capacity.points(rows)}
    assert got == {4: pytest.approx(0.2), 8: pytest.approx(0.5), 16: None}
    table = capacity.markdown(rows, [1.0]).split("\n\n")[0].splitlines()[2:]
    assert [line.rsplit("|", 2)[1].strip() for line in table] == ["200", "500", "-"]


def test_tool_turns_cut_by_the_runs_end_are_counted_beside_the_censored_requests():
    """A tool loop's turn still waiting for its tool when its run ended has not arrived: it
    is not a request of the pool (no TTFT, no miss), and the table says how many there were
    per rate, summed over the seeds (a row without the field, as older runs, counts 0)."""
    chains = [[0.2, 0.3]] * 4
    rows = [_row("relay", 4, 0, chains) | {"pending_tool": 2},
            _row("relay", 4, 1, chains) | {"pending_tool": 3},
            _row("relay", 8, 0, chains)]  # fmt: skip
    got = {p["offered"]: (p["cut"], p["requests"]) for p in capacity.points(rows)}
    assert got == {4: (5, 16), 8: (0, 8)}
    table = capacity.markdown(rows, [1.0]).split("\n\n")[0].splitlines()
    assert "tool turns cut by the end" in table[0]
    assert [line.split("|")[8].strip() for line in table[2:]] == ["5", "0"]


def test_counting_the_cut_turns_as_misses_is_reported_where_it_would_change_a_goodput():
    """Hand counts: 10 arrivals at rate 4, all within 1 s; one cut turn counted as a miss
    leaves 10 of 11 within (0.91 >= 0.9: still met), two leave 10 of 12 (0.83: missed), so
    the goodput at 1 s falls from 4 to 0; at 2 s the same. No cut turn: no sentence."""
    chains = [[0.5, 0.5]] * 5
    rows = [_row("relay", 4, 0, chains) | {"pending_tool": 1}]
    assert "changes no goodput" in capacity.cut_sensitivity(rows, [1.0])
    rows = [_row("relay", 4, 0, chains) | {"pending_tool": 2}]
    got = capacity.cut_sensitivity(rows, [1.0, 2.0])
    assert "Counting the 2 tool turns" in got
    assert "fanout relay at 1 s (4.0 -> 0.0), fanout relay at 2 s (4.0 -> 0.0)" in got
    assert capacity.cut_sensitivity([_row("relay", 4, 0, chains)], [1.0]) == ""
    assert "Counting the 2" in capacity.markdown(rows, [1.0])
