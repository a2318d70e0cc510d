"""``sglang-relay bench decode``: decode throughput with the relay backend vs plain SGLang.

The relay backend stores each decoded token's hidden state at ``l_start`` (one indexed
copy per decode step, by a hook inside SGLang's own forward). This measures what a relay
server costs plain decode: the same greedy generations on a plain server and on a relay
server, both up for the whole run (an idle CPU server sleeps), one generation on each per
round and batch size, which goes first alternating between rounds; it reports output tokens
per second (batch 1 and a concurrent batch) and relay / plain as the geometric mean of the
paired rounds' ratios with a 95 % bootstrap interval over rounds (a machine that slows down
mid-run slows both sides of a pair). Beside each rate it reads the CPU time the whole server
(launcher, scheduler, detokenizer, every process it started) spent on the round, per output
token, and pairs those the same way: a VM's stolen time and a neighbour's load stretch the
wall clock of a round but not the CPU work the server did in it. Two instances of the same
server can differ by a percent or two for the whole of their life (measured: relay / plain
CPU per token at batch 4 was 1.029, 1.014, 0.996 and 0.998 on four pairs of fresh servers,
each tight over its rounds): ``--pairs K`` starts K server pairs one after another, and the
interval resamples the pairs and then their rounds. With ``--graph`` it
measures both in eager and in graph-mode decode (relay's decode capture runs inside the
captured graphs), side by side in one run.
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


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its descendants so far."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


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


def _flat(groups: list[list[float]]) -> list[float]:
    return [x for g in groups for x in g]


def _log_ratios(relay: list[list[float]], plain: list[list[float]]) -> list[list[float]]:
    """log(relay / plain) of each paired round, grouped by server pair."""
    return [
        [math.log(r / p) for r, p in zip(rs, ps, strict=True)]
        for rs, ps in zip(relay, plain, strict=True)
    ]


def _paired(relay: list[list[float]], plain: list[list[float]]) -> tuple[float, list[float]]:
    """relay / plain: the geometric mean of the paired rounds' ratios (each server pair's
    mean, then their mean) and its 95 % interval: over rounds for one server pair, over
    pairs and their rounds (two-stage bootstrap) for several."""
    from sglang_relay.bench.intervals import bootstrap_ci, cluster_ci

    logs = _log_ratios(relay, plain)
    mean = statistics.fmean(statistics.fmean(g) for g in logs)
    if len(logs) > 1:
        lo, hi = cluster_ci(logs)
    else:
        lo, hi = bootstrap_ci(logs[0]) if len(logs[0]) > 1 else (mean, mean)
    return round(math.exp(mean), 3), [round(math.exp(lo), 3), round(math.exp(hi), 3)]


def _row(samples, mode: str, batch: int, rounds: int, flags: list[str], model: str) -> dict:
    """One table row: medians of each server's rounds, and relay / plain (wall-clock rate
    and the server's CPU time per token) as :func:`_paired` gives them."""
    plain, relay = samples[(mode, "plain", batch)], samples[(mode, "relay", batch)]
    ratio, ci = _paired(relay, plain)
    plain_cpu, relay_cpu = samples[(mode, "plain-cpu", batch)], samples[(mode, "relay-cpu", batch)]
    cpu_ratio, cpu_ci = _paired(relay_cpu, plain_cpu)
    pair_cpu = [round(math.exp(statistics.fmean(g)), 4) for g in _log_ratios(relay_cpu, plain_cpu)]
    row = {
        "decode": mode,
        "batch": batch,
        "plain_tokens_per_s": round(statistics.median(_flat(plain)), 1),
        "relay_tokens_per_s": round(statistics.median(_flat(relay)), 1),
        "relay_over_plain": ratio,
        "relay_over_plain_ci": ci,
        "plain_cpu_ms_per_token": round(1e3 * statistics.median(_flat(plain_cpu)), 2),
        "relay_cpu_ms_per_token": round(1e3 * statistics.median(_flat(relay_cpu)), 2),
        "relay_over_plain_cpu": cpu_ratio,
        "relay_over_plain_cpu_ci": cpu_ci,
        "server_pairs": len(plain),
        "rounds": rounds,
        "pair_relay_over_plain_cpu": pair_cpu,
        "plain_rounds": [[round(x, 2) for x in g] for g in plain],
        "relay_rounds": [[round(x, 2) for x in g] for g in relay],
        "plain_cpu_rounds_ms": [[round(1e3 * x, 3) for x in g] for g in plain_cpu],
        "relay_cpu_rounds_ms": [[round(1e3 * x, 3) for x in g] for g in relay_cpu],
        "server_flags": flags,
        "model": model,
    }
    if mode == "graph":
        eager = statistics.median(_flat(samples[("eager", "relay", batch)]))
        row["relay_graph_over_eager"] = round(statistics.median(_flat(relay)) / eager, 3)
    return row


