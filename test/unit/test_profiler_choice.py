"""The profiler's choice among candidates: reuse first, then the measures a user sees
(first-token top-1, greedy prefix) no worse than the best candidate's (beyond the paired
interval over the relays; within one relay for candidates logged without per-relay values),
then KL. Hand-built candidates whose winner is known by reading them."""

from __future__ import annotations

from sglang_relay.profiler.search import choose


def cand(name: str, kl: float, top1: float, prefix: float, reuse: float = 0.9, tf: float = 0.97):
    return {
        "name": name,
        "metrics": {
            "first_token_kl": kl,
            "tf_top1": tf,
            "top1": top1,
            "greedy_prefix": prefix,
            "relays": 16,
            "reuse_min": reuse,
            "reuse_mean": reuse,
        },
    }


def test_a_lower_kl_that_flips_two_more_first_tokens_is_not_chosen():
    # 'low' has the lowest KL but 2 of 16 more first-token flips than 'safe': out
    low = cand("low", 0.010, 14 / 16, 0.60)
    safe = cand("safe", 0.012, 16 / 16, 0.60)
    assert choose([low, safe], 0.9)["name"] == "safe"
    # one flip more is within the slack: KL decides
    near = cand("near", 0.010, 15 / 16, 0.60)
    assert choose([near, safe], 0.9)["name"] == "near"


def test_the_greedy_prefix_counts_like_top1():
    low = cand("low", 0.010, 1.0, 0.40)
    safe = cand("safe", 0.012, 1.0, 0.50)  # 0.10 > 1/16 better
    assert choose([low, safe], 0.9)["name"] == "safe"
    close = cand("close", 0.010, 1.0, 0.45)  # 0.05 < 1/16 behind
    assert choose([close, safe], 0.9)["name"] == "close"


def test_reuse_is_checked_before_the_measures():
    # the best measures belong to a candidate that misses the reuse target: they set no bar
    dense = cand("dense", 0.001, 1.0, 0.90, reuse=0.85)
    low = cand("low", 0.010, 14 / 16, 0.60)
    other = cand("other", 0.020, 14 / 16, 0.55)
    assert choose([dense, low, other], 0.9)["name"] == "low"
    assert choose([dense], 0.9) is None


def test_candidates_logged_without_the_new_measures_are_ranked_by_kl():
    old = {"name": "old", "metrics": {"first_token_kl": 0.01, "tf_top1": 0.9, "top1": 1.0,
                                      "reuse_min": 0.9, "reuse_mean": 0.9}}  # fmt: skip
    new = cand("new", 0.02, 1.0, 0.7)
    assert choose([old, new], 0.9)["name"] == "old"


def test_measures_that_cross_leave_a_choice():
    # the top-1 leader trails on greedy prefix and the prefix leader on top-1: top-1's bar
    # applies first, the prefix bar then among its survivors
    a = cand("a", 0.012, 1.0, 0.448)
    b = cand("b", 0.010, 14 / 16, 0.520)
    assert choose([a, b], 0.9)["name"] == "a"
    c = cand("c", 0.011, 15 / 16, 0.530)  # within one flip of a: c then sets the prefix bar
    assert choose([a, b, c], 0.9)["name"] == "c"


def relays(name: str, kl: float, top1: list[int], prefix: list[float]):
    """A candidate as the profiler logs it now: means plus the per-relay values."""
    c = cand(name, kl, sum(top1) / len(top1), sum(prefix) / len(prefix))
    c["metrics"]["relays"] = len(top1)
    c["per_relay"] = {"top1": top1, "greedy_prefix": prefix}
    return c


def test_with_per_relay_values_the_bar_is_the_paired_interval():
    # 80 relays. Six more first-token flips than the leader, on relays where the leader is
    # right: worse beyond the paired interval, out whatever its KL
    safe = relays("safe", 0.012, [1] * 80, [0.5] * 80)
    flips = relays("flips", 0.005, [0] * 6 + [1] * 74, [0.5] * 80)
    assert choose([flips, safe], 0.9)["name"] == "safe"
    # two more flips are within the interval (the old 1/n slack would have dropped it)
    near = relays("near", 0.005, [0] * 2 + [1] * 78, [0.5] * 80)
    assert choose([near, safe], 0.9)["name"] == "near"


def test_a_greedy_prefix_gap_within_the_noise_does_not_decide():
    # the prefix leader's mean is 0.05 higher (4 relays' worth at n = 80), but the relays
    # disagree in both directions: the paired interval holds zero, KL decides
    up = [0.9, 0.1] * 40
    down = [0.8, 0.0] * 20 + [0.1, 0.9] * 20
    leader = relays("leader", 0.012, [1] * 80, up)
    lower = relays("lower", 0.004, [1] * 80, down)
    assert abs(sum(up) / 80 - sum(down) / 80 - 4 / 80) < 1e-9
    assert choose([lower, leader], 0.9)["name"] == "lower"
    # the same gap on every relay is a real one
    steady = relays("steady", 0.004, [1] * 80, [x - 0.05 for x in up])
    assert choose([steady, leader], 0.9)["name"] == "leader"
