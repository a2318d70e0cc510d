"""Selection policies, the method table, the layer schedule and reuse accounting."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.selection import kv_deviation, select_runs, select_tokens


def test_threshold_suffix_and_first_k():
    dev = torch.full((100,), 0.01)
    dev[[5, 50]] = 1.0
    mask = select_tokens(RelayConfig(tau_dev=1.5, l_suf=10, first_k=2), 100, dev)
    expected = {0, 1, 5, 50, *range(90, 100)}
    assert set(mask.nonzero().flatten().tolist()) == expected


def test_influence_union():
    dev = torch.ones(40)
    inf = torch.ones(40)
    inf[7] = 10.0
    cfg = RelayConfig(tau_dev=1.5, tau_inf=1.45, l_suf=0)
    assert mask_ids(select_tokens(cfg, 40, dev, inf)) == {7}
    assert mask_ids(select_tokens(cfg, 40, dev, None)) == set()


def test_top_ratio_and_cap_keep_highest_deviation():
    dev = torch.arange(100, dtype=torch.float32)
    top = select_tokens(RelayConfig().for_method("cacheblend"), 100, dev)
    assert mask_ids(top) == set(range(85, 100))
    capped = select_tokens(RelayConfig(tau_dev=0.0, l_suf=0, first_k=3, max_ratio=0.1), 100, dev)
    assert mask_ids(capped) == {0, 1, 2, *range(93, 100)}


def test_epic_needs_no_scores():
    cfg = RelayConfig().for_method("epic")
    assert mask_ids(select_tokens(cfg, 40)) == set(range(16))
    assert mask_ids(select_tokens(cfg, 5)) == set(range(5))


def test_deviation_is_one_minus_cosine():
    a = torch.randn(10, 3, 64)
    assert torch.allclose(kv_deviation(a, 2 * a), torch.zeros(10), atol=1e-6)
    assert torch.allclose(kv_deviation(a, -a), torch.full((10,), 2.0), atol=1e-6)


def test_schedules_and_reuse():
    L = 30
    assert RelayConfig(method="naive").schedule(L).reuse_rate(100, 0) == 1.0
    s = RelayConfig(l_start=3, l_det=4, l_end=-1).schedule(L)
    assert (s.l_start, s.l_det, s.l_end) == (3, 4, 29)
    # |S|=100, |I|=15: 1 - (100*1 + 15*26) / 3000
    assert s.reuse_rate(100, 15) == pytest.approx(1 - (100 + 15 * 26) / 3000)
    full = RelayConfig(l_start=0, l_det=0, l_end=-1).schedule(L)
    assert full.reuse_rate(100, 100) == pytest.approx(0.0)
    cb = RelayConfig().for_method("cacheblend").schedule(L)
    assert (cb.l_start, cb.l_det, cb.l_end) == (0, 1, 29)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(method="magic"), "method must be one of"),
        (dict(tau_dev=float("nan")), "tau_dev"),
        (dict(top_ratio=1.5), "top_ratio"),
        (dict(l_suf=-1), "l_suf"),
        (dict(signal="query"), "signal"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RelayConfig(**kwargs)


def test_bad_layer_range():
    with pytest.raises(ValueError, match="l_start <= l_det"):
        RelayConfig(l_start=10, l_det=4).schedule(30)
    with pytest.raises(ValueError, match="l_start <= l_det"):
        RelayConfig(l_start=0, l_det=4, l_end=40).schedule(30)
    with pytest.raises(ValueError, match="unknown relay config fields"):
        RelayConfig.from_dict({"l_strat": 3})


def mask_ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


def test_a_cap_below_the_forced_tokens_keeps_the_first_ones():
    """max_ratio smaller than first_k: the span's first tokens survive, in order."""
    cfg = RelayConfig(first_k=24, l_suf=0, tau_dev=1.0, max_ratio=0.05)
    dev = torch.linspace(1.0, 0.0, 200).flip(0)  # deviation grows along the span
    mask = select_tokens(cfg, 200, dev)
    assert mask.nonzero().flatten().tolist() == list(range(10))  # cap = int(0.05 * 200)


def test_context_mass_is_the_prompt_share_of_a_plain_softmax_however_chunked(monkeypatch):
    """Brute force: one full softmax per query row and head (GQA by repeating keys), mass
    on positions 1..P-1, mean over heads; equal whether the rows run in one step or in
    steps of 7 (a long row's score block is bounded)."""
    from sglang_relay.core import selection

    gen = torch.Generator().manual_seed(0)
    q, keys = torch.randn(60, 4, 8, generator=gen), torch.randn(100, 2, 8, generator=gen)
    pos, prompt = torch.arange(40, 100), 40
    scores = torch.einsum("nhd,thd->nht", q, keys.repeat_interleave(2, dim=1)) * 0.3
    future = torch.arange(100)[None, None, :] > pos[:, None, None]
    scores = scores.masked_fill(future, float("-inf"))
    want = scores.softmax(-1)[..., 1:prompt].sum(-1).mean(-1)
    torch.testing.assert_close(selection.context_mass(q, keys, pos, prompt, 0.3), want)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES", 4 * 4 * 100 * 7)
    torch.testing.assert_close(selection.context_mass(q, keys, pos, prompt, 0.3), want)


