"""Triton kernels under the Triton interpreter (CPU) against their torch references, on
random inputs of several shapes and dtypes."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_relay.core.rope import build_cos_sin_cache, delta_cos_sin, rerotate_keys

pytest.importorskip("triton")


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def kern():
    """The kernel modules: compiled on a GPU, interpreted on the CPU (test/conftest.py)."""
    if DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from sglang_relay_kernels import rows, splice

    return splice, rows


def _pool(layers, slots, heads, dim, dtype, gen):
    k = [torch.randn(slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    v = [torch.randn(slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    return k, v


@pytest.mark.parametrize(
    "heads, dim, rot_dim, is_neox, dtype, n",
    [
        (3, 64, 64, True, torch.float32, 17),  # SmolLM2-like head, odd token count
        (2, 128, 128, True, torch.bfloat16, 5),  # Llama-like, bf16 pool
        (4, 96, 32, True, torch.float32, 9),  # partial rotary, non-power-of-2 head dim
        (1, 64, 64, False, torch.float16, 12),  # GPT-J pairing
    ],
)
def test_splice_rerotate_matches_reference(kern, heads, dim, rot_dim, is_neox, dtype, n):
    splice, _ = kern
    gen = torch.Generator().manual_seed(heads * 1000 + dim + n)
    slots, layers = 64, 3
    k, v = _pool(layers, slots, heads, dim, dtype, gen)
    perm = torch.randperm(slots, generator=gen)
    src, dst = perm[:n], perm[n : 2 * n]  # disjoint, unordered
    delta = torch.randint(-200, 200, (n,), generator=gen)
    cache = build_cos_sin_cache(rot_dim, 512)
    cos, sin = delta_cos_sin(cache, delta)

    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]
    k_src = [t[src].clone() for t in k]  # what the source slots held
    splice.splice_rerotate_ref(k_ref, v_ref, src, dst, cos, sin, is_neox=is_neox)
    kd, vd = [t.to(DEV) for t in k], [t.to(DEV) for t in v]
    on = [x.to(DEV) for x in (src, dst, cos, sin)]
    splice.splice_rerotate_triton(kd, vd, *on, is_neox=is_neox)
    k, v = [t.cpu() for t in kd], [t.cpu() for t in vd]
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for layer in range(layers):
        torch.testing.assert_close(k[layer], k_ref[layer], atol=tol, rtol=tol)
        assert torch.equal(v[layer], v_ref[layer])
        # partial rotary (GLM-4.x, MiniMax-M2): the dims past rot_dim never move, bit for bit
        assert torch.equal(k[layer][dst][..., rot_dim:], k_src[layer][..., rot_dim:])
        assert torch.equal(k_ref[layer][dst][..., rot_dim:], k_src[layer][..., rot_dim:])
    # the reference is itself re-rotation: spot-check one layer against rerotate_keys
    expect = rerotate_keys(k_ref[0][src], delta, cache, is_neox=is_neox)
    torch.testing.assert_close(k[0][dst], expect, atol=tol, rtol=tol)


def test_splice_rerotate_stacked_pool_is_one_launch(kern):
    splice, _ = kern
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(4, 40, 2, 64, generator=gen)
    v = torch.randn(4, 40, 2, 64, generator=gen)
    src, dst = torch.arange(0, 10), torch.arange(20, 30)
    cos, sin = delta_cos_sin(build_cos_sin_cache(64, 256), torch.arange(10) * 7 - 30)
    k_ref, v_ref = k.clone(), v.clone()
    splice.splice_rerotate_ref(list(k_ref), list(v_ref), src, dst, cos, sin)
    kd, vd = k.to(DEV), v.to(DEV)
    splice.splice_rerotate_triton(kd, vd, *[x.to(DEV) for x in (src, dst, cos, sin)])
    k, v = kd.cpu(), vd.cpu()
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_ref)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(k[:, untouched], k_ref[:, untouched])


@pytest.mark.parametrize("width, n, dtype", [(576, 13, torch.float32), (2500, 4, torch.bfloat16)])
def test_gather_and_scatter_rows(kern, width, n, dtype):
    _, rows = kern
    gen = torch.Generator().manual_seed(width + n)
    x = torch.randn(50, width, generator=gen).to(dtype)
    idx = torch.randperm(50, generator=gen)[:n]
    assert torch.equal(rows.gather_rows_triton(x.to(DEV), idx.to(DEV)).cpu(), x[idx])
    out, out_ref = x.clone().to(DEV), x.clone()
    vals = torch.randn(n, width, generator=gen).to(dtype)
    rows.scatter_rows_triton(out, idx.to(DEV), vals.to(DEV))
    out_ref[idx] = vals
    assert torch.equal(out.cpu(), out_ref)
    # a [slots, H, D] KV buffer goes through as a 2-D view
    kv = torch.randn(30, 3, 64, generator=gen).to(DEV)
    idx = idx.to(DEV)
    assert torch.equal(
        rows.gather_rows_triton(kv.view(30, -1), idx[:3] % 30), kv[idx[:3] % 30].view(3, -1)
    )


def test_dispatch_uses_the_reference_on_cpu(monkeypatch):
    import sglang_relay_kernels as kernels

    x = torch.zeros(2, 2)
    assert not kernels.use_triton(x)
    monkeypatch.setenv("SGLANG_RELAY_KERNELS", "triton")
    assert kernels.use_triton(x)
    monkeypatch.setenv("SGLANG_RELAY_KERNELS", "bogus")
    with pytest.raises(ValueError, match="SGLANG_RELAY_KERNELS"):
        kernels.use_triton(x)


def test_extend_attention_choice(monkeypatch):
    from sglang_relay_kernels import pick_extend_attention

    monkeypatch.delenv("SGLANG_RELAY_KERNELS", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_extend_attention("flashinfer", cpu) == "torch"
    assert pick_extend_attention("torch_native", cuda) == "torch"
    assert pick_extend_attention("triton", cuda) == "triton"
    assert pick_extend_attention("fa3", cuda) == "torch"
    assert pick_extend_attention(None, cuda) == "torch"
    # an FP8 cache under FlashInfer: the Triton kernel (whose FP8 path the tests run)
    assert pick_extend_attention("flashinfer", cuda, torch.float8_e4m3fn) == "triton"
    # MLA latent rows: the torch path under any server backend
    for backend in ("triton", "flashinfer", "fa3"):
        assert pick_extend_attention(backend, cuda, latent=True) == "torch"
    monkeypatch.setenv("SGLANG_RELAY_KERNELS", "triton")  # interpreted on a CPU
    assert pick_extend_attention("torch_native", cpu) == "triton"
    monkeypatch.setenv("SGLANG_RELAY_KERNELS", "torch")
    assert pick_extend_attention("triton", cuda) == "torch"


def _attention_vs_reference(
    hq, hkv, dim, dtype, slots, ctx_lens, pos, seed, tol, kv_dtype=None, window=0, sinks=None
):
    """Run the Triton attention on requests whose contexts are ``ctx_lens`` random pool slots
    and whose active rows sit at ``pos``; compare with the pure-torch specification (in
    float64 where a window or sinks are given)."""
    from sglang_relay.core.attention import positional_causal_attention
    from sglang_relay_kernels import attention

    gen = torch.Generator().manual_seed(seed)
    kbuf = torch.randn(slots, hkv, dim, generator=gen).to(kv_dtype or dtype)
    vbuf = torch.randn(slots, hkv, dim, generator=gen).to(kv_dtype or dtype)
    ctx = torch.randperm(slots, generator=gen)[: sum(ctx_lens)].split(ctx_lens)
    n = sum(p.numel() for p in pos)
    q = torch.randn(n, hq, dim, generator=gen).to(dtype)
    offsets = torch.tensor([0, *ctx_lens[:-1]]).cumsum(0)
    kv_start = torch.cat([offsets[i].repeat(p.numel()) for i, p in enumerate(pos)])
    got = attention.positional_attention_triton(
        *[x.to(DEV) for x in (q, kbuf, vbuf, torch.cat(pos), kv_start, torch.cat(ctx))],
        scale=dim**-0.5,
        window=window,
        sinks=None if sinks is None else sinks.to(DEV),
    ).cpu()
    ref = torch.float64 if window or sinks is not None else torch.float32
    want = torch.cat(
        [
            positional_causal_attention(
                qr.to(ref), kbuf[c].to(ref), vbuf[c].to(ref), p, dim**-0.5,
                window=window, sinks=None if sinks is None else sinks.to(ref),
            )
            for qr, c, p in zip(q.split([p.numel() for p in pos]), ctx, pos, strict=True)
        ]
    )  # fmt: skip
    torch.testing.assert_close(got.to(ref), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, with_sinks", [(1, False), (7, True), (100, False), (0, True)])
def test_positional_attention_window_and_sinks_match_float64(kern, dtype, window, with_sinks):
    """gpt-oss / Gemma 3 layers: a window of 1 (a row sees itself only), one that starts
    mid key-block (rows far apart in one tile), one wider than the context, and sinks (large
    of both signs: a sink that outweighs every key, one that takes nothing) with and
    without a window, against the float64 specification."""
    pos = [torch.tensor([0, 1, 63, 64, 65, 149]), torch.arange(20, 60), torch.tensor([5, 69])]
    sinks = torch.tensor([3.0, -30.0, 0.5, 12.0, -1.0, 40.0]) if with_sinks else None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _attention_vs_reference(
        6, 2, 40, dtype, 500, [150, 60, 70], pos, 11, tol, window=window, sinks=sinks
    )


@pytest.mark.parametrize(
    "hq, hkv, dim, dtype", [(4, 4, 64, torch.float32), (6, 2, 80, torch.bfloat16)]
)
def test_positional_attention_matches_reference(kern, hq, hkv, dim, dtype):
    """Active rows of two requests (non-contiguous positions) over their pooled contexts."""
    pos = [torch.tensor([0, 1, 63, 64, 65, 149]), torch.tensor([5, 69])]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _attention_vs_reference(hq, hkv, dim, dtype, 400, [150, 70], pos, hq + dim, tol)


@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float32, torch.float8_e4m3fn),
        (torch.float32, torch.float8_e5m2),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.bfloat16),
    ],
)
def test_positional_attention_reads_a_kv_cache_of_another_dtype(kern, dtype, kv_dtype):
    """An FP8 (or bf16 under fp32) KV cache: the kernel reads its elements (no scales) and
    equals the float32 specification over the same elements."""
    pos = [torch.tensor([0, 2, 40, 99]), torch.tensor([7, 30])]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _attention_vs_reference(8, 2, 64, dtype, 200, [100, 31], pos, 5, tol, kv_dtype)


def test_tiles_split_requests_and_long_runs():
    from sglang_relay_kernels.attention import make_tiles

    kv_start = torch.tensor([0] * 5 + [300] * 1 + [301] * 9)
    first, count, start = make_tiles(kv_start, block_m=4)
    assert first.tolist() == [0, 4, 5, 6, 10, 14]
    assert count.tolist() == [4, 1, 1, 4, 4, 1]
    assert start.tolist() == [0, 0, 300, 301, 301, 301]
    assert [x.numel() for x in make_tiles(torch.zeros(0, dtype=torch.int64))] == [0, 0, 0]
    # host starts, tiles placed on the kernel's device (no device->host sync per build)
    on_dev = make_tiles(kv_start, block_m=4, device=torch.device(DEV))
    assert all(x.device.type == torch.device(DEV).type for x in on_dev)
    assert [x.tolist() for x in on_dev] == [first.tolist(), count.tolist(), start.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positional_attention_dense_and_sparse_tiles(kern, dtype):
    """A dense run of 70 rows (three tiles, the last one partly empty) beside sparse rows
    spread over a long context, grouped-query heads, odd head size."""
    pos = [torch.arange(10, 80), torch.tensor([0, 3, 130, 131, 260, 409])]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    _attention_vs_reference(4, 2, 24, dtype, 600, [90, 410], pos, 7, tol)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_splice_rerotate_fp8_pool_rounds_once_and_saturates(dtype, monkeypatch):
    """An FP8 KV pool (SGLang's FP8 pools read through their float8 views): every spliced
    key equals the float64 rotation of the stored FP8 key rounded once to FP8 (at most one
    FP8 step away where float32 and float64 round differently), saturated at the format's
    largest value; values and sources move bit for bit. FP8 buffers always take the torch
    path: Triton's interpreter drops mantissa bits converting to float8 (7.9986 -> 4.0
    instead of 8.0 measured), so no Triton FP8 store is verified on this machine."""
    import sglang_relay_kernels as kernels

    monkeypatch.setenv("SGLANG_RELAY_KERNELS", "triton")  # forced Triton still falls back
    gen = torch.Generator().manual_seed(31)
    heads, dim, n, slots = 2, 64, 11, 48
    top = torch.finfo(dtype).max
    k = (torch.randn(slots, heads, dim, generator=gen) * 4).to(dtype)
    k[0, 0, :] = top  # a saturated key: its rotation would step past the largest value
    v = torch.randn(slots, heads, dim, generator=gen).to(dtype)
    src, dst = torch.arange(0, n), torch.arange(20, 20 + n)
    delta = torch.randint(-300, 300, (n,), generator=gen)
    cos, sin = delta_cos_sin(build_cos_sin_cache(dim, 512), delta)

    # independent float64 rotation (neox pairs j, j + dim/2) of the stored FP8 keys
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = delta.double()[:, None] * inv[None, :]  # [n, dim/2]
    x = k[src].double()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    want = rot.clamp(-top, top).to(dtype).double()

    kd, vd = [k.clone()], [v.clone()]
    kernels.splice_rerotate(kd, vd, src, dst, cos, sin)
    got = kd[0][dst].double()
    assert torch.isfinite(got).all() and got.abs().max() <= top
    assert (rot.abs() > top).any()  # the saturated row was exercised
    mant = 3 if dtype == torch.float8_e4m3fn else 2  # one step at each value's magnitude
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-3))) - mant)
    assert ((got - want).abs() <= step + 1e-12).all()
    assert (got == want).float().mean() > 0.98  # rounding ties apart, bit-exact
    assert torch.equal(vd[0][dst].view(torch.uint8), v[src].view(torch.uint8))
    assert torch.equal(kd[0][src].view(torch.uint8), k[src].view(torch.uint8))
