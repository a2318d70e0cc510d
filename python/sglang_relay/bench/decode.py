"""``sglang-relay bench decode``: decode throughput with the relay backend vs plain SGLang.

The relay backend stores each decoded token's hidden state at ``l_start`` (one indexed
copy per decode step, in its own layer loop). This measures what that costs: the same
greedy generations on a plain server and on a relay server, alternating servers between
rounds, reporting output tokens per second (batch 1 and a concurrent batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time
from pathlib import Path
from typing import Any

from sglang_relay.client import generate


def _round(url: str, batch: int, tokens: int, salt: str) -> float:
    prompts = [
        f"[{salt}-{i}] Write a long essay about the history of computing." for i in range(batch)
    ]
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=batch) as pool:
        list(pool.map(lambda p: generate(url, p, params), prompts))
    return batch * tokens / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench decode", description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write raw rows here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    args, server_flags = parser.parse_known_args(argv)

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.launch import ServerProcess

    model_path = args.model_path or str(ensure_model())
    batches = [int(b) for b in args.batches.split(",")]
    samples: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for name, extra in (("plain", ["--no-relay"]), ("relay", [])):
            with ServerProcess(["--model-path", model_path, *extra, *server_flags]) as server:
                _round(server.url, 1, 8, f"warm{rnd}")
                for b in batches:
                    tps = _round(server.url, b, args.tokens, f"{name}{rnd}")
                    samples.setdefault((name, b), []).append(tps)
            print(f"[decode] round {rnd + 1}/{args.rounds} {name} done", flush=True)
    rows: list[dict[str, Any]] = []
    for b in batches:
        plain = statistics.median(samples[("plain", b)])
        relay = statistics.median(samples[("relay", b)])
        rows.append(
            {
                "batch": b,
                "plain_tokens_per_s": round(plain, 1),
                "relay_tokens_per_s": round(relay, 1),
                "relay_over_plain": round(relay / plain, 3),
                "rounds": args.rounds,
            }
        )
    print("| batch | plain tok/s | relay tok/s | relay / plain |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['plain_tokens_per_s']} | {r['relay_tokens_per_s']} | "
            f"{r['relay_over_plain']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
