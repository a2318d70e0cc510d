"""The CPU stand-in's torch versions of GPU-only pieces inside SGLang's model classes
(``runtime/standin/cpu_models.py``) against SGLang's own Triton kernels, run under the
Triton interpreter on CPU tensors in one subprocess, and against float64 written out here.

MiniMax-M2's q/k RMSNorm over all heads: ``rmsnorm_sumsq_kernel_serial`` (each row's sum of
squares of q, then of k) and ``rmsnorm_apply_kernel_serial`` (normalize over the full width
``D * tp_world`` with the all-rank sums, times the weight shard), launched with their
wrappers' grids (the wrappers assert CUDA tensors); widths that are not powers of two
exercise the kernels' masks. Tensor parallel is two shards of the heads whose sums add."""

from __future__ import annotations

import math

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


# ---- DeepSeek MLA on torch_native -------------------------------------------------------------
# The stand-in sends every MLA forward down SGLang's absorbed path, which hands torch_native
# the latent rows as one KV head: q [n, H, r + p], k [n, 1, r + p], v = k[..., :r] [n, 1, r],
# save_kv_cache=True (``forward_absorb_core``). SGLang's real MLA pool keeps k alone and gives
# its [..., :r] view as the value buffer. The reference is SGLang's Triton extend kernel and
# its MLA decode kernel (has_mla: V taken from the loaded K tile, right only at r + p of 288
# or 576, so r = 256 and p = 32 here). Two requests: an 11-token cached prefix then 9 new
# tokens, and a fresh 14-token prompt; then one decode step for both.
MLA_R, MLA_P, MLA_H = 256, 32, 4
# attn_mqa.scaling: (qk_nope + p)^-0.5 * yarn_get_mscale(factor 40, mscale_all_dim 1)^2, with
# qk_nope = 64: not (r + p)^-0.5
MLA_SCALE = (64 + MLA_P) ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
MLA_PREFIX, MLA_EXTEND = [11, 0], [9, 14]
MLA_SEQ = [p + e for p, e in zip(MLA_PREFIX, MLA_EXTEND, strict=True)]  # after the extend
MLA_REQS, MLA_SLOTS, MLA_SPLITS = [1, 3], 64, 4  # req_to_token rows; pool size; decode splits

_MLA_REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd


def extend(c):
    extend_attention_fwd(
        c["q"], c["k_ext"], c["v_ext"], c["out"], c["k_buf"], c["v_buf"], c["qo_indptr"],
        c["kv_indptr"], c["kv_indices"], None, True, None, c["max_ext"], 1.0, 1.0,
        sm_scale=c["scale"],
    )


def decode(c):
    decode_attention_fwd(
        c["q"], c["k_buf"], c["v_buf"], c["out"], c["kv_indptr"], c["kv_indices"],
        c["attn_logits"], c["attn_lse"], c["num_kv_splits"], c["max_kv_splits"], c["scale"],
        1.0, 1.0, has_mla=True,
    )


RUN = {"extend": extend, "decode": decode}
"""


def _mla_batch(seed=5):
    """Per request (positions 0..seq, the decode token last): its pool slots and latent rows
    ``[seq + 1, 1, r + p]``; the extend's queries ``[sum(EXTEND), H, r + p]`` and the
    decode's ``[2, H, r + p]``."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + 1 for s in MLA_SEQ]
    perm = 1 + torch.randperm(MLA_SLOTS, generator=g)[: sum(lens)]  # slot 0 is SGLang's pad
    slots = list(perm.split(lens))
    rows = [torch.randn(n, 1, MLA_R + MLA_P, generator=g) for n in lens]
    q_ext = torch.randn(sum(MLA_EXTEND), MLA_H, MLA_R + MLA_P, generator=g)
    q_dec = torch.randn(len(lens), MLA_H, MLA_R + MLA_P, generator=g)
    return slots, rows, q_ext, q_dec


def _mla_pool_rows(upto):
    """The latent buffer ``[slots + 1, 1, r + p]`` holding each request's first
    ``upto[i]`` rows, as SGLang's pool lays them out (written here, independently)."""
    slots, rows, _, _ = _mla_batch()
    buf = torch.zeros(MLA_SLOTS + 1, 1, MLA_R + MLA_P)
    for s, x, n in zip(slots, rows, upto, strict=True):
        buf[s[:n]] = x[:n]
    return buf


