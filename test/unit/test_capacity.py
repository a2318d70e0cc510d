"""Capacity from censored runs: goodput read at the achieved rate, against numpy and a
hand-built curve; paired bootstrap intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sglang_relay.bench import capacity


def _row(method, rate, seed, chains, achieved=None, workload="fanout"):
    return {"workload": workload, "method": method, "rate": rate, "seed": seed,
            "arrived_per_min": rate if achieved is None else achieved,
            "chain_ttfts_all": chains}  # fmt: skip


def _numpy_p90(runs):  # independent: numpy over the pooled values, a miss as a huge number
    return float(np.percentile([1e9 if t is None else t for r in runs
                                for c in r["chain_ttfts_all"] for t in c], 90))  # fmt: skip


def test_goodput_is_the_highest_achieved_rate_before_the_first_miss():
    rng = np.random.default_rng(0)
    rows = []
    for rate, scale, achieved in ((4, 0.5, 3.1), (8, 1.0, 7.4), (16, 3.0, 15.2), (32, 0.4, 30.0)):
        for seed in range(3):  # 32/min "passes" by luck past saturation: does not count
            chains = [list(rng.uniform(0.5, 1.0, 4) * scale) for _ in range(30)]
            rows.append(_row("standard", rate, seed, chains, achieved + seed * 0.1))
    per_rate = capacity.by_workload(rows)["fanout"]["standard"]
    curve = capacity.tails(per_rate)
    for (got_rate, got_p90), rate in zip(curve, (4, 8, 16, 32), strict=True):
        runs = per_rate[rate]
        assert got_rate == pytest.approx(np.mean([r["arrived_per_min"] for r in runs]))
        assert got_p90 == pytest.approx(_numpy_p90(runs))
    assert capacity.goodput(curve, 1.5) == pytest.approx(7.5)  # 8/min offered, 7.5 achieved
    assert capacity.goodput(curve, 0.3) == 0.0
    assert capacity.goodput(curve, 10.0) == pytest.approx(30.1)


def test_censored_requests_make_a_rate_miss():
    ok = [[0.2, 0.3]] * 9 + [[0.2, 0.3]]
    stuck = [[0.2, 0.3]] * 8 + [[0.2, None], [None, None]]  # 3 of 20 censored: p90 a miss
    rows = [_row("relay", 2, 0, ok), _row("relay", 4, 0, stuck), _row("relay", 8, 0, ok)]
    curve = capacity.tails(capacity.by_workload(rows)["fanout"]["relay"])
    assert curve[1][1] == math.inf and capacity.goodput(curve, 100.0) == 2
    (p,) = [p for p in capacity.points(rows) if p["offered"] == 4]
    assert p["censored"] == 3 and p["requests"] == 20 and p["chains"] == 10
    assert "miss" in capacity.markdown(rows, [1.0])


def test_the_ratio_to_the_baseline_resamples_the_same_chains():
    rows = []
    for seed in range(3):
        for rate, std in ((4, 0.8), (8, 2.0)):  # every chain alike: nothing to resample
            rows.append(_row("standard", rate, seed, [[std, std]] * 30))
            rows.append(_row("relay", rate, seed, [[std / 2.5, std / 2.5]] * 30))
    table = capacity.goodput_table(rows, [1.0], resamples=200)
    relay = next(t for t in table if t["method"] == "relay")
    std = next(t for t in table if t["method"] == "standard")
    assert std["goodput"] == 4 and relay["goodput"] == 8
    assert relay["interval"] == (8.0, 8.0) and relay["ratio"] == (2.0, 2.0, 2.0)
    assert "ratio" not in std
    rng = np.random.default_rng(3)  # noisy chains: the interval holds the point
    noisy = [_row(m, rate, s, [list(rng.uniform(0.1, 1.2, 3) * f * rate / 4) for _ in range(30)])
             for s in range(3) for rate in (4, 8, 16) for m, f in (("standard", 1.0),
                                                                  ("relay", 0.5))]  # fmt: skip
    for t in capacity.goodput_table(noisy, [1.0, 2.0], resamples=300):
        assert t["interval"][0] <= t["goodput"] <= t["interval"][1]
        if "ratio" in t:
            assert t["ratio"][1] <= t["ratio"][0] <= t["ratio"][2]


def test_a_baseline_without_goodput_gives_an_unbounded_ratio():
    rows = [_row("standard", 4, 0, [[5.0]] * 30), _row("relay", 4, 0, [[0.5]] * 30)]
    (relay,) = [t for t in capacity.goodput_table(rows, [1.0], resamples=50)
                if t["method"] == "relay"]  # fmt: skip
    assert relay["goodput"] == 4 and relay["ratio"][0] == math.inf
