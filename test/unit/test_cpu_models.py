"""The CPU stand-in's torch versions of GPU-only pieces inside SGLang's model classes
(``runtime/standin/cpu_models.py``) against SGLang's own Triton kernels, run under the
Triton interpreter on CPU tensors in one subprocess, and against float64 written out here.

MiniMax-M2's q/k RMSNorm over all heads: ``rmsnorm_sumsq_kernel_serial`` (each row's sum of
squares of q, then of k) and ``rmsnorm_apply_kernel_serial`` (normalize over the full width
``D * tp_world`` with the all-rank sums, times the weight shard), launched with their
wrappers' grids (the wrappers assert CUDA tensors); widths that are not powers of two
exercise the kernels' masks. Tensor parallel is two shards of the heads whose sums add."""

from __future__ import annotations

import pytest
import torch
from triton_reference import triton_outputs

from sglang_relay.runtime.standin import cpu_models

_REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
import triton
from sglang.srt.models.minimax_m2 import (
    rmsnorm_apply_kernel_serial,
    rmsnorm_sumsq_kernel_serial,
)


def sumsq(c):
    q, k = c["q"], c["k"]
    n = q.shape[0]
    rmsnorm_sumsq_kernel_serial[(n,)](
        q, k, q.stride(0), k.stride(0), c["sums"], n, q.shape[1], k.shape[1],
        triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1]),
    )


def apply(c):
    q, k = c["q"], c["k"]
    n = q.shape[0]
    rmsnorm_apply_kernel_serial[(n,)](
        q, k, c["wq"], c["wk"], c["sums"], c["out_q"], c["out_k"], n, q.shape[1], k.shape[1],
        q.stride(0), k.stride(0), c["tp"], c["eps"],
        triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1]),
    )


RUN = {"sumsq": sumsq, "apply": apply}
"""

# (rows, q width, k width, dtype): MiniMax-M2's 48x128 / 8x128 at small scale, odd widths
SHAPES = [(5, 96, 48, torch.float32), (7, 256, 128, torch.bfloat16), (1, 80, 40, torch.float16)]
EPS = 1e-6


def _case(n, dq, dk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, dq, generator=g) * 3).to(dtype)
    k = (torch.randn(n, dk, generator=g) * 0.5).to(dtype)
    wq = (1 + 0.3 * torch.randn(dq, generator=g)).to(dtype)
    wk = (1 + 0.3 * torch.randn(dk, generator=g)).to(dtype)
    return q, k, wq, wk


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    cases = {"sumsq": [], "apply": []}
    for i, (n, dq, dk, dtype) in enumerate(SHAPES):
        q, k, wq, wk = _case(n, dq, dk, dtype, i)
        cases["sumsq"].append({"q": q, "k": k, "sums": torch.zeros(2 * n)})
        for tp, half in ((1, slice(None)), (2, slice(0, dq // 2))):  # tp 2: the first shard
            # the all-rank sums (at tp 2, this shard's plus the other's: the full rows')
            sums = torch.cat((q.float().square().sum(-1), k.float().square().sum(-1)))
            qs, ks = q[:, half].contiguous(), k[:, : dk // tp].contiguous()
            cases["apply"].append({
                "q": qs, "k": ks, "wq": wq[half].contiguous(), "wk": wk[: dk // tp].contiguous(),
                "sums": sums, "out_q": torch.empty_like(qs), "out_k": torch.empty_like(ks),
                "tp": tp, "eps": EPS, "full_q": q, "full_k": k, "full_wq": wq, "full_wk": wk,
            })  # fmt: skip
    return triton_outputs(_REFERENCE, cases, tmp_path_factory.mktemp("minimax"))


def test_minimax_sums_of_squares_equal_sglangs_kernel(kernels):
    fresh, done = kernels
    for c, ref in zip(fresh()["sumsq"], done["sumsq"], strict=True):
        ours = cpu_models.qk_sums_of_squares(c["q"], c["k"])
        torch.testing.assert_close(ours, ref["sums"], rtol=1e-6, atol=1e-4)
        exact = torch.cat((c["q"].double().square().sum(-1), c["k"].double().square().sum(-1)))
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-3)


def test_minimax_norm_equals_sglangs_kernel_and_float64_at_tp_1_and_2(kernels):
    fresh, done = kernels
    for c, ref in zip(fresh()["apply"], done["apply"], strict=True):
        oq, ok = cpu_models.qk_rms_apply(
            c["q"], c["k"], c["wq"], c["wk"], c["sums"], c["tp"], c["eps"]
        )
        # SGLang's kernel, element for element (both compute in float32, then round once)
        tol = {"rtol": 1e-5, "atol": 1e-5} if c["q"].dtype == torch.float32 else {}
        torch.testing.assert_close(oq, ref["out_q"], **tol)
        torch.testing.assert_close(ok, ref["out_k"], **tol)
        # float64: RMS over the full width (all shards), this shard's columns
        for out, full, w, x in ((oq, c["full_q"], c["full_wq"], c["q"]),
                                (ok, c["full_k"], c["full_wk"], c["k"])):  # fmt: skip
            f = full.double()
            normed = f * torch.rsqrt(f.square().mean(-1, keepdim=True) + EPS) * w.double()
            torch.testing.assert_close(out.double(), normed[:, : x.shape[1]],
                                       rtol=2e-2 if x.dtype != torch.float32 else 1e-5,
                                       atol=2e-2 if x.dtype != torch.float32 else 1e-5)  # fmt: skip