@pytest.fixture(scope="module")
def mla_kernels(tmp_path_factory):
    slots, rows, q_ext, q_dec = _mla_batch()
    # extend: the new rows as k_extend / v_extend, the prefix read from the pool (which the
    # Triton backend has already written the new rows into); v is the pool's [..., :r] view
    k_ext = torch.cat([x[p:s] for x, p, s in zip(rows, MLA_PREFIX, MLA_SEQ, strict=True)])
    buf = _mla_pool_rows(MLA_SEQ)
    extend = {
        "q": q_ext, "k_ext": k_ext, "v_ext": k_ext[..., :MLA_R].contiguous(),
        "out": torch.zeros(q_ext.shape[0], MLA_H, MLA_R), "k_buf": buf,
        "v_buf": buf[..., :MLA_R], "scale": MLA_SCALE, "max_ext": max(MLA_EXTEND),
        "qo_indptr": torch.tensor([0, MLA_EXTEND[0], sum(MLA_EXTEND)], dtype=torch.int32),
        "kv_indptr": torch.tensor([0, MLA_PREFIX[0], sum(MLA_PREFIX)], dtype=torch.int32),
        "kv_indices": torch.cat([s[:p] for s, p in zip(slots, MLA_PREFIX, strict=True)]),
    }  # fmt: skip
    # decode: every row (the decode token's written) from the pool, the MLA kernel's V view
    buf = _mla_pool_rows([s + 1 for s in MLA_SEQ])
    lens = torch.tensor([s + 1 for s in MLA_SEQ])
    decode = {
        "q": q_dec, "k_buf": buf, "v_buf": buf[..., :MLA_R],
        "out": torch.zeros(q_dec.shape[0], MLA_H, MLA_R), "scale": MLA_SCALE,
        "kv_indptr": torch.cat((torch.zeros(1), lens.cumsum(0))).to(torch.int32),
        "kv_indices": torch.cat(slots),
        "attn_logits": torch.empty(2, MLA_H, MLA_SPLITS, MLA_R),
        "attn_lse": torch.empty(2, MLA_H, MLA_SPLITS),
        "num_kv_splits": torch.tensor([MLA_SPLITS, 2], dtype=torch.int32),
        "max_kv_splits": MLA_SPLITS,
    }  # fmt: skip
    cases = {"extend": [extend], "decode": [decode]}
    return triton_outputs(_MLA_REFERENCE, cases, tmp_path_factory.mktemp("mla"))


@pytest.fixture(scope="module")
def mla_standin():
    """SGLang's ``TorchNativeAttnBackend`` over a real ``MLATokenToKVPool`` and
    ``ReqToTokenPool``, on an ``attn_mqa``-shaped ``RadixAttention``, called as
    ``forward_absorb_core`` calls it: (extend out ``[23, H * r]``, the pool's buffer after
    it, decode out ``[2, H * r]``, the pool's buffer after it)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_parallel

    slots, rows, q_ext, q_dec = _mla_batch()
    pool = MLATokenToKVPool(MLA_SLOTS, 1, torch.float32, MLA_R, MLA_P, 1, "cpu", False)
    reqs = ReqToTokenPool(4, 32, "cpu", False)
    for req, s in zip(MLA_REQS, slots, strict=True):
        reqs.req_to_token[req, : len(s)] = s.to(torch.int32)
    attn = RadixAttention(num_heads=MLA_H, head_dim=MLA_R + MLA_P, scaling=MLA_SCALE,
                          num_kv_heads=1, layer_id=0, v_head_dim=MLA_R)  # fmt: skip
    runner = SimpleNamespace(device="cpu", req_to_token_pool=reqs, token_to_kv_pool=pool)
    backend = TorchNativeAttnBackend(runner)
    req_idx = torch.tensor(MLA_REQS)

    def batch(mode, seq, new, **extend):
        loc = torch.cat([s[q - n : q] for s, q, n in zip(slots, seq, new, strict=True)])
        fb = ForwardBatch(forward_mode=mode, batch_size=2, input_ids=torch.zeros_like(loc),
                          req_pool_indices=req_idx, seq_lens=torch.tensor(seq),
                          out_cache_loc=loc, seq_lens_sum=sum(seq), **extend)  # fmt: skip
        backend.init_forward_metadata(fb)
        k = torch.cat([x[q - n : q] for x, q, n in zip(rows, seq, new, strict=True)])
        return fb, k

    with get_parallel().override(dcp_enabled=False):  # what set_kv_buffer asks (no DCP)
        # the cached prefix, as an earlier forward left it
        pool.set_kv_buffer(attn, slots[0][: MLA_PREFIX[0]], rows[0][: MLA_PREFIX[0]], None)
        fb, k = batch(ForwardMode.EXTEND, MLA_SEQ, MLA_EXTEND,
                      extend_prefix_lens=torch.tensor(MLA_PREFIX),
                      extend_seq_lens=torch.tensor(MLA_EXTEND), extend_prefix_lens_cpu=MLA_PREFIX,
                      extend_seq_lens_cpu=MLA_EXTEND)  # fmt: skip
        out_ext = backend.forward_extend(q_ext, k, k[..., :MLA_R], attn, fb, save_kv_cache=True)
        buf_ext = pool.get_key_buffer(0).clone()
        fb, k = batch(ForwardMode.DECODE, [s + 1 for s in MLA_SEQ], [1, 1])
        out_dec = backend.forward_decode(q_dec, k, k[..., :MLA_R], attn, fb, save_kv_cache=True)
    return out_ext, buf_ext, out_dec, pool.get_key_buffer(0).clone()


def test_mla_standin_writes_the_latent_rows_sglangs_pool_keeps(mla_standin):
    _, buf_ext, _, buf_dec = mla_standin
    assert torch.equal(buf_ext, _mla_pool_rows(MLA_SEQ))
    assert torch.equal(buf_dec, _mla_pool_rows([s + 1 for s in MLA_SEQ]))


def test_mla_on_torch_native_equals_float64(mla_standin):
    """Both steps against MQA in float64 over each request's latent rows (V = their first
    r columns), at the absorbed layer's scale."""
    from sglang_relay.core.attention import positional_causal_attention

    out_ext, _, out_dec, _ = mla_standin
    _, rows, q_ext, q_dec = _mla_batch()
    lo = 0
    for i, (p, s) in enumerate(zip(MLA_PREFIX, MLA_SEQ, strict=True)):
        for q, out, pos in ((q_ext[lo : lo + s - p], out_ext[lo : lo + s - p], range(p, s)),
                            (q_dec[i : i + 1], out_dec[i : i + 1], [s])):  # fmt: skip
            kv = rows[i][: pos[-1] + 1].double()
            want = positional_causal_attention(q.double(), kv, kv[..., :MLA_R],
                                               torch.tensor(list(pos)), MLA_SCALE)  # fmt: skip
            got = out.view(-1, MLA_H, MLA_R).double()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        lo += s - p


