"""The relay-extend attention registry gives the torch path's attention: FlashInfer (plan per
active-row set, run per layer; its computation replaced by the plan's CPU oracle) and the
Triton kernel (under the interpreter without a GPU)."""

from __future__ import annotations

import torch

from sglang_relay.runtime.forward.attention import FlashInferAttention, RowBatch, build
from sglang_relay_kernels.flashinfer_extend import attend_with_plan_ref


class OracleFlashInfer:
    """FlashInferExtend's interface, computing with attend_with_plan_ref."""

    def __init__(self):
        self.layouts, self.plans, self.resets = {}, 0, 0

    def reset(self):
        self.layouts.clear()
        self.resets += 1

    def plan(self, key, layout, heads, scale, dtype, kv_dtype):
        self.layouts[key] = (layout, scale)
        self.plans += 1

    def run(self, key, q, kbuf, vbuf, sinks=None):
        layout, scale = self.layouts[key]
        return attend_with_plan_ref(layout, q, kbuf, vbuf, scale, sinks)


CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D = 4, 2, 16


def _batch(dev=CPU):
    """Two requests: 10 cached + 6 new tokens, and 0 cached + 9 new tokens."""
    gen = torch.Generator().manual_seed(3)
    slots = 200
    kbuf = torch.randn(slots, HKV, D, generator=gen)
    vbuf = torch.randn(slots, HKV, D, generator=gen)
    perm = torch.randperm(slots, generator=gen)
    rows = [perm[:16], perm[16:25]]
    positions = torch.cat([torch.arange(10, 16), torch.arange(0, 9)])
    batch = RowBatch([0, 6], [16, 9], [r.to(dev) for r in rows], 15)
    return batch, positions.to(dev), kbuf.to(dev), vbuf.to(dev), gen


def _attend(impl, rows, q, window=0, sinks=None):
    batch, positions, kbuf, vbuf, _ = _batch(q.device)
    handle = impl.plan(batch, rows.cpu(), positions[rows.to(positions.device)])
    return impl.run(handle, q.reshape(-1, HQ, D), kbuf, vbuf, 0.3, window, sinks)


# the layer variants: none, a sliding window (Gemma 3), a window with sinks (gpt-oss)
VARIANTS = [(0, None), (4, None), (3, torch.tensor([2.0, -1.0, 6.0, 0.0]))]


def test_flashinfer_glue_equals_torch_path():
    for rows in (torch.tensor([0, 2, 5, 7, 8, 14]), torch.tensor([3, 4]), torch.arange(15)):
        q = torch.randn(rows.numel(), HQ * D, generator=torch.Generator().manual_seed(5))
        for window, sinks in VARIANTS:
            want = _attend(build("torch", CPU), rows, q, window, sinks)
            impl = FlashInferAttention(CPU, backend=OracleFlashInfer())
            got = _attend(impl, rows, q, window, sinks)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_flashinfer_plan_per_row_set_per_batch():
    oracle = OracleFlashInfer()
    impl = FlashInferAttention(CPU, backend=oracle)
    batch, positions, kbuf, vbuf, _ = _batch()
    impl.reset()
    for rows in (torch.tensor([0, 2, 5]), torch.tensor([1, 9])):  # two phases of a forward
        handle = impl.plan(batch, rows, positions[rows])
        for _layer in range(3):
            impl.run(handle, torch.randn(rows.numel(), HQ, D), kbuf, vbuf, 0.3)
    assert oracle.plans == 2 and oracle.resets == 1
    # window and full layers alternating (gpt-oss): one plan per row set and window
    handle = impl.plan(batch, torch.tensor([0, 2, 5]), positions[[0, 2, 5]])
    for layer in range(4):
        impl.run(handle, torch.randn(3, HQ, D), kbuf, vbuf, 0.3, 4 if layer % 2 else 0)
    assert oracle.plans == 4


def test_triton_glue_equals_torch_path():
    import os

    import pytest

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    rows = torch.tensor([0, 2, 5, 7, 8, 14])
    q = torch.randn(6, HQ * D, generator=torch.Generator().manual_seed(6)).to(DEV)
    for window, sinks in VARIANTS:
        sinks = None if sinks is None else sinks.to(DEV)
        want = _attend(build("torch", DEV), rows, q, window, sinks).cpu()
        got = _attend(build("triton", DEV), rows, q, window, sinks).cpu()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flashinfer_extend_on_a_gpu_equals_the_plan_oracle():
    """The real FlashInfer call (CUDA only) computes what the plan's CPU oracle computes."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang_relay_kernels.flashinfer_extend import FlashInferExtend, build_extend_plan

    gen = torch.Generator().manual_seed(11)
    kbuf = torch.randn(100, 2, 64, generator=gen, dtype=torch.float32).half()
    vbuf = torch.randn(100, 2, 64, generator=gen, dtype=torch.float32).half()
    slots = [torch.randperm(100, generator=gen)[:40], torch.randperm(100, generator=gen)[:9]]
    pos = torch.tensor([0, 3, 17, 39, 2, 8])
    q = torch.randn(6, 4, 64, generator=gen).half()
    fi = FlashInferExtend(torch.device("cuda"))
    for window, sinks in VARIANTS:  # plain; a window (Gemma 3); a window with sinks (gpt-oss)
        layout = build_extend_plan([4, 2], pos, [40, 9], slots, window)
        want = attend_with_plan_ref(layout, q, kbuf, vbuf, 0.125, sinks)
        fi.reset()
        fi.plan("k", layout, (4, 2, 64, 64), 0.125, torch.float16, torch.float16)
        s = None if sinks is None else sinks.cuda()
        got = fi.run("k", q.cuda(), kbuf.cuda(), vbuf.cuda(), s).float().cpu()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
