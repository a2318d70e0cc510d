"""``sglang-relay bench decode``: decode throughput with the relay backend vs plain SGLang.

The relay backend stores each decoded token's hidden state at ``l_start`` (one indexed
copy per decode step, by a hook inside SGLang's own forward). This measures what a relay
server costs plain decode: the same greedy generations on a plain server and on a relay
server, both up for the whole run (an idle CPU server sleeps), one generation on each per
round and batch size, which goes first alternating between rounds; it reports output tokens
per second (batch 1 and a concurrent batch) and relay / plain as the geometric mean of the
paired rounds' ratios with a 95 % bootstrap interval over rounds (a machine that slows down
mid-run slows both sides of a pair). With ``--graph`` it measures both in eager and in
graph-mode decode (relay's decode capture runs inside the captured graphs), side by side in
one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import statistics
import time
from pathlib import Path

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


def graph_flags(batches: list[int], *, cpu: bool, graph: bool) -> list[str]:
    """Server flags for eager or graph-mode decode. On a CPU graph decode is SGLang's CPU
    graph runner (torch.compile per batch size, opt-in); on a GPU decode CUDA graphs are
    SGLang's default and eager decode is opted into."""
    if not cpu:
        return [] if graph else ["--cuda-graph-backend-decode", "disabled"]
    if not graph:
        return []
    sizes = [str(b) for b in sorted(set(batches))]
    return ["--enable-torch-compile", "--cuda-graph-bs-decode", *sizes,
            "--torch-compile-max-bs", str(max(batches))]  # fmt: skip


def _row(samples, mode: str, batch: int, rounds: int, flags: list[str], model: str) -> dict:
    """One table row: medians of each server's rounds, and relay / plain as the geometric
    mean of the paired rounds' ratios with its 95 % bootstrap interval."""
    from sglang_relay.bench.intervals import bootstrap_ci

    plain, relay = samples[(mode, "plain", batch)], samples[(mode, "relay", batch)]
    logs = [math.log(r / p) for r, p in zip(relay, plain, strict=True)]
    lo, hi = bootstrap_ci(logs) if len(logs) > 1 else (logs[0], logs[0])
    row = {
        "decode": mode,
        "batch": batch,
        "plain_tokens_per_s": round(statistics.median(plain), 1),
        "relay_tokens_per_s": round(statistics.median(relay), 1),
        "relay_over_plain": round(math.exp(statistics.fmean(logs)), 3),
        "relay_over_plain_ci": [round(math.exp(lo), 3), round(math.exp(hi), 3)],
        "rounds": rounds,
        "plain_rounds": [round(x, 2) for x in plain],
        "relay_rounds": [round(x, 2) for x in relay],
        "server_flags": flags,
        "model": model,
    }
    if mode == "graph":
        eager = statistics.median(samples[("eager", "relay", batch)])
        row["relay_graph_over_eager"] = round(statistics.median(relay) / eager, 3)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench decode", description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds per batch size")
    parser.add_argument(
        "--graph",
        action="store_true",
        help="also measure graph-mode decode (CPU graph runner / CUDA graphs) beside eager",
    )
    parser.add_argument("--json", help="write raw rows here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument(
        "--random-llama",
        action="store_true",
        help="serve a random 8-head Llama (splits over --tp 2; timings only)",
    )
    args, server_flags = parser.parse_known_args(argv)  # other flags (--tp 2...) go to SGLang

    from sglang_relay.bench.models import random_llama
    from sglang_relay.embedded_model import default_model_dir, ensure_model
    from sglang_relay.runtime import cpu
    from sglang_relay.runtime.process import ServerProcess

    model_path = args.model_path or str(ensure_model())
    if args.random_llama:
        out = default_model_dir().parent / "RandomLlama-tp"
        model_path = str(random_llama(out, ensure_model()))
    batches = [int(b) for b in args.batches.split(",")]
    on_cpu = not cpu.cuda_available()
    modes = [("eager", False), *([("graph", True)] if args.graph else [])]
    samples: dict[tuple[str, str, int], list[float]] = {}
    for mode, graph in modes:
        flags = graph_flags(batches, cpu=on_cpu, graph=graph)
        base = ["--model-path", model_path, *flags, *server_flags]
        with ServerProcess([*base, "--no-relay"]) as plain, ServerProcess(base) as relay:
            servers = {"plain": plain.url, "relay": relay.url}
            for name, url in servers.items():
                _round(url, 1, 8, f"warm-{name}")
            for rnd in range(args.rounds):
                order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
                for b in batches:
                    for name in order:
                        tps = _round(servers[name], b, args.tokens, f"{name}{rnd}")
                        samples.setdefault((mode, name, b), []).append(tps)
                print(f"[decode] {mode} round {rnd + 1}/{args.rounds} done", flush=True)
    rows = [
        _row(samples, mode, b, args.rounds, server_flags, Path(model_path).name)
        for mode, _ in modes
        for b in batches
    ]
    head = "| decode | batch | plain tok/s | relay tok/s | relay / plain [95 %] |"
    print(head + " relay graph / eager |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["relay_over_plain_ci"]
        print(
            f"| {r['decode']} | {r['batch']} | {r['plain_tokens_per_s']} | "
            f"{r['relay_tokens_per_s']} | {r['relay_over_plain']} [{lo}, {hi}] | "
            f"{r.get('relay_graph_over_eager', '')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
