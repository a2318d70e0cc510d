"""Bootstrap intervals of the fidelity benches against normal theory and known cases."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_relay.bench.intervals import bootstrap_ci, paired_ci, verdict


def test_mean_interval_matches_normal_theory():
    rng = np.random.default_rng(1)
    x = rng.normal(1.0, 1.0, size=400)
    lo, hi = bootstrap_ci(x)
    half = 1.96 * x.std(ddof=1) / np.sqrt(x.size)  # the textbook 95 % interval
    assert lo < x.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.2 * half)


def test_constant_values_and_same_seed_give_exact_answers():
    assert bootstrap_ci([0.25] * 10) == (0.25, 0.25)
    assert bootstrap_ci([0.25] * 10, "median") == (0.25, 0.25)
    x = [0.1, 0.5, 0.2, 0.9, 0.3]
    assert bootstrap_ci(x) == bootstrap_ci(x)
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci(x, "mode")


def test_paired_interval_sees_a_consistent_difference_unpaired_ones_miss():
    rng = np.random.default_rng(2)
    relay_noise = rng.lognormal(-4, 1.5, size=24)  # per-relay difficulty varies widely
    a, b = relay_noise * 0.9, relay_noise  # a is 10 % lower on every relay
    lo_a, hi_a = bootstrap_ci(a)
    lo_b, hi_b = bootstrap_ci(b)
    assert lo_b < hi_a  # the separate intervals overlap
    lo, hi = paired_ci(a, b)
    assert hi < 0  # the paired one says: lower
    assert verdict(lo, hi, lower_is_better=True) == "better"
    assert verdict(lo, hi, lower_is_better=False) == "worse"
    assert paired_ci(b, b) == (0.0, 0.0)
    assert verdict(0.0, 0.0, lower_is_better=True) == "tie"
    assert paired_ci([1, 0, 1, 1], [0, 0, 0, 1], "mean")[0] >= 0.0
    with pytest.raises(ValueError):
        paired_ci([1, 2], [1])
