"""What the CPU relay-extend attention costs per layer (issue 68 item 2): ``n`` rows spread
over a ``T``-token context (the last 20 positions always among them, as a prompt's new
tokens are), the embedded model's heads (9 query, 3 KV, 64 dims), float32, timed alone:

* ``whole``: every row over the whole context under one mask, the keys and values gathered
  from the pool by slot first (the implementation before 2026-12-07,
  :func:`~sglang_relay.core.attention.positional_causal_attention`);
* ``blocks``: :class:`~sglang_relay.runtime.forward.attention.TorchAttention` since then
  (the same gather, then the rows in blocks of 32, each over the keys up to its last row);
* ``causal share``: a causal SDPA over all ``T`` rows (what SGLang's own prefill runs),
  times ``n / T``: what those rows cost in a kernel that skips what its mask hides.

    python research/studies/blocked_attention_timing.py --json OUT

Medians of 15 calls after one warm-up, torch's threads as the machine gives them.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_relay.core.attention import positional_causal_attention
from sglang_relay.runtime.forward.attention import RowBatch, build

HQ, HKV, D = 9, 3, 64
CASES = ((308, 70), (1077, 53), (1077, 155), (1077, 260), (4174, 900))


def median_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for t, n in CASES:
        k, v = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
        spread = torch.sort(torch.randperm(t - 20)[: n - 20]).values
        pos = torch.cat([spread, torch.arange(t - 20, t)])
        q = torch.randn(n, HQ, D)
        attn = build("torch", torch.device("cpu"))
        handle = attn.plan(RowBatch([0], [t], [torch.arange(t)], n), torch.arange(n), pos)
        blocks_planned = len(handle[0])
        slots = torch.arange(t)
        whole = median_ms(
            lambda: positional_causal_attention(q, k[slots], v[slots], pos, D**-0.5)  # noqa: B023
        )
        blocks = median_ms(lambda: attn.run(handle, q, k, v, D**-0.5))  # noqa: B023
        qs = torch.randn(t, HQ, D).transpose(0, 1)[None]
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        sdpa = partial(scaled_dot_product_attention, qs, kt, vt, is_causal=True, scale=D**-0.5,
                       enable_gqa=True)  # fmt: skip
        causal = median_ms(sdpa)
        row = {"context": t, "rows": n, "blocks": blocks_planned, "whole_ms": round(whole, 3),
               "blocks_ms": round(blocks, 3),
               "causal_share_ms": round(causal * n / t, 3)}  # fmt: skip
        rows.append(row)
        print(row)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