def test_mla_extend_on_torch_native_equals_sglangs_triton_kernel(mla_standin, mla_kernels):
    _, done = mla_kernels
    out = mla_standin[0].view(-1, MLA_H, MLA_R)
    torch.testing.assert_close(out, done["extend"][0]["out"], rtol=1e-5, atol=1e-5)


def test_mla_decode_on_torch_native_equals_sglangs_triton_mla_kernel(mla_standin, mla_kernels):
    _, done = mla_kernels
    out = mla_standin[2].view(-1, MLA_H, MLA_R)
    torch.testing.assert_close(out, done["decode"][0]["out"], rtol=1e-5, atol=1e-5)


def test_registered_torch_native_handler_takes_the_absorbed_method(monkeypatch):
    """Before the stand-in registers it, torch_native falls back to Triton's handler, which
    takes the up-projected MHA for an extend with no cached prefix; after, the same extend
    (and a decode) is absorbed MLA, and SGLang's AMX choice passes through."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    registry = handler.AttentionBackendRegistry
    monkeypatch.setattr(registry, "_handlers", dict(registry._handlers))  # undone at teardown
    monkeypatch.delitem(registry._handlers, "torch_native", raising=False)
    # Triton's handler reads the published exec config (deterministic inference: off)
    exec_cfg = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(handler, "get_exec", lambda: exec_cfg)
    attn = SimpleNamespace(fused_qkv_a_proj_with_mqa=object())  # what the MLA sub-type reads
    fresh = SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_prefix_lens_cpu=[0, 0])
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, extend_prefix_lens_cpu=None)
    assert registry.get_handler("torch_native") is handler.handle_attention_triton
    assert registry.get_handler("torch_native")(attn, fresh) == AttnForwardMethod.MHA

    cpu_models.register_mla_on_torch_native()
    h = registry.get_handler("torch_native")
    assert h is cpu_models.mla_absorbed_on_torch_native
    assert h(attn, fresh) == AttnForwardMethod.MLA
    assert h(attn, decode) == AttnForwardMethod.MLA
    amx = SimpleNamespace(fused_qkv_a_proj_with_mqa=object(), use_intel_amx_backend=True)
    assert h(amx, fresh) == AttnForwardMethod.MLA_FUSED_ROPE_CPU
    assert registry.get_handler("triton") is handler.handle_attention_triton  # untouched
