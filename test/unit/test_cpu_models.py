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


# ---- gpt-oss's sinks on torch_native ---------------------------------------------------------
# Two requests in a pool: one with a cached prefix and a 9-token extend, one a fresh 14-token
# prompt; a window of 6 keys (SGLang keeps 5) and GQA; the sinks of both signs.
HQ, HKV, DIM, WINDOW = 4, 2, 32, 6
PREFIX, EXTEND = [11, 0], [9, 14]

_SINKS_REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd


def extend(c):
    extend_attention_fwd(
        c["q"], c["k_ext"], c["v_ext"], c["out"], c["k_buf"], c["v_buf"], c["qo_indptr"],
        c["kv_indptr"], c["kv_indices"], None, True, None, c["max_ext"], 1.0, 1.0,
        sm_scale=c["scale"], sliding_window_size=c["window"] - 1, sinks=c["sinks"],
    )


RUN = {"extend": extend}
"""


def _sinks_batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(PREFIX, EXTEND, strict=True)]
    slots = torch.randperm(64, generator=g)[: sum(seq)]
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    req_to_token[0, : seq[0]], req_to_token[1, : seq[1]] = slots[: seq[0]], slots[seq[0] :]
    k_buf = torch.randn(64, HKV, DIM, generator=g)
    v_buf = torch.randn(64, HKV, DIM, generator=g)
    q = torch.randn(sum(EXTEND), HQ, DIM, generator=g)
    sinks = torch.tensor([2.5, -3.0, 0.0, 9.0])
    return seq, req_to_token, k_buf, v_buf, q, sinks


@pytest.fixture(scope="module")
def sink_kernel(tmp_path_factory):
    seq, req_to_token, k_buf, v_buf, q, sinks = _sinks_batch()
    ext = torch.cat(
        [req_to_token[i, p:s] for i, (p, s) in enumerate(zip(PREFIX, seq, strict=True))]
    )
    prefix = torch.cat([req_to_token[i, :p] for i, p in enumerate(PREFIX)])
    case = {
        "q": q, "k_ext": k_buf[ext].clone(), "v_ext": v_buf[ext].clone(),
        "out": torch.zeros_like(q), "k_buf": k_buf, "v_buf": v_buf,
        "qo_indptr": torch.tensor([0, EXTEND[0], sum(EXTEND)], dtype=torch.int32),
        "kv_indptr": torch.tensor([0, PREFIX[0], sum(PREFIX)], dtype=torch.int32),
        "kv_indices": prefix.to(torch.int64), "max_ext": max(EXTEND), "scale": DIM**-0.5,
        "window": WINDOW, "sinks": sinks,
    }  # fmt: skip
    return triton_outputs(_SINKS_REFERENCE, {"extend": [case]}, tmp_path_factory.mktemp("sinks"))


def _standin(decode: bool):
    """The stand-in's hook around SGLang's own torch_native attention (its sink-free
    ``_run_sdpa_forward_*``, the window SGLang applies), on :func:`_sinks_batch`."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as B

    seq, req_to_token, k_buf, v_buf, q, sinks = _sinks_batch()
    counts = [1, 1] if decode else EXTEND
    rows = torch.cat([torch.arange(s - n, s) for n, s in zip(counts, seq, strict=True)])
    starts = torch.tensor([0, EXTEND[0]])
    q = q[[int(starts[0]) + EXTEND[0] - 1, int(starts[1]) + EXTEND[1] - 1]] if decode else q
    pool = SimpleNamespace(get_key_buffer=lambda _: k_buf, get_value_buffer=lambda _: v_buf)
    backend = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        _make_sliding_window_mask=B._make_sliding_window_mask,
    )  # fmt: skip
    layer = SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=DIM, v_head_dim=DIM, layer_id=0,
                            sliding_window_size=WINDOW - 1, scaling=DIM**-0.5)  # fmt: skip
    fb = SimpleNamespace(
        seq_lens=torch.tensor(seq), req_pool_indices=torch.tensor([0, 1]), batch_size=2,
        extend_seq_lens=torch.tensor(EXTEND), extend_prefix_lens=torch.tensor(PREFIX),
    )  # fmt: skip

    def sglang(backend, q, k, v, layer, fb):  # SGLang's own path (its KV already in the pool)
        q = q.view(q.shape[0], HQ, DIM)
        out = torch.empty_like(q)
        run = B._run_sdpa_forward_decode if decode else B._run_sdpa_forward_extend
        lens = () if decode else (fb.extend_prefix_lens, fb.extend_seq_lens)
        run(backend, q, out, k_buf, v_buf, req_to_token, fb.req_pool_indices, fb.seq_lens, *lens,
            scaling=layer.scaling, enable_gqa=True, causal=True,
            sliding_window_size=WINDOW - 1)  # fmt: skip
        return out.reshape(q.shape[0], -1)

    hook = cpu_models.torch_native_decode_with_sinks if decode else (
        cpu_models.torch_native_extend_with_sinks)  # fmt: skip
    out = hook(sglang, backend, q.reshape(q.shape[0], -1), None, None, layer, fb, sinks=sinks)
    return out.reshape(-1, HQ, DIM), q, rows, seq, req_to_token, k_buf, v_buf, sinks


@pytest.mark.parametrize("decode", [False, True])
def test_gpt_oss_sinks_on_torch_native_equal_float64(decode):
    from sglang_relay.core.attention import positional_causal_attention

    out, q, rows, seq, req_to_token, k_buf, v_buf, sinks = _standin(decode)
    lo = 0
    for i, s in enumerate(seq):
        n = 1 if decode else EXTEND[i]
        slots = req_to_token[i, :s]
        want = positional_causal_attention(q[lo : lo + n].double(), k_buf[slots].double(),
                                           v_buf[slots].double(), rows[lo : lo + n], DIM**-0.5,
                                           WINDOW, sinks.double())  # fmt: skip
        torch.testing.assert_close(out[lo : lo + n].double(), want, rtol=1e-5, atol=1e-5)
        lo += n


def test_gpt_oss_sinks_on_torch_native_equal_sglangs_triton_kernel(sink_kernel):
    _, done = sink_kernel
    out = _standin(decode=False)[0]
    torch.testing.assert_close(out, done["extend"][0]["out"], rtol=1e-5, atol=1e-5)
