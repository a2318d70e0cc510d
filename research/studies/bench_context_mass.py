"""What recording a span's context masses costs: one attention of the n output tokens over
the request's keys at one layer (:func:`sglang_relay.core.selection.context_mass`), the work
a relay server adds when a request finishes under the context rule.

    python research/studies/bench_context_mass.py [--threads 1]

Prints the median of 3 timed calls per shape (after one warm-up), on random tensors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sglang_relay.core.selection import context_mass

# (label, query heads, KV heads, head dim, outputs n, prompt tokens P)
SHAPES = (
    ("SmolLM2-135M", 9, 3, 64, 256, 512),
    ("SmolLM2-135M", 9, 3, 64, 1024, 1024),
    ("Llama-3.1-8B shape", 32, 8, 128, 1024, 4096),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| model | outputs | prompt | ms (median of 3) |")
    print("|---|---|---|---|")
    for label, hq, hkv, d, n, prompt in SHAPES:
        q, keys = torch.randn(n, hq, d), torch.randn(prompt + n, hkv, d)
        pos = torch.arange(prompt, prompt + n)
        context_mass(q, keys, pos, prompt, d**-0.5)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            context_mass(q, keys, pos, prompt, d**-0.5)
            times.append(time.perf_counter() - t0)
        print(f"| {label} | {n} | {prompt} | {1000 * statistics.median(times):.1f} |")
    print(f"\n{args.threads} torch thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
