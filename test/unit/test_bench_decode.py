"""``bench decode``'s paired ratio: the geometric mean of relay / plain over paired rounds,
one server pair or several, against the arithmetic done by hand."""

from __future__ import annotations

import math

import pytest

from sglang_relay.bench.decode import _paired


def test_one_pair_is_the_geometric_mean_of_its_rounds():
    relay, plain = [[9.0, 12.0, 10.0]], [[10.0, 10.0, 10.0]]
    ratio, (lo, hi) = _paired(relay, plain)
    assert ratio == pytest.approx((0.9 * 1.2 * 1.0) ** (1 / 3), abs=5e-4)
    assert 0.9 <= lo <= ratio <= hi <= 1.2


def test_several_pairs_weigh_each_pair_once():
    # pair 1: ratios 1.0 and 1.0 over 2 rounds; pair 2: 1.1 over 4 rounds
    relay = [[5.0, 7.0], [11.0, 22.0, 33.0, 44.0]]
    plain = [[5.0, 7.0], [10.0, 20.0, 30.0, 40.0]]
    ratio, (lo, hi) = _paired(relay, plain)
    assert ratio == pytest.approx(math.sqrt(1.1), abs=5e-4)  # not 1.1 ** (4 / 6)
    assert lo == pytest.approx(1.0, abs=5e-4) and hi == pytest.approx(1.1, abs=5e-4)


def test_a_single_round_has_no_spread():
    assert _paired([[2.0]], [[4.0]]) == (0.5, [0.5, 0.5])
