"""Bootstrap intervals of the fidelity benches against normal theory and known cases."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_relay.bench.intervals import bootstrap_ci, cluster_ci, paired_ci, verdict


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


def test_cluster_interval_matches_normal_theory_over_groups():
    """Groups with effects of their own (sd 1) and values around them (sd 1, 5 each): the
    interval of the mean of group means is the textbook one over the k group means (the
    two-stage bootstrap adds the within-group share once more, here about 8 % in width)."""
    rng = np.random.default_rng(2)
    k, n = 300, 5
    groups = rng.normal(0.0, 1.0, size=(k, 1)) + rng.normal(0.0, 1.0, size=(k, n))
    means = groups.mean(axis=1)
    lo, hi = cluster_ci(groups.tolist())
    half = 1.96 * means.std(ddof=1) / np.sqrt(k)
    assert lo < means.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(1.08 * half, rel=0.15)


def test_cluster_interval_is_wider_than_pooling_when_groups_differ():
    """Eight server pairs whose ratios sit at +-1 % with rounds that barely move: pooling
    the 64 rounds reads them as independent; the groups hold 8 values' worth."""
    rng = np.random.default_rng(3)
    offsets = np.array([-0.01, 0.01] * 4)
    groups = offsets[:, None] + rng.normal(0.0, 0.001, size=(8, 8))
    lo, hi = cluster_ci(groups.tolist())
    plo, phi = bootstrap_ci(groups.ravel())
    assert hi - lo > 2.0 * (phi - plo)
    assert cluster_ci([[0.5] * 3, [0.5] * 4]) == (0.5, 0.5)
    # a group smaller than the others is its own values' mean (1.0), not diluted: two
    # groups drawn twice give a mean of 0, 0.5 or 1
    assert cluster_ci([[0.0] * 5, [1.0]]) == (0.0, 1.0)
    with pytest.raises(ValueError):
        cluster_ci([[1.0], []])
