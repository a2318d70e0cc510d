"""The runtime's GPU attention glue gives the torch path's attention: FlashInfer (plan per
active-row set, run per layer; its computation replaced by the plan's CPU oracle) and the
Triton kernel (under the interpreter without a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_relay.kernels.flashinfer_extend import attend_with_plan_ref
from sglang_relay.runtime import model_loop
from sglang_relay.runtime.model_loop import BatchPlan, attend_rows


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

    def run(self, key, q, kbuf, vbuf):
        layout, scale = self.layouts[key]
        return attend_with_plan_ref(layout, q, kbuf, vbuf, scale)


CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(monkeypatch, flashinfer, attention="torch", dev=CPU):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, slots = 4, 2, 16, 200
    kbuf, vbuf = (
        torch.randn(slots, hkv, d, generator=gen),
        torch.randn(slots, hkv, d, generator=gen),
    )
    # two requests: 10 cached + 6 new tokens, and 0 cached + 9 new tokens
    prefix, ext = [10, 0], [6, 9]
    req_to_token = torch.zeros(2, 32, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)
    req_to_token[0, :16] = perm[:16].int()
    req_to_token[1, :9] = perm[16:25].int()
    positions = torch.cat([torch.arange(10, 16), torch.arange(0, 9)])
    out_cache_loc = torch.cat([req_to_token[0, 10:16], req_to_token[1, :9]]).long()
    kbuf, vbuf, req_to_token = kbuf.to(dev), vbuf.to(dev), req_to_token.to(dev)
    fb = SimpleNamespace(
        out_cache_loc=out_cache_loc.to(dev),
        positions=positions.to(dev),
        req_pool_indices=torch.tensor([0, 1], device=dev),
    )
    pool = SimpleNamespace(get_key_buffer=lambda _: kbuf, get_value_buffer=lambda _: vbuf)

    def write(pool_, ra, loc, k, v):
        kbuf[loc] = k.reshape(-1, hkv, d)
        vbuf[loc] = v.reshape(-1, hkv, d)

    monkeypatch.setattr(model_loop, "_write_kv", write)
    plan = BatchPlan(
        groups=[], span_rows=torch.zeros(0, dtype=torch.long), span_src=torch.zeros(0),
        span_delta=torch.zeros(0), normal_rows=torch.zeros(0), row_starts=[0, 6],
        seq_lens=[p + n for p, n in zip(prefix, ext, strict=True)], num_rows=15,
        kv_pool=pool, req_to_token=req_to_token, flashinfer=flashinfer,
        attention="flashinfer" if flashinfer is not None else attention,
    )  # fmt: skip
    ra = SimpleNamespace(
        layer_id=0, tp_q_head_num=hq, tp_k_head_num=hkv, qk_head_dim=d, v_head_dim=d, scaling=0.3
    )
    return fb, plan, ra, gen


def test_flashinfer_glue_equals_torch_path(monkeypatch):
    oracle = OracleFlashInfer()
    for rows in (torch.tensor([0, 2, 5, 7, 8, 14]), torch.tensor([3, 4]), torch.arange(15)):
        results = []
        for fi in (None, oracle):
            fb, plan, ra, gen = _batch(monkeypatch, fi)
            n = rows.numel()
            q = torch.randn(n, 4 * 16, generator=gen)
            k = torch.randn(n, 2 * 16, generator=gen)
            v = torch.randn(n, 2 * 16, generator=gen)
            results.append(attend_rows(fb, plan, ra, q, k, v, rows, rows))
        torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_one_plan_per_row_set_per_batch(monkeypatch):
    oracle = OracleFlashInfer()
    fb, plan, ra, gen = _batch(monkeypatch, oracle)
    sets = [torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5]), torch.tensor([1, 9]),
            torch.tensor([0, 2, 5])]  # fmt: skip
    for rows in sets:  # e.g. the layers of a forward
        n = rows.numel()
        q, k, v = torch.randn(n, 64), torch.randn(n, 32), torch.randn(n, 32)
        attend_rows(fb, plan, ra, q, k, v, rows, rows)
    assert oracle.plans == 2 and oracle.resets == 1


def test_triton_glue_equals_torch_path(monkeypatch):
    import os

    import pytest

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    rows = torch.tensor([0, 2, 5, 7, 8, 14])
    results = []
    for attention in ("torch", "triton"):
        fb, plan, ra, gen = _batch(monkeypatch, None, attention, DEV)
        q = torch.randn(6, 64, generator=gen)
        k, v = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
        args = [x.to(DEV) for x in (q, k, v, rows)]
        results.append(attend_rows(fb, plan, ra, *args, rows).cpu())
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_flashinfer_extend_on_a_gpu_equals_the_plan_oracle():
    """The real FlashInfer call (CUDA only) computes what the plan's CPU oracle computes."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang_relay.kernels.flashinfer_extend import FlashInferExtend, build_extend_plan

    gen = torch.Generator().manual_seed(11)
    kbuf = torch.randn(100, 2, 64, generator=gen, dtype=torch.float32).half()
    vbuf = torch.randn(100, 2, 64, generator=gen, dtype=torch.float32).half()
    slots = [torch.randperm(100, generator=gen)[:40], torch.randperm(100, generator=gen)[:9]]
    pos = torch.tensor([0, 3, 17, 39, 2, 8])
    q = torch.randn(6, 4, 64, generator=gen).half()
    layout = build_extend_plan([4, 2], pos, [40, 9], slots)
    want = attend_with_plan_ref(layout, q, kbuf, vbuf, 0.125)
    fi = FlashInferExtend(torch.device("cuda"))
    fi.plan("k", layout, (4, 2, 64, 64), 0.125, torch.float16, torch.float16)
    got = fi.run("k", q.cuda(), kbuf.cuda(), vbuf.cuda()).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
