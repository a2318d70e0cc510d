"""Worst cases for span matching: can a crafted prompt turn relay's matcher into a slowdown?

The scheduler runs :meth:`SpanIndex.find` on every prompt chunk it admits, on the scheduler
thread, so its cost per prompt token must stay bounded whatever the prompt and whatever the
index holds. This builds the adversarial cases we could construct, with the runtime's own
index settings (``min_match`` 32, anchor 16, ``max_bucket`` 64), against a *full* index
(``--index-tokens`` span tokens, GPU-shaped: a quarter of a 1M-token KV pool), and reports
per case the ``find`` time per prompt token, the work counters, and the ratio to the prefill
time of the same prompt:

* ``random``: random prompt vs random spans (the common case, almost no hits);
* ``pasted``: a prompt made entirely of stored spans, cut in pieces of 32-96 tokens;
* ``periodic-P``: the index is full of spans of period-P text, so is the prompt;
* ``near-dup``: 64 stored copies of one text, each with a different token every 40
  (every anchored gram is in 64 buckets, runs are short), prompt = the text repeated;
* ``evict-periodic``: time to remove every stored period-1 span (one gram shared by all
  their anchors).

Prefill time is measured, not assumed: ``--prefill-model`` (default the embedded SmolLM2-135M)
runs a standard forward over ``--prefill-len`` tokens (torch, this machine); the per-token
cost at that length is a lower bound for longer prompts (attention only adds). Ratios
against a GPU are printed for a stated reference cost per token (``--gpu-us-per-token``,
default 40 us: an 8B model's prefill at ~25K tokens/s on one H100, an optimistic figure),
clearly labelled as a reference, not a measurement.

Usage::

    python research/studies/bench_match_abuse.py [--prompt-len 100000] [--json out.json]
    python research/studies/bench_match_abuse.py --unbounded   # without the work bound, to compare
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

try:
    from sglang_relay.core.span_index import SpanIndex
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from sglang_relay.core.span_index import SpanIndex

VOCAB = 49152
MIN_MATCH, ANCHOR, MAX_BUCKET = 32, 16, 64  # as RelayRuntime's SpanStore (min_span 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=100_000)
    p.add_argument("--index-tokens", type=int, default=250_000, help="stored span tokens")
    p.add_argument("--span-len", type=int, default=2048, help="length of the stored spans")
    p.add_argument("--periods", default="1,2,3,7,17,31,33,100,257")
    p.add_argument("--reps", type=int, default=3, help="timed find() calls per case (median)")
    p.add_argument("--work-per-token", type=float, help="override SpanIndex's default pace")
    p.add_argument("--unbounded", action="store_true", help="disable the work bound (compare)")
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefill-model", default="embedded", help="'embedded' or 'none'")
    p.add_argument("--gpu-us-per-token", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", type=Path)
    return p.parse_args(argv)


def new_index(args: argparse.Namespace) -> SpanIndex:
    kw = {"work_per_token": None} if args.unbounded else {}
    if args.work_per_token is not None and not args.unbounded:
        kw["work_per_token"] = args.work_per_token
    return SpanIndex(min_match=MIN_MATCH, anchor=ANCHOR, max_bucket=MAX_BUCKET, **kw)


def periodic(rng: np.random.Generator, period: int, n: int, phase: int = 0) -> np.ndarray:
    base = rng.integers(0, VOCAB, period)
    return base[(np.arange(n) + phase) % period]


def fill_random(index: SpanIndex, rng: np.random.Generator, args, start_id: int = 0) -> int:
    sid = start_id
    while index_tokens(index) < args.index_tokens:
        index.add(sid, rng.integers(0, VOCAB, args.span_len))
        sid += 1
    return sid


def index_tokens(index: SpanIndex) -> int:
    return index.num_entries * ANCHOR  # close enough to the stored tokens for filling


def time_find(index: SpanIndex, prompt: np.ndarray, reps: int) -> dict:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = index.find(prompt)
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    return {
        "find_s": t,
        "us_per_token": 1e6 * t / len(prompt),
        "matches": len(out),
        "matched_tokens": int(sum(m.length for m in out)),
        "work": index.last_find_work,
        "truncated": index.last_find_truncated,
        "candidates": index.last_find_candidates,
    }


def cases(args: argparse.Namespace):
    """(name, index, prompt) for every adversarial case."""
    rng = np.random.default_rng(args.seed)
    n = args.prompt_len

    ix = new_index(args)
    fill_random(ix, rng, args)
    yield "random", ix, rng.integers(0, VOCAB, n)

    ix = new_index(args)
    last = fill_random(ix, rng, args)
    pieces, total = [], 0
    while total < n:
        toks = ix.tokens(int(rng.integers(0, last)))
        k = int(rng.integers(32, 97))
        s = int(rng.integers(0, len(toks) - k))
        pieces.append(toks[s : s + k])
        total += k
    yield "pasted", ix, np.concatenate(pieces)[:n]

    for period in (int(p) for p in args.periods.split(",")):
        ix = new_index(args)
        sid = 0
        base = rng.integers(0, VOCAB, period)
        while index_tokens(ix) < args.index_tokens and sid < 4096:
            phase = sid % period
            ix.add(sid, base[(np.arange(args.span_len) + phase) % period])
            sid += 1
        yield f"periodic-{period}", ix, base[np.arange(n) % period]

    ix = new_index(args)
    text = rng.integers(0, VOCAB, 1024)
    for sid in range(MAX_BUCKET):
        copy = text.copy()
        copy[(np.arange(sid % 40, 1024, 40))] = rng.integers(
            0, VOCAB, len(range(sid % 40, 1024, 40))
        )
        ix.add(sid, copy)
    fill_random(ix, rng, args, start_id=MAX_BUCKET)
    yield "near-dup", ix, np.tile(text, n // 1024 + 1)[:n]


def time_evict(args: argparse.Namespace) -> dict:
    """Remove every stored period-1 span (all anchors share one gram)."""
    ix = new_index(args)
    tok = np.full(args.span_len, 7)
    n = max(1, args.index_tokens // args.span_len)
    for sid in range(n):
        ix.add(sid, tok)
    t0 = time.perf_counter()
    for sid in reversed(range(n)):  # newest first: the far end of a shared bucket
        ix.remove(sid)
    t = time.perf_counter() - t0
    return {"spans": n, "remove_all_s": t, "us_per_span_token": 1e6 * t / (n * args.span_len)}


def prefill_us_per_token(args: argparse.Namespace) -> float | None:
    """Standard prefill of ``--prefill-len`` tokens on this machine (torch, eval, no grad)."""
    if args.prefill_model == "none":
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_relay.embedded_model import ensure_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_model()), torch_dtype=torch.float32)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prefill_len))
    times = []
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / args.prefill_len


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prefill = prefill_us_per_token(args)
    mode = "unbounded" if args.unbounded else "bounded (default work_per_token)"
    print(
        f"find() on {args.prompt_len}-token prompts, index ~{args.index_tokens} span tokens, {mode}"
    )
    if prefill is not None:
        print(
            f"standard prefill, embedded model, {args.prefill_len} tokens: {prefill:.0f} us/token"
        )
    print(f"GPU reference (not measured): {args.gpu_us_per_token:.0f} us/token")
    head = (
        f"{'case':<16}{'find s':>9}{'us/tok':>9}{'work':>11}{'verif':>9}{'trunc':>7}{'matched':>9}"
    )
    head += f"{'%cpu-prefill':>14}{'%gpu-ref':>10}"
    print(head)
    rows = {}
    for name, ix, prompt in cases(args):
        r = time_find(ix, prompt, args.reps)
        r["pct_of_cpu_prefill"] = None if prefill is None else 100 * r["us_per_token"] / prefill
        r["pct_of_gpu_reference"] = 100 * r["us_per_token"] / args.gpu_us_per_token
        rows[name] = r
        cpu = "-" if prefill is None else f"{r['pct_of_cpu_prefill']:.2f}"
        print(
            f"{name:<16}{r['find_s']:>9.3f}{r['us_per_token']:>9.2f}{r['work']:>11}{r['candidates']:>9}"
            f"{str(r['truncated']):>7}{r['matched_tokens']:>9}{cpu:>14}"
            f"{r['pct_of_gpu_reference']:>10.1f}"
        )
    ev = time_evict(args)
    print(
        f"evict {ev['spans']} period-1 spans of {args.span_len} tokens: "
        f"{ev['remove_all_s']:.3f} s ({ev['us_per_span_token']:.2f} us per span token)"
    )
    out = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prefill_us_per_token": prefill,
        "cases": rows,
        "evict_periodic": ev,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
