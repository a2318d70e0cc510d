"""Micro-benchmark of :class:`sglang_relay.core.span_index.SpanIndex`.

Stores ``--num-spans`` random spans of about ``--span-len`` tokens, then times ``find`` on
prompts of ``--prompt-len`` tokens that each contain 2-3 stored spans (half of them with the
first 2 and last 2 tokens replaced, as after re-tokenization) plus random filler. Reports
``add`` throughput, memory (tracemalloc), and the median/p90 ``find`` latency after a
warm-up, at a tenth of the spans and at all of them (latency must not grow with the count).

Usage::

    python benchmark/bench_span_index.py [--num-spans 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

try:
    from sglang_relay.core.span_index import SpanIndex, SpanMatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from sglang_relay.core.span_index import SpanIndex, SpanMatch

TARGET_MS = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-spans", type=int, default=10_000)
    p.add_argument("--span-len", type=int, default=256, help="mean span length")
    p.add_argument("--span-jitter", type=int, default=32, help="span length +- this")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--min-match", type=int, default=16)
    p.add_argument("--anchor", type=int, default=8)
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts (round-robin)")
    p.add_argument("--reps", type=int, default=500, help="timed find() calls per setting")
    p.add_argument("--warmup", type=int, default=50, help="untimed find() calls first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc build")
    p.add_argument(
        "--preamble-spans",
        type=int,
        default=1000,
        help="spans sharing a 32-token preamble for the worst-case section (0: skip)",
    )
    p.add_argument("--max-bucket", type=int, default=64, help="cap tried in that section")
    p.add_argument("--json", metavar="OUT", type=Path, help="also write the results here")
    return p.parse_args(argv)


def make_spans(rng: np.random.Generator, args: argparse.Namespace) -> list[list[int]]:
    lens = rng.integers(
        args.span_len - args.span_jitter, args.span_len + args.span_jitter + 1, args.num_spans
    )
    return [rng.integers(0, args.vocab, int(n)).tolist() for n in lens]


def make_prompt(
    rng: np.random.Generator, spans: list[list[int]], pool: int, args: argparse.Namespace
) -> tuple[list[int], list[SpanMatch]]:
    """A prompt with 2-3 spans from ``spans[:pool]`` and the expected matches."""
    k = int(rng.integers(2, 4))
    ids = rng.choice(pool, size=k, replace=False).tolist()
    pieces, expected_cut = [], []
    for sid in ids:
        toks = list(spans[sid])
        if rng.random() < 0.5:  # re-tokenized edges: only the interior can match
            toks[:2] = rng.integers(args.vocab, 2 * args.vocab, 2).tolist()
            toks[-2:] = rng.integers(args.vocab, 2 * args.vocab, 2).tolist()
            expected_cut.append(2)
        else:
            expected_cut.append(0)
        pieces.append(toks)
    n_filler = args.prompt_len - sum(len(t) for t in pieces)
    if n_filler < 0:
        raise SystemExit("--prompt-len too small for 3 spans of --span-len tokens")
    cuts = np.sort(rng.integers(0, n_filler + 1, k))
    bounds = [0, *cuts.tolist(), n_filler]
    filler = rng.integers(0, args.vocab, n_filler).tolist()
    prompt: list[int] = []
    expected = []
    for i, (sid, toks, cut) in enumerate(zip(ids, pieces, expected_cut, strict=True)):
        prompt += filler[bounds[i] : bounds[i + 1]]
        expected.append(SpanMatch(len(prompt) + cut, sid, cut, len(toks) - 2 * cut))
        prompt += toks
    prompt += filler[bounds[k] :]
    return prompt, expected


def time_find(index: SpanIndex, prompts: list, reps: int, warmup: int) -> dict[str, float]:
    """Per-call latency in microseconds (median, p90, min) over ``reps`` calls."""
    for i in range(warmup):
        index.find(prompts[i % len(prompts)])
    gc.collect()
    times = []
    for i in range(reps):
        prompt = prompts[i % len(prompts)]
        t0 = time.perf_counter_ns()
        index.find(prompt)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    times.sort()
    return {
        "median_us": statistics.median(times),
        "p90_us": times[int(0.9 * (len(times) - 1))],
        "min_us": times[0],
    }


def bench_preamble(rng: np.random.Generator, args: argparse.Namespace) -> dict:
    """Worst case for exact mode: every stored span starts with the same 32 tokens, so each
    prompt occurrence of them verifies one candidate per span; compare with max_bucket."""
    n = args.preamble_spans
    head = rng.integers(0, args.vocab, 32).tolist()
    spans = [head + toks[32:] for toks in make_spans(rng, args)[:n]]
    plain = argparse.Namespace(**{**vars(args), "num_spans": n})
    cases = [make_prompt(rng, spans, n, plain) for _ in range(8)]
    prompts = [prompt for prompt, _ in cases]
    reps, warmup = max(5, args.reps // 25), 2
    out = {"spans": n, "reps": reps}
    print(f"\nshared 32-token preamble in all {n} spans, prompts with 2-3 of them, us per call:")
    for cap in (None, args.max_bucket):
        index = SpanIndex(min_match=args.min_match, anchor=args.anchor, max_bucket=cap)
        for sid, toks in enumerate(spans):
            index.add(sid, toks)
        for prompt, exp in cases:
            if index.find(prompt) != exp:
                raise SystemExit(f"wrong matches with max_bucket={cap}")
        r = time_find(index, prompts, reps, warmup)
        r["candidates"] = index.last_find_candidates
        out[f"max_bucket={cap}"] = r
        print(
            f"  max_bucket={str(cap):5s} median {r['median_us']:9.1f}   p90 {r['p90_us']:9.1f}"
            f"   ({r['candidates']} candidates verified in the last call)"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    spans = make_spans(rng, args)
    total_tokens = sum(len(s) for s in spans)
    checkpoints = sorted({max(1, args.num_spans // 10), args.num_spans})
    pool = checkpoints[0]  # prompts only use spans stored at every checkpoint
    cases = [make_prompt(rng, spans, pool, args) for _ in range(args.prompts)]
    prompts = [prompt for prompt, _ in cases]
    no_match = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(8)]

    print(
        f"SpanIndex(min_match={args.min_match}, anchor={args.anchor}); {args.num_spans} spans "
        f"of {args.span_len}+-{args.span_jitter} tokens ({total_tokens} tokens), vocab "
        f"{args.vocab}, prompts of {args.prompt_len} tokens with 2-3 spans; seed {args.seed}"
    )
    index = SpanIndex(min_match=args.min_match, anchor=args.anchor)
    add_s = 0.0
    find_results = []
    done = 0
    for n in checkpoints:
        gc.collect()
        t0 = time.perf_counter()
        for sid in range(done, n):
            index.add(sid, spans[sid])
        add_s += time.perf_counter() - t0
        done = n
        for prompt, exp in cases:  # correctness sanity check
            got = index.find(prompt)
            if got != exp:
                raise SystemExit(f"wrong matches: expected {exp}, got {got}")
        row = {
            "stored_spans": n,
            "list_prompt": time_find(index, prompts, args.reps, args.warmup),
            "ndarray_prompt": time_find(
                index, [np.array(p) for p in prompts], args.reps, args.warmup
            ),
            "no_match_prompt": time_find(index, no_match, args.reps, args.warmup),
        }
        find_results.append(row)
        print(f"\nfind(), {n} stored spans ({index.num_entries} index entries), us per call:")
        for key in ("list_prompt", "ndarray_prompt", "no_match_prompt"):
            r = row[key]
            print(
                f"  {key:16s} median {r['median_us']:8.1f}   p90 {r['p90_us']:8.1f}"
                f"   min {r['min_us']:8.1f}"
            )

    add = {
        "total_s": add_s,
        "spans_per_s": args.num_spans / add_s,
        "tokens_per_s": total_tokens / add_s,
        "us_per_add": add_s / args.num_spans * 1e6,
    }
    print(
        f"\nadd(): {add['spans_per_s']:,.0f} spans/s, {add['tokens_per_s'] / 1e6:.2f} M tokens/s "
        f"({add['us_per_add']:.1f} us per {args.span_len}-token span)"
    )

    memory = None
    if not args.no_memory:
        del index
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = SpanIndex(min_match=args.min_match, anchor=args.anchor)
        for sid, toks in enumerate(spans):
            index.add(sid, toks)
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        token_bytes = sum(index.tokens(sid).nbytes for sid in range(args.num_spans))
        memory = {
            "total_bytes": used,
            "token_bytes": token_bytes,
            "index_bytes": used - token_bytes,
            "entries": index.num_entries,
            "index_bytes_per_entry": (used - token_bytes) / max(1, index.num_entries),
            "total_bytes_per_token": used / total_tokens,
        }
        print(
            f"memory: {used / 2**20:.1f} MiB total = {token_bytes / 2**20:.1f} MiB tokens + "
            f"{memory['index_bytes'] / 2**20:.1f} MiB index/bookkeeping ({index.num_entries} "
            f"entries, {memory['index_bytes_per_entry']:.0f} B/entry, "
            f"{memory['total_bytes_per_token']:.1f} B per stored token)"
        )

    preamble = None
    if args.preamble_spans > 0:
        preamble = bench_preamble(rng, args)

    final = find_results[-1]["list_prompt"]["median_us"] / 1e3
    verdict = "PASS" if final < TARGET_MS else "FAIL"
    print(
        f"\ntarget: find() on a {args.prompt_len}-token prompt vs {args.num_spans} spans "
        f"< {TARGET_MS} ms: median {final:.3f} ms -> {verdict}"
    )
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "add": add,
        "memory": memory,
        "find": find_results,
        "shared_preamble": preamble,
        "target_ms": TARGET_MS,
        "pass": final < TARGET_MS,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
