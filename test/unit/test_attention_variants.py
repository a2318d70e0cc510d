"""The attention specification's per-layer variants (``core/attention.py``): a sliding
window and attention sinks, against Hugging Face's own gpt-oss eager attention fed its own
sliding-window mask, in float64; the log-sum-exp rescale that adds sinks to a sink-free
output (the FlashInfer path and the CPU stand-in) against the explicit sink column; the
context mass and the probe's weights leave the sink's share out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_relay.core.attention import (
    attention_lse,
    attention_probs,
    positional_causal_attention,
    sink_rescale,
    visible,
)
from sglang_relay.core.selection import context_mass

T, HQ, HKV, D = 23, 6, 2, 16


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(T, HKV, D, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(HQ, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("window", [0, 1, 5, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_and_sinks_equal_hugging_faces_gpt_oss_attention(window, with_sinks):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = _qkv(window)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)  # HF: kv_idx > q_idx - W
    mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(
        num_key_value_groups=HQ // HKV,
        sinks=sinks if with_sinks else torch.full((HQ,), float("-inf"), dtype=torch.float64),
        training=False,
    )  # a sink of -inf takes nothing: HF's attention without sinks
    theirs, _ = eager_attention_forward(
        module, *(x.transpose(0, 1)[None] for x in (q, k, v)), mask[None, None],
        scaling=D**-0.5, dropout=0.0,
    )  # fmt: skip
    ours = positional_causal_attention(
        q, k, v, torch.arange(T), D**-0.5, window, sinks if with_sinks else None
    )
    torch.testing.assert_close(ours, theirs[0], rtol=1e-12, atol=1e-12)


def test_rows_at_any_positions_see_their_window_alone():
    q, k, v, sinks = _qkv(3)
    rows = torch.tensor([0, 4, 17, 22])  # non-contiguous rows, as relay recomputes them
    full = positional_causal_attention(q, k, v, torch.arange(T), D**-0.5, 4, sinks)
    some = positional_causal_attention(q[rows], k, v, rows, D**-0.5, 4, sinks)
    torch.testing.assert_close(some, full[rows], rtol=1e-12, atol=1e-12)
    assert visible(rows, T, 4)[2].nonzero().flatten().tolist() == [14, 15, 16, 17]


def test_the_lse_rescale_adds_the_sinks_a_sink_free_output_left_out():
    q, k, v, sinks = _qkv(5)
    pos = torch.arange(T)
    seen = visible(pos, T, 6)
    plain = positional_causal_attention(q, k, v, pos, D**-0.5, 6)
    lse = attention_lse(q, k, seen, D**-0.5)
    want = positional_causal_attention(q, k, v, pos, D**-0.5, 6, sinks)
    torch.testing.assert_close(sink_rescale(plain, lse, sinks), want, rtol=1e-5, atol=1e-6)


def test_weights_leave_the_sinks_share_out():
    q, k, _, sinks = _qkv(7)
    seen = visible(torch.arange(T), T, 3)
    probs = attention_probs(q, k, seen, D**-0.5, sinks)  # [T, Hkv, group, T]
    total = probs.sum(-1)
    share = torch.sigmoid(attention_lse(q, k, seen, D**-0.5) - sinks).reshape(T, HKV, -1)
    torch.testing.assert_close(total, share.double(), rtol=1e-6, atol=1e-6)  # lse: float32
    assert (probs.masked_fill(seen[:, None, None, :], 0) == 0).all()  # nothing past the window
    # the context mass: a row whose window ends before the prompt's end still reads the
    # prompt; one whose window starts past it reads none of it
    mass = context_mass(q, k, torch.arange(T), 8, D**-0.5, window=3, sinks=sinks)
    assert mass[9] > 0 and mass[12] == 0


@pytest.mark.parametrize("window", [7, 50])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float64, torch.float64),
                                             (torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16)])  # fmt: skip
def test_cpu_extend_attention_in_blocks_equals_the_whole_context_mask(
    window, with_sinks, dtype, kv_dtype
):
    """The CPU relay-extend attention (rows in blocks, each over the keys up to its last row,
    from its first row's window on; masks kept across layers) against the specification
    over each request's whole context: three requests of a pool in shuffled slots, some
    rows of each (more than a block, not contiguous), a request without rows, four layers
    through one handle alternating no window and ``window`` (as gpt-oss and Gemma 3 do), a
    value head dim unlike the key's, and a bf16 KV pool under float32 queries."""
    from sglang_relay.runtime.forward.attention import RowBatch, build

    g = torch.Generator().manual_seed(7)
    seq_lens, n_rows, dv = [90, 40, 75], [70, 0, 9], D + 8
    pool = torch.randperm(sum(seq_lens) + 20, generator=g)
    slots, pos, start, row_starts = [], [], 0, []
    for L, n in zip(seq_lens, n_rows, strict=True):
        slots.append(pool[start : start + L])
        start += L
        row_starts.append(sum(p.numel() for p in pos))
        pos.append(torch.sort(torch.randperm(L, generator=g)[:n]).values)
    positions = torch.cat(pos)
    batch = RowBatch(row_starts, seq_lens, slots, positions.numel())
    attn = build("torch", torch.device("cpu"))
    handle = attn.plan(batch, torch.arange(positions.numel()), positions)
    assert len(handle[0]) == 4  # 70 rows: 3 blocks; 9 rows: 1
    sinks = torch.randn(HQ, generator=g, dtype=dtype) if with_sinks else None
    for layer in range(4):  # later layers reuse the handle's masks on new buffers
        w = window if layer % 2 else 0
        kbuf = torch.randn(pool.numel(), HKV, D, generator=g, dtype=torch.float64).to(kv_dtype)
        vbuf = torch.randn(pool.numel(), HKV, dv, generator=g, dtype=torch.float64).to(kv_dtype)
        q = torch.randn(positions.numel(), HQ, D, generator=g, dtype=torch.float64).to(dtype)
        got = attn.run(handle, q, kbuf, vbuf, D**-0.5, w, sinks)
        assert got.shape == (positions.numel(), HQ, dv)
        for i, s in enumerate(slots):
            lo, hi = row_starts[i], row_starts[i] + n_rows[i]
            k, v = kbuf[s].to(dtype), vbuf[s].to(dtype)
            want = positional_causal_attention(q[lo:hi], k, v, positions[lo:hi], D**-0.5, w, sinks)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(got[lo:hi], want, rtol=tol, atol=tol)