def _pair(samples, mode, plain_args, relay_args, batches, args, pair: int) -> None:
    """One plain and one relay server, up together; ``args.rounds`` paired rounds on them."""
    from sglang_relay.process import ServerProcess

    with ServerProcess(plain_args) as plain, ServerProcess(relay_args) as relay:
        servers = {"plain": plain.url, "relay": relay.url}
        pids = {"plain": plain.proc.pid, "relay": relay.proc.pid}
        for name, url in servers.items():
            _round(url, 1, 8, f"warm-{name}")
        for key in [
            (mode, n, b) for n in ("plain", "relay", "plain-cpu", "relay-cpu") for b in batches
        ]:
            samples.setdefault(key, []).append([])
        for rnd in range(args.rounds):
            order = list(servers) if (rnd + pair) % 2 == 0 else list(servers)[::-1]
            for b in batches:
                for name in order:
                    cpu_before = server_cpu_s(pids[name])
                    tps = _round(servers[name], b, args.tokens, f"{name}{pair}-{rnd}")
                    cpu_s = (server_cpu_s(pids[name]) - cpu_before) / (b * args.tokens)
                    samples[(mode, name, b)][-1].append(tps)
                    samples[(mode, f"{name}-cpu", b)][-1].append(cpu_s)
            print(f"[decode] {mode} pair {pair + 1}/{args.pairs} round {rnd + 1}/{args.rounds}"
                  " done", flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench decode", description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds per batch size")
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="server pairs started one after another (two instances of one server can "
        "differ by a percent or two: several pairs put that in the interval)",
    )
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
    from sglang_relay.runtime import platform

    model_path = args.model_path or str(ensure_model())
    if args.random_llama:
        out = default_model_dir().parent / "RandomLlama-tp"
        model_path = str(random_llama(out, ensure_model()))
    batches = [int(b) for b in args.batches.split(",")]
    on_cpu = not platform.cuda_available()
    modes = [("eager", False), *([("graph", True)] if args.graph else [])]
    samples: dict[tuple[str, str, int], list[list[float]]] = {}  # a list per server pair
    for mode, graph in modes:
        flags = graph_flags(batches, cpu=on_cpu, graph=graph)
        base = ["--model-path", model_path, *flags, *server_flags]
        for pair in range(args.pairs):
            _pair(samples, mode, [*base, "--no-relay"], base, batches, args, pair)
    rows = [
        _row(samples, mode, b, args.rounds, server_flags, Path(model_path).name)
        for mode, _ in modes
        for b in batches
    ]
    head = "| decode | batch | plain tok/s | relay tok/s | relay / plain [95 %] |"
    shape = f"{args.pairs} server pair(s) x {args.rounds} paired rounds, {args.tokens} tokens"
    print(f"[decode] {shape}")
    print(head + " server CPU ms/token plain, relay | relay / plain CPU [95 %] | graph / eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["relay_over_plain_ci"]
        clo, chi = r["relay_over_plain_cpu_ci"]
        print(
            f"| {r['decode']} | {r['batch']} | {r['plain_tokens_per_s']} | "
            f"{r['relay_tokens_per_s']} | {r['relay_over_plain']} [{lo}, {hi}] | "
            f"{r['plain_cpu_ms_per_token']}, {r['relay_cpu_ms_per_token']} | "
            f"{r['relay_over_plain_cpu']} [{clo}, {chi}] | "
            f"{r.get('relay_graph_over_eager', '')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