def test_span_budget_selects_each_run_on_its_own():
    cfg = RelayConfig(l_start=0, l_det=0, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
                      first_k=2, max_ratio=0.1)  # fmt: skip
    torch.manual_seed(0)
    lengths, heads = [50, 80, 33], [0, 5, 1]
    scores = torch.rand(sum(lengths))
    masks = select_runs(cfg, lengths, scores, heads=heads)
    for mask, part, n, head in zip(masks, scores.split(lengths), lengths, heads, strict=True):
        assert mask.equal(select_tokens(cfg, n, part, head=head))


@pytest.mark.parametrize("first_k", [0, 3])
def test_request_budget_is_one_cap_over_all_runs(first_k):
    """budget="request": floor(max_ratio * total) tokens, the runs' forced first tokens
    first, then the highest scores of the whole request (brute force: sort everything)."""
    cfg = RelayConfig(l_start=0, l_det=0, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
                      first_k=first_k, max_ratio=0.1, budget="request")  # fmt: skip
    torch.manual_seed(1)
    lengths, heads = [40, 120, 61], [0, 0, 2]
    scores = torch.rand(sum(lengths))
    scores[:40] *= 0.1  # the first run barely looked at its context
    masks = select_runs(cfg, lengths, scores, heads=heads)
    cap = int(0.1 * sum(lengths))
    starts = [0, 40, 160]
    forced = [s + i for s, h in zip(starts, heads, strict=True) for i in range(first_k - h)]
    rest = [i for i in sorted(range(len(scores)), key=lambda i: -float(scores[i]))
            if i not in forced][: cap - len(forced)]  # fmt: skip
    assert mask_ids(torch.cat(masks)) == set(forced) | set(rest)
    assert [m.numel() for m in masks] == lengths
    assert sum(int(m.sum()) for m in masks) == cap
    if first_k == 0:  # the low-mass run gives its share away; per span it would keep 4
        assert int(masks[0].sum()) == 0
        per_span = select_runs(replace(cfg, budget="span"), lengths, scores, heads=heads)
        assert [int(m.sum()) for m in per_span] == [4, 12, 6]


def test_request_budget_is_refused_when_unknown():
    with pytest.raises(ValueError, match="budget must be one of"):
        RelayConfig(budget="batch")
    assert "budget" not in RelayConfig().to_dict()  # older profiles stay equal
    assert RelayConfig.from_dict(RelayConfig(budget="request").to_dict()).budget == "request"


@pytest.mark.parametrize("reserve", [0, 1])
def test_reasoning_answers_are_capped_in_a_pool_of_their_own(reserve):
    """``answer_max_ratio``: with budget "request", the answer runs share one cap
    (floor(answer ratio * their tokens)) and the other runs another (floor(max_ratio *
    theirs)), each the highest scores of its own runs (brute force: sort each pool); the
    probe's charged row comes off the pool holding the first run. Per span: each run at
    its own ratio."""
    cfg = RelayConfig(l_start=0, l_det=0, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
                      max_ratio=0.1, answer_max_ratio=0.4, budget="request")  # fmt: skip
    torch.manual_seed(2)
    lengths, answers = [50, 70, 90], [True, False, True]
    scores = torch.rand(sum(lengths))
    scores[50:120] += 1.0  # the plain run scores highest: one shared pool would take it all
    masks = select_runs(cfg, lengths, scores, reserve=reserve, answers=answers)
    starts = [0, 50, 120]
    for ratio, pool in ((0.4, [0, 2]), (0.1, [1])):
        ids = [starts[i] + j for i in pool for j in range(lengths[i])]
        cap = int(ratio * sum(lengths[i] for i in pool)) - (reserve if 0 in pool else 0)
        want = sorted(ids, key=lambda i: -float(scores[i]))[:cap]
        got = {starts[i] + int(j) for i in pool for j in masks[i].nonzero().flatten()}
        assert got == set(want)
    # without answers it is the single request pool of before
    plain = select_runs(cfg, lengths, scores, reserve=reserve)
    assert sum(int(m.sum()) for m in plain) == int(0.1 * sum(lengths)) - reserve
    # per span: each run alone at its ratio
    span = replace(cfg, budget="span")
    masks = select_runs(span, lengths, scores, answers=answers)
    assert [int(m.sum()) for m in masks] == [int(0.4 * 50), int(0.1 * 70), int(0.4 * 90)]
    with pytest.raises(ValueError, match="answer_max_ratio must be in"):
        RelayConfig(answer_max_ratio=1.5)
    assert "answer_max_ratio" not in RelayConfig().to_dict()  # older profiles stay equal
