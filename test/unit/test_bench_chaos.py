"""``bench chaos``'s comparison of two runs: which good chains stayed identical, and where
and how near a tie the others first parted (top-2 logprob gap, read from SGLang's
``output_top_logprobs``)."""

from __future__ import annotations

import pytest

from sglang_relay.bench.chaos import agreement
from sglang_relay.bench.traffic import margins


def _chain(ids, gaps, relayed=True):
    return {"ids": ids, "margins": gaps, "down_relayed": relayed}


def test_runs_compare_chain_for_chain_and_name_the_first_token_that_parts():
    calm = {"outputs": {
        "a": _chain([[1, 2, 3], [4, 5, 6]], [[0.9, 0.8, 0.7], [0.5, 0.03, 0.2]]),
        "b": _chain([[7, 8], [9]], [[1.0, 1.0], [2.0]], relayed=False),
        "c": _chain([[1, 1], [2]], [[0.1, 0.2], [0.3]]),
        "only-calm": _chain([[1]], [[1.0]]),
    }}  # fmt: skip
    other = {"outputs": {
        "a": _chain([[1, 2, 3], [4, 7, 6]], [[0.9, 0.8, 0.7], [0.5, 0.01, 0.4]]),
        "b": _chain([[7, 8], [9]], [[1.0, 1.0], [2.0]], relayed=False),
        "c": _chain([[1, 1, 5], [2]], [[0.1, 0.2, 0.6], None], relayed=False),
    }}  # fmt: skip
    out = agreement(calm, other)
    assert out["chains_compared"] == 3 and out["identical"] == 1
    assert out["groups"]["relayed_in_both"] == {"chains": 1, "identical": 0, "upstream_same": 1}
    assert out["groups"]["relayed_in_neither"]["identical"] == 1
    assert out["groups"]["relayed_in_one"] == {"chains": 1, "identical": 0, "upstream_same": 0}
    first, second = out["divergences"]
    # chain a: the downstream output (1) parts at its token 1, a near tie in both runs
    assert first == {"chain": "a", "group": "relayed_in_both", "output": 1, "token": 1,
                     "gap_base": 0.03, "gap_other": 0.01}  # fmt: skip
    # chain c: the upstream ran longer in one run: they part where the shorter one ended
    assert second["output"] == 0 and second["token"] == 2
    assert second["gap_base"] is None and second["gap_other"] == 0.6


def test_margins_are_the_gap_between_the_two_likeliest_tokens_at_each_step():
    out = {"output_ids": [5, 6], "meta_info": {"output_top_logprobs": [
        [[-0.1, 5, "a"], [-2.6, 9, "b"]], [[-0.7, 6, "c"], [-0.75, 3, "d"]]]}}  # fmt: skip
    assert margins(out) == pytest.approx([2.5, 0.05])
    assert margins({"output_ids": [5], "meta_info": {}}) is None  # not asked for
    short = {"output_ids": [5, 6], "meta_info": {"output_top_logprobs": [[[-0.1, 5, "a"]]]}}
    assert margins(short) is None  # not one pair per output token
