"""The FlashInfer extend plan, read the way FlashInfer reads it, equals the torch_native
semantics of the relay extend (positional causal attention over each request's slots)."""

from __future__ import annotations

import pytest
import torch

from sglang_relay.core.attention import positional_causal_attention
from sglang_relay_kernels.flashinfer_extend import attend_with_plan_ref, build_extend_plan


@pytest.mark.parametrize(
    "hq, hkv, window, with_sinks",
    [(4, 4, 0, False), (6, 2, 0, False), (6, 2, 9, False), (4, 2, 0, True), (6, 2, 3, True)],
)  # MHA and GQA; sliding windows (gpt-oss, Gemma 3) and sinks (gpt-oss), float64 reference
def test_plan_matches_positional_causal_attention(hq, hkv, window, with_sinks):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    d, slots_total = 32, 300
    kbuf = torch.randn(slots_total, hkv, d, generator=gen)
    vbuf = torch.randn(slots_total, hkv, d, generator=gen)
    seq_lens = [40, 7, 65, 12]
    # each request: a random slot list and a random, non-contiguous set of active rows
    # (request 3 has none: it must keep its place in the batch)
    perm = torch.randperm(slots_total, generator=gen)
    slots, start = [], 0
    for t in seq_lens:
        slots.append(perm[start : start + t])
        start += t
    active = [
        torch.tensor([0, 5, 6, 39]),
        torch.arange(7),
        torch.sort(torch.randperm(65, generator=gen)[:20]).values,
        torch.tensor([], dtype=torch.long),
    ]
    q_pos = torch.cat(active)
    q = torch.randn(q_pos.numel(), hq, d, generator=gen)
    plan = build_extend_plan([a.numel() for a in active], q_pos, seq_lens, slots, window)
    sinks = torch.randn(hq, generator=gen) * 4 if with_sinks else None
    got = attend_with_plan_ref(plan, q, kbuf, vbuf, scale=0.17, sinks=sinks)

    row = 0
    for a, s in zip(active, slots, strict=True):
        n = a.numel()
        if n:
            want = positional_causal_attention(
                q[row : row + n].double(), kbuf[s].double(), vbuf[s].double(), a, 0.17,
                window=window, sinks=None if sinks is None else sinks.double(),
            )  # fmt: skip
            torch.testing.assert_close(got[row : row + n].double(), want, atol=1e-5, rtol=1e-5)
        row += n
    assert plan.kv_last_page_len.tolist() == [1, 1, 1, 1]
    assert plan.qo_indptr.tolist() == [0, 4, 11, 31, 31]
    assert plan.custom_mask.numel() == 4 * 40 + 7 * 7 + 20 * 65
    if window:  # row 39 of request 0 sees positions 39 - window + 1 .. 39 alone
        assert plan.custom_mask[3 * 40 : 4 * 40].nonzero().flatten().tolist() == list(
            range(40 - window, 40)
        )


def test_plan_refuses_inconsistent_input():
    s = [torch.arange(5)]
    with pytest.raises(ValueError, match="outside seq_len"):
        build_extend_plan([1], torch.tensor([5]), [5], s)
    with pytest.raises(ValueError, match="rows counted"):
        build_extend_plan([2], torch.tensor([1]), [5], s)
    with pytest.raises(ValueError, match="slots for seq_len"):
        build_extend_plan([1], torch.tensor([1]), [6], s)
