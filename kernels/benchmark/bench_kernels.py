"""GPU micro-benchmark of the relay kernels against the copy roofline.

    python kernels/benchmark/bench_kernels.py            # Llama-3.1-8B shapes, bf16, on cuda:0
    python kernels/benchmark/bench_kernels.py --layers 28 --kv-heads 4 --head-dim 128   # Qwen2-7B

For each relayed span length it times (CUDA events, median of --iters):

* splice + re-rotate, Triton (one launch per layer, as the runtime calls it) and the torch
  reference;
* gather of selected tokens' hidden states (``[tokens, hidden]``), Triton vs ``x[idx]``;
* the roofline: a device-to-device ``copy_`` of the same number of bytes;
* the relay-extend attention (Triton, tiled) for the dense layers (every span row active)
  and a selective layer (20 % of the rows), in TFLOP/s, beside SDPA's causal attention over
  the same context (the stock prefill's attention, contiguous, no paging).

Bytes moved = what the kernel must read plus write (span K and V of every layer, read once
and written once). A well-behaved kernel reaches 70-90 % of the copy bandwidth; the splice
of a 4K-token span on an 8B model moves 1 GiB, about 0.4 ms at 2.5 TB/s.
Needs a CUDA device (the CPU tests run the same kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

from sglang_relay.core.rope import build_cos_sin_cache, delta_cos_sin
from sglang_relay_kernels import attention, rows, splice


def _time(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _attention(n: int, args, dev, dtype) -> None:
    """Relay-extend attention over an ``n``-token context, dense and selective rows."""
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    kbuf = torch.randn(n, hkv, d, device=dev, dtype=dtype)
    vbuf = torch.randn(n, hkv, d, device=dev, dtype=dtype)
    slots = torch.randperm(n, device=dev)  # the request's slots, by position
    for label, pos in (
        ("dense", torch.arange(n, device=dev)),
        ("20% rows", torch.randperm(n, device=dev)[: n // 5].sort().values),
    ):
        q = torch.randn(pos.numel(), hq, d, device=dev, dtype=dtype)
        kv_start = torch.zeros_like(pos)
        tiles = attention.make_tiles(kv_start)
        ms = _time(
            functools.partial(
                attention.positional_attention_triton,
                *(q, kbuf, vbuf, pos, kv_start, slots, d**-0.5),
                tiles=tiles,
            ),
            args.iters,
        )
        flops = 4 * hq * d * float((pos + 1).sum())
        line = f"{n:>6} {'attention ' + label:<22} {ms:>8.3f} {flops / ms / 1e9:>7.1f}T"
        if label == "dense":
            qs = q.transpose(0, 1)[None]
            ks = kbuf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
            vs = vbuf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
            sdpa = _time(
                functools.partial(
                    torch.nn.functional.scaled_dot_product_attention, qs, ks, vs, is_causal=True
                ),
                args.iters,
            )
            line += f"   SDPA causal {sdpa:.3f} ms ({flops / sdpa / 1e9:.1f}T)"
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--pool-slots", type=int, default=200_000)
    p.add_argument("--spans", default="256,1024,4096,16384")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device (CPU: run kernels/tests instead)", file=sys.stderr)
        return 1
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    shape = (args.pool_slots, args.kv_heads, args.head_dim)
    k = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(args.layers)]
    v = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(args.layers)]
    cache = build_cos_sin_cache(args.head_dim, 32768).to(dev)
    hidden = torch.randn(args.pool_slots, args.hidden, device=dev, dtype=dtype)
    print(f"{torch.cuda.get_device_name(0)}, {args.dtype}, {args.layers} layers x "
          f"{args.kv_heads} KV heads x {args.head_dim}")  # fmt: skip
    print(f"{'span':>6} {'kernel':<22} {'ms':>8} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8}")
    for n in [int(x) for x in args.spans.split(",")]:
        perm = torch.randperm(args.pool_slots, device=dev)
        src, dst = perm[:n], perm[n : 2 * n]
        cos, sin = delta_cos_sin(cache, torch.randint(-4096, 4096, (n,), device=dev))
        kv_bytes = 2 * 2 * n * args.layers * args.kv_heads * args.head_dim * esize
        h_bytes = 2 * n * args.hidden * esize
        flat = torch.empty(kv_bytes // 2, dtype=torch.uint8, device=dev)
        flat2 = torch.empty_like(flat)
        copy_kv = _time(lambda: flat2.copy_(flat), args.iters)  # noqa: B023
        hflat = torch.empty(h_bytes // 2, dtype=torch.uint8, device=dev)
        hflat2 = torch.empty_like(hflat)
        copy_h = _time(lambda: hflat2.copy_(hflat), args.iters)  # noqa: B023
        cases = [
            ("splice_rerotate triton", kv_bytes, copy_kv,
             lambda: splice.splice_rerotate_triton(k, v, src, dst, cos, sin)),  # noqa: B023
            ("splice_rerotate torch", kv_bytes, copy_kv,
             lambda: splice.splice_rerotate_ref(k, v, src, dst, cos, sin)),  # noqa: B023
            ("gather_rows triton", h_bytes, copy_h,
             lambda: rows.gather_rows_triton(hidden, src)),  # noqa: B023
            ("gather_rows torch", h_bytes, copy_h, lambda: hidden[src]),  # noqa: B023
        ]  # fmt: skip
        for name, nbytes, copy_ms, fn in cases:
            ms = _time(fn, args.iters)
            gbs, roof = nbytes / ms / 1e6, nbytes / copy_ms / 1e6
            print(f"{n:>6} {name:<22} {ms:>8.3f} {gbs:>8.0f} {roof:>10.0f} {gbs / roof:>7.0%}")
        if n <= 16384:
            _attention(n, args, dev, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
