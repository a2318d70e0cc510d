"""``sglang-relay bench load``: relay under load and faults against a real server.

Bounded in time; every figure comes from the server's own counters or from the clients:

1. **Load** (a soak with ``--duration 1800``): ``--chains`` concurrent agent chains
   (upstream -> downstream relaying it -> sometimes a third agent relaying both) for
   ``--duration`` seconds, in a KV pool small enough that spans are evicted mid-chain.
   Chains differ in who they are: unsalted, salted (``cache_salt``, 4 tenants), with a
   relay key, with an opted-out upstream (``"standard"``: stores nothing, so its
   downstream must not relay) or an opted-out downstream (``"off"``). In place of
   ``--fault-share`` of the downstream agents, a faulty client (``bench/traffic.py``):
   one that aborts mid-prefill (a read timeout shorter than the prefill, then a closed
   connection), disconnects from a stream after the first chunk, has SGLang abort its
   request mid-decode (``/abort_request``) or sends malformed relay options. Downstream
   agents stream, so the client measures TTFT.
   Reported: requests served, client aborts, errors that were not the client's doing
   (must be 0), fallbacks by reason, relays into the wrong namespace (must be 0), the pool
   balance once idle (leaked slots = total - available - evictable - protected, must
   be 0), and per ``--window`` seconds: requests, relay hit rate (relayed / downstream
   requests that could relay), p50/p99 TTFT of relaying downstream agents, server RSS and
   relay side memory (sampled every few seconds).
2. **Evicted spans**: an upstream output is pushed out of the pool by other traffic, then
   relayed: the request must be served by standard prefill (no span or ``span_evicted``)
   and its output must equal the standard one.
3. **Restart between agents**: the server is restarted after the upstream agent; the
   downstream agent on the new server is served normally (no spans) and equals standard.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import random
import threading
import time
from pathlib import Path
from typing import Any

from sglang_relay.bench.traffic import (
    COUNTERS,
    FAULTS,
    LoadStats,
    agent_chain,
    leaked_slots,
    post,
    relay_state,
)
from sglang_relay.client import healthy
from sglang_relay.prompts import chat_prompt


def _sample(url: str, pid: int | None, stats: LoadStats) -> None:
    import psutil

    rss = None
    if pid is not None:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            rss = sum(p.memory_info().rss for p in procs if p.is_running())
        except psutil.Error:
            rss = None
    state = relay_state(url)
    row = {
        "t": round(time.monotonic() - stats.start, 1),
        "rss_mb": None if rss is None else round(rss / 2**20, 1),
        "side_mb": round(state.get("side_bytes", 0) / 2**20, 2),
        "spans": state.get("spans"),
        "span_tokens": state.get("span_tokens"),
        "requests_tracked": state.get("requests_tracked"),
    }
    with stats.lock:
        stats.samples.append(row)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def windows(stats: LoadStats, window: float, elapsed: float) -> list[dict[str, Any]]:
    """Per-window figures: hit rate, TTFT percentiles, memory."""
    out = []
    n = max(1, int(elapsed // window + (elapsed % window > 0.5 * window)))
    for w in range(n):
        lo, hi = w * window, (w + 1) * window if w < n - 1 else float("inf")
        rows = [r for r in stats.downstream if lo <= r[0] < hi]
        could = [r for r in rows if r[1]]
        ttfts = [r[3] for r in could if r[2] and r[3] is not None]
        mem = [s for s in stats.samples if lo <= s["t"] < hi]
        rss = [s["rss_mb"] for s in mem if s["rss_mb"] is not None]
        out.append(
            {
                "window": w,
                "from_s": lo,
                "downstream": len(rows),
                "could_relay": len(could),
                "relayed": sum(r[2] for r in could),
                "hit_rate": round(sum(r[2] for r in could) / len(could), 3) if could else None,
                "ttft_n": len(ttfts),
                "ttft_p50_s": _pct(ttfts, 0.5),
                "ttft_p90_s": _pct(ttfts, 0.9) if len(ttfts) >= 10 else None,
                # a p99 needs a hundred samples to be more than the maximum
                "ttft_p99_s": _pct(ttfts, 0.99) if len(ttfts) >= 100 else None,
                "ttft_max_s": max(ttfts, default=None),
                "rss_mb_max": max(rss) if rss else None,
                "side_mb_max": max((s["side_mb"] for s in mem), default=None),
                "span_tokens_max": max((s["span_tokens"] or 0 for s in mem), default=None),
            }
        )
    return out


def run_load(
    url: str,
    tok: Any,
    chains: int,
    duration: float,
    seed: int = 0,
    *,
    window: float = 300.0,
    pid: int | None = None,
    sample_every: float = 10.0,
    faults: bool = True,
    fault_share: float = 0.3,
) -> dict[str, Any]:
    """``chains`` clients send agent chains for ``duration`` seconds. Client ``w``'s
    ``j``-th chain is the same in every run of a seed; with ``faults`` a faulty client
    (:data:`FAULTS`) replaces the downstream agent of a ``fault_share`` of them."""
    start = time.monotonic()
    stats = LoadStats(start)
    deadline = start + duration
    done = threading.Event()

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        fault_rng = random.Random(seed * 1000 + w + 500) if faults else None
        j = 0
        while time.monotonic() < deadline:
            k, j = f"{w}.{j}", j + 1
            try:
                agent_chain(url, tok, rng, stats, k, fault_rng, fault_share)
                stats.add("chains")
            except Exception as exc:  # noqa: BLE001 - every failure is a reported figure
                stats.add("errors", f"{type(exc).__name__}: {exc}"[:300])

    def sampler() -> None:
        while not done.wait(sample_every):
            try:
                _sample(url, pid, stats)
            except Exception as exc:  # noqa: BLE001
                stats.add("errors", f"sampler {type(exc).__name__}: {exc}"[:300])

    before = relay_state(url)
    _sample(url, pid, stats)
    threading.Thread(target=sampler, daemon=True).start()
    with cf.ThreadPoolExecutor(chains) as pool:
        list(pool.map(worker, range(chains)))
    done.set()
    elapsed = time.monotonic() - start
    _sample(url, pid, stats)
    leaked, pool_after = leaked_slots(url)
    after = relay_state(url)
    ok = healthy(url)
    server_counters = {  # deltas over the run, except gauges (spans, span_tokens, ...)
        k: v - before.get(k, 0) if k in COUNTERS else v
        for k, v in after.items()
        if isinstance(v, int) and not isinstance(v, bool)
    }
    per_window = windows(stats, window, elapsed)
    rates = [w["hit_rate"] for w in per_window if w["hit_rate"] is not None]
    return {
        "chains_concurrent": chains,
        "duration_s": round(elapsed, 1),
        "window_s": window,
        "chains_completed": stats.counts["chains"],
        "requests_served": stats.counts["served"],
        "requests_relayed": stats.counts["relayed"],
        "reused_tokens": stats.reused_tokens,
        "faults": {"share": fault_share if faults else 0.0, **{f: stats.counts[f] for f in FAULTS}},
        "client_aborts": stats.counts["client_aborts"],
        "client_disconnects": stats.counts["client_disconnects"],
        "wrong_namespace_relays": stats.counts["wrong_namespace_relays"],
        "errors": len(stats.errors),
        "error_samples": stats.errors[:5],
        "fallbacks": dict(stats.fallbacks),
        "server_counters": server_counters,
        "leaked_slots": leaked,
        "pool_after": pool_after,
        "healthy_after": ok,
        "windows": per_window,
        "hit_rate_first_last": [rates[0], rates[-1]] if rates else None,
        "memory_samples": stats.samples,
        "outputs": stats.outputs,
    }


def run_evicted(url: str, tok: Any, pool_tokens: int) -> dict[str, Any]:
    up = post(url, chat_prompt(tok, "Writer E.", "Explain heaps."), 160)
    prompt = chat_prompt(tok, "Editor E.", f"Draft:\n\n{up['text']}\n\nImprove it.")
    flood, batch = 0, 0
    with cf.ThreadPoolExecutor(8) as pool:
        while flood < 2 * pool_tokens:  # enough other traffic to cycle the whole pool
            prompts = [
                chat_prompt(tok, f"Filler {batch}-{i}.", "Count to fifty.") for i in range(8)
            ]
            for out in pool.map(lambda p: post(url, p, 200), prompts):
                flood += out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"]
            batch += 1
    relayed = post(url, prompt, 32)
    standard = post(url, prompt, 32, relay="standard")
    relay = relayed["meta_info"]["relay"]
    return {
        "spans_matched": relay["spans_matched"],
        "fallback": relay["fallback"],
        "served_exactly": relayed["output_ids"] == standard["output_ids"]
        and relay["reused_tokens"] == 0,
    }


def run_restart(server_args: list[str], tok: Any) -> dict[str, Any]:
    from sglang_relay.process import ServerProcess

    server = ServerProcess(server_args).start()
    try:
        up = post(server.url, chat_prompt(tok, "Writer R.", "Explain tries."), 160)
    finally:
        server.stop()
    server = ServerProcess(server_args).start()
    try:
        prompt = chat_prompt(tok, "Editor R.", f"Draft:\n\n{up['text']}\n\nImprove it.")
        down = post(server.url, prompt, 32)
        std = post(server.url, prompt, 32, relay="standard")
        leaked, _ = leaked_slots(server.url)
    finally:
        server.stop()
    relay = down["meta_info"]["relay"]
    return {
        "spans_matched": relay["spans_matched"],
        "fallback": relay["fallback"],
        "same_as_standard": down["output_ids"] == std["output_ids"],
        "leaked_slots": leaked,
    }


def markdown(result: dict[str, Any]) -> str:
    load, ev, rs = result["load"], result.get("evicted"), result.get("restart")
    rows = [
        ("concurrent chains", load["chains_concurrent"]),
        ("duration (s)", load["duration_s"]),
        ("chains completed", load["chains_completed"]),
        ("requests served", load["requests_served"]),
        ("requests that relayed a span", load["requests_relayed"]),
        ("client aborts mid-prefill", load["client_aborts"]),
        ("client disconnects mid-stream", load["client_disconnects"]),
        ("errors not caused by the client", load["errors"]),
        ("relays into a namespace that stored nothing", load["wrong_namespace_relays"]),
        ("fallbacks by reason", json.dumps(load["fallbacks"], sort_keys=True)),
        (
            "spans recorded / still stored after the load (the rest were evicted)",
            f"{load['server_counters'].get('recorded_spans')} / "
            f"{load['server_counters'].get('spans')}",
        ),
        ("leaked KV slots after the load", load["leaked_slots"]),
        ("server healthy after the load", load["healthy_after"]),
    ]
    if ev is not None:
        rows += [
            ("evicted span relayed: served exactly by standard prefill", ev["served_exactly"]),
            (
                "evicted span relayed: spans matched / fallback",
                f"{ev['spans_matched']} / {ev['fallback']}",
            ),
        ]
    if rs is not None:
        rows += [
            ("restart between agents: same output as standard", rs["same_as_standard"]),
            ("restart between agents: leaked KV slots", rs["leaked_slots"]),
        ]
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += [
        "",
        f"| window ({load['window_s']:.0f} s) | downstream | could relay | hit rate "
        "| TTFT p50 s | TTFT p99 s | server RSS MB (max) | side MB | span tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in load["windows"]:
        lines.append(
            f"| {w['window']} | {w['downstream']} | {w['could_relay']} | {w['hit_rate']} "
            f"| {w['ttft_p50_s']} | {w['ttft_p99_s']} | {w['rss_mb_max']} "
            f"| {w['side_mb_max']} | {w['span_tokens_max']} |"
        )
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> list[str]:
    """What is wrong with a run (empty: nothing)."""
    load, ev, rs = result["load"], result.get("evicted"), result.get("restart")
    bad = []
    if load["errors"]:
        bad.append(f"{load['errors']} errors: {load['error_samples']}")
    if load["leaked_slots"]:
        bad.append(f"{load['leaked_slots']} leaked KV slots")
    if not load["healthy_after"]:
        bad.append("server unhealthy after the load")
    if ev is not None and not ev["served_exactly"]:
        bad.append("an evicted span's relay did not equal standard prefill")
    if rs is not None and not (rs["same_as_standard"] and rs["leaked_slots"] == 0):
        bad.append("the restarted chain differed from standard or leaked slots")
    return bad


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench load", description=__doc__)
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--window", type=float, default=300.0, help="report window (s)")
    parser.add_argument("--pool-tokens", type=int, default=4000, help="KV pool (tokens)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument(
        "--no-faults", action="store_true", help="skip the evicted-span and restart sections"
    )
    parser.add_argument("--fault-share", type=float, default=0.3, help="faulty clients")
    parser.add_argument("--seed", type=int, default=0)
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    server_args = load_server_args(model_path, args.pool_tokens, server_flags)
    server = ServerProcess(server_args).start()
    evicted = restart = None
    try:
        print(f"[load] {args.chains} chains for {args.duration:.0f}s ...", flush=True)
        load = run_load(
            server.url,
            tok,
            args.chains,
            args.duration,
            seed=args.seed,
            window=min(args.window, args.duration),
            pid=server.proc.pid,
            fault_share=args.fault_share,
        )
        load.pop("outputs")
        if not args.no_faults:
            print("[load] evicted-span relay ...", flush=True)
            evicted = run_evicted(server.url, tok, args.pool_tokens)
        log = server.log_tail(200)
    finally:
        server.stop()
    if not args.no_faults:
        print("[load] restart between agents ...", flush=True)
        restart = run_restart(server_args, tok)
    result = {
        "load": load,
        "evicted": evicted,
        "restart": restart,
        "server_log_errors": log_errors(log),
        "run": {"machine": platform.platform(), "pool_tokens": args.pool_tokens},
    }
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    bad = verdict(result)
    for line in bad:
        print(f"[load] FAILED: {line}")
    return 1 if bad else 0


def load_server_args(model_path: str, pool_tokens: int, flags: list[str]) -> list[str]:
    """The server the load runs against: a KV pool of ``pool_tokens``, 256-token chunks."""
    return [
        "--model-path", model_path, "--max-total-tokens", str(pool_tokens),
        "--chunked-prefill-size", "256", *flags,
    ]  # fmt: skip


def log_errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "Traceback" in ln or "Error" in ln]
