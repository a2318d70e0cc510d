"""Re-rotation equals RoPE applied at the new position (fp32 relative error <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from sglang_relay.core.rope import apply_rope_ref, build_cos_sin_cache, rerotate_keys

CASES = [
    pytest.param(dict(head=64, rot=64, neox=True), id="neox-full"),
    pytest.param(dict(head=64, rot=64, neox=False), id="gptj-full"),
    pytest.param(dict(head=128, rot=64, neox=True), id="neox-partial"),
    pytest.param(dict(head=80, rot=32, neox=False), id="gptj-partial"),
    pytest.param(dict(head=64, rot=64, neox=True, linear=4.0), id="linear-scaled"),
    pytest.param(dict(head=64, rot=64, neox=True, mscale=1.23), id="yarn-mscale"),
]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("case", CASES)
def test_rerotated_keys_equal_keys_at_new_positions(case):
    torch.manual_seed(0)
    max_pos = 8192
    cache = build_cos_sin_cache(
        case["rot"],
        max_pos,
        base=1e5,
        linear_factor=case.get("linear", 1.0),
        mscale=case.get("mscale", 1.0),
    )
    n, heads = 300, 3
    raw = torch.randn(n, heads, case["head"])
    old = torch.randint(0, max_pos, (n,))
    new = torch.randint(0, max_pos, (n,))  # deltas of both signs and of all sizes
    assert (new < old).any() and (new > old).any()
    cached = apply_rope_ref(raw, old, cache, is_neox=case["neox"]).float()
    expected = apply_rope_ref(raw, new, cache, is_neox=case["neox"])
    got = rerotate_keys(cached, new - old, cache, is_neox=case["neox"])
    assert got.dtype == torch.float32
    assert _rel_err(got, expected) <= 1e-5
    # the pass-through dims of partial rotary are untouched
    torch.testing.assert_close(got[..., case["rot"] :], cached[..., case["rot"] :])
    # and the test can fail: not re-rotating is far off
    assert _rel_err(cached, expected) > 0.1


def test_batch_of_spans_with_different_deltas_matches_per_span():
    torch.manual_seed(1)
    cache = build_cos_sin_cache(64, 4096)
    spans = [(0, 100, 37), (100, 180, -25), (180, 300, 1000)]  # (lo, hi, delta)
    k = torch.randn(300, 3, 64)
    delta = torch.cat([torch.full((hi - lo,), d) for lo, hi, d in spans])
    batched = rerotate_keys(k, delta, cache)
    for lo, hi, d in spans:
        one = rerotate_keys(k[lo:hi], torch.full((hi - lo,), d), cache)
        torch.testing.assert_close(batched[lo:hi], one)


def test_zero_delta_is_identity_and_round_trip():
    cache = build_cos_sin_cache(64, 4096, mscale=1.1)
    k = torch.randn(50, 2, 64)
    d = torch.randint(-2000, 2000, (50,))
    torch.testing.assert_close(rerotate_keys(k, torch.zeros(50, dtype=torch.long), cache), k)
    back = rerotate_keys(rerotate_keys(k, d, cache), -d, cache)
    torch.testing.assert_close(back, k, rtol=1e-5, atol=1e-5)


def test_bad_input_is_rejected():
    cache = build_cos_sin_cache(64, 128)
    with pytest.raises(ValueError, match="exceeds the RoPE cache"):
        rerotate_keys(torch.randn(2, 1, 64), torch.tensor([0, 500]), cache)
    with pytest.raises(TypeError):
        rerotate_keys(torch.randn(2, 1, 64), torch.tensor([0.5, 1.0]), cache)
    with pytest.raises(ValueError, match=r"\[N, H, D"):
        rerotate_keys(torch.randn(2, 64), torch.tensor([0, 1]), cache)
