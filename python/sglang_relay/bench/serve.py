"""``sglang-relay bench serve``: what relay buys a loaded server (open-loop agent chains).

Agent chains arrive as a Poisson process at each ``--rates`` (chains per minute) for
``--duration`` seconds against one server; one method per run (``--methods``: per-request
``custom_params.relay``, so every method runs on the same server), the cache flushed
between runs. Chain kinds (``--mix``): a ``pipeline`` (3 agents, each reads all earlier
outputs), a ``fanin`` (3 independent agents, then one that reads the three outputs), a
``groupchat`` (4 turns, each reads all earlier turns), a ``fanout`` (a lead writes a brief,
then four workers with their own roles read it at once: an orchestrator sending subtasks)
and ``plain`` requests that relay nothing (the control). Outputs end where the model ends
them (early stops and the early-stop guard's redo count, as in production);
``--fixed-length`` makes every method do the same decode work instead.

Reported per method, rate and seed: the arrival rate achieved, chains completed per
minute, TTFT p50/p90 (p99 from 100 requests) of every request and of the requests that
could relay, chain latency, time per output token, the share of prompt tokens relayed,
fallbacks by reason, and the server's relay counters over the run (spans recorded /
evicted, pool use). **Goodput** at an SLO is the highest rate whose TTFT tail meets it
(``serve_report.goodput``). ``--seeds`` runs each rate several times with fresh arrivals;
the summary pools the seeds and gives each method's TTFT ratio to standard with a 95 %
interval. ``--plot`` draws goodput against the SLO, the TTFT tail and chain latency per
rate; ``--replot`` redraws saved runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from sglang_relay.bench.serve_report import Record, markdown, plot, summarize
from sglang_relay.bench.traffic import relay_state as server_state
from sglang_relay.client import flush_cache, generate
from sglang_relay.prompts import chat_prompt

# server counters (get_server_info) reported as deltas over a run
SERVER_COUNTERS = ("recorded_spans", "spans_matched", "relay_extends", "relayed_tokens",
                   "fallbacks", "owned_spans_released_for_room",
                   "owned_tokens_released_for_room", "batches_split")  # fmt: skip


KINDS = ("pipeline", "fanin", "groupchat", "fanout", "plain")


DEFAULT_MIX = "pipeline:0.4,fanin:0.2,groupchat:0.2,plain:0.2"


METHOD_OPTIONS: dict[str, Any] = {
    "standard": "standard",
    "relay": None,  # the server's default operating point
    "relay@speed": {"reuse": "speed"},
    "epic": "epic",
    "cacheblend": "cacheblend",
    "naive": "naive",
}


TOPICS = ["rate limiting", "B-trees", "TCP congestion control", "garbage collection",
          "consistent hashing", "ray tracing", "vector clocks", "bloom filters"]  # fmt: skip


def arrivals(rate_per_min: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate_per_min``
    events per minute over ``duration_s``: exponential gaps, fixed seed."""
    if rate_per_min <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            return out
        out.append(t)


def parse_mix(text: str) -> dict[str, float]:
    """``kind:weight,...`` -> normalized weights over :data:`KINDS`."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown chain kind {kind!r}; choose from {', '.join(KINDS)}")
        mix[kind] = float(weight or 1.0)
    total = sum(mix.values())
    if total <= 0 or any(w < 0 for w in mix.values()):
        raise ValueError(f"mix weights must be >= 0 and not all 0: {text!r}")
    return {k: w / total for k, w in mix.items()}


FANOUT_ROLES = ("Writer", "Critic", "Tester", "Translator")


def _chain_prompts(
    kind: str, k: int, topic: str, outs: list[str], i: int | None = None
) -> tuple[str, str, bool]:
    """(system, user message, whether it quotes earlier outputs) of agent ``i`` (default
    ``len(outs)``: the agent after the earlier ones)."""
    i = len(outs) if i is None else i
    if kind == "plain":
        return f"Assistant {k}.", f"Explain {topic} in a few paragraphs.", False
    if kind == "pipeline":
        roles = ["Planner", "Engineer", "Reviewer"]
        quoted = "".join(f"\n\n{roles[j]} wrote:\n{o}" for j, o in enumerate(outs))
        task = ["Plan how to teach", "Write a worked example of", "Review the material on"][i]
        return f"You are the {roles[i]} ({k}).", f"{task} {topic}.{quoted}", i > 0
    if kind == "fanin":
        if i < 3:
            angle = ["its history", "how it works", "its pitfalls"][i]
            return f"Expert {i} ({k}).", f"Write about {topic}: {angle}.", False
        notes = "".join(f"\n\nNote {j + 1}:\n{o}" for j, o in enumerate(outs))
        return f"Editor ({k}).", f"Merge these notes on {topic} into one text.{notes}", True
    if kind == "fanout":
        if i == 0:
            return f"Lead ({k}).", f"Write a brief on {topic} for four specialists.", False
        role = FANOUT_ROLES[i - 1]
        task = f"Brief from the lead:\n{outs[0]}\n\nDo your part as the {role} on {topic}."
        return f"You are the {role} ({k}).", task, True
    turns = "".join(f"\n\nSpeaker {j % 2 + 1}: {o}" for j, o in enumerate(outs))
    return (
        f"Speaker {i % 2 + 1} of a debate ({k}).",
        f"Debate: is {topic} worth it?{turns}\n\nYour turn.",
        i > 0,
    )


AGENTS = {"pipeline": 3, "fanin": 4, "groupchat": 4, "fanout": 1 + len(FANOUT_ROLES), "plain": 1}


def output_lengths(kind: str, out_tokens: int, answer_tokens: int | None) -> list[int]:
    """Output tokens of each agent of a ``kind`` chain: ``out_tokens``, except the last
    agent of a chain that reads earlier outputs (a fan-out's workers: every agent after the
    lead), which answers in ``answer_tokens`` (None: ``out_tokens`` too)."""
    n = AGENTS[kind]
    last = out_tokens if answer_tokens is None or kind == "plain" else answer_tokens
    if kind == "fanout":
        return [out_tokens] + [last] * (n - 1)
    return [out_tokens] * (n - 1) + [last]


def run_chain(
    url: str, tok: Any, kind: str, k: int, topic: str, relay: Any, out_tokens: int,
    answer_tokens: int | None = None, fixed_length: bool = False,
) -> list[Record]:  # fmt: skip
    """One chain, agent after agent (a fan-in's first three agents are independent but run
    in order too: the client of a fan-in waits for all of them); a fan-out's workers are
    sent at once after the lead's brief. Outputs stop at the model's end of text (and the
    early-stop guard's redo counts) unless ``fixed_length`` (``ignore_eos``)."""
    lengths = output_lengths(kind, out_tokens, answer_tokens)

    def agent(i: int, outs: list[str]) -> tuple[str, Record]:
        system, user, quotes = _chain_prompts(kind, k, topic, outs, i)
        params: dict[str, Any] = {"max_new_tokens": lengths[i], "temperature": 0.0,
                                  "ignore_eos": fixed_length}  # fmt: skip
        if relay is not None:
            params["custom_params"] = {"relay": relay}
        gen = generate(url, chat_prompt(tok, system, user), params)
        rec = Record(k, kind, i, quotes, gen.ttft_s, gen.latency_s, gen.prompt_tokens,
                     gen.relay or {},
                     output_tokens=int(gen.meta.get("completion_tokens", lengths[i])))  # fmt: skip
        return gen.text.strip(), rec

    outs: list[str] = []
    records: list[Record] = []
    if kind == "fanout":
        text, rec = agent(0, [])
        with cf.ThreadPoolExecutor(max_workers=len(lengths) - 1) as workers:
            done = list(workers.map(lambda i: agent(i, [text]), range(1, len(lengths))))
        return [rec] + [r for _, r in done]
    for i in range(len(lengths)):
        text, rec = agent(i, outs)
        outs.append(text)
        records.append(rec)
    return records


def run_rate(
    url: str, tok: Any, method: str, rate: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One open-loop run: chains submitted at their arrival times, whether or not earlier
    ones finished; waits for stragglers up to ``args.drain`` seconds."""
    rng = random.Random(seed)
    mix = parse_mix(args.mix)
    kinds, weights = list(mix), list(mix.values())
    times = arrivals(rate, args.duration, seed)
    chains: list[tuple[float, float | None, list[Record]]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(k: int, kind: str, topic: str) -> None:
        start = time.monotonic()
        try:
            recs = run_chain(url, tok, kind, k, topic, METHOD_OPTIONS[method], args.out_tokens,
                             args.answer_tokens, args.fixed_length)  # fmt: skip
            with lock:
                chains.append((start, time.monotonic() - start, recs))
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    flush_cache(url)
    before = server_state(url)
    peak = {"used": 0, "owned": 0}
    done = threading.Event()

    def sample() -> None:  # the KV pool's peak use (slots neither free nor evictable)
        while not done.wait(1.0):
            try:
                st = server_state(url)
            except Exception:  # noqa: BLE001 - a busy server may miss one sample
                continue
            pool_ = st.get("pool", {})
            used = int(pool_.get("total", 0)) - int(pool_.get("available", 0))
            peak["used"] = max(peak["used"], used)
            peak["owned"] = max(peak["owned"], int(st.get("owned_span_tokens", 0)))

    threading.Thread(target=sample, daemon=True).start()
    began = time.monotonic()
    pool = cf.ThreadPoolExecutor(max_workers=max(4, len(times)))
    futures = []
    for k, t in enumerate(times):
        time.sleep(max(0.0, began + t - time.monotonic()))
        kind = rng.choices(kinds, weights)[0]
        futures.append(pool.submit(one, k, kind, rng.choice(TOPICS)))
    _, pending = cf.wait(futures, timeout=args.drain)
    # stragglers past the drain keep running; the next run's flush waits for them
    pool.shutdown(wait=False, cancel_futures=True)
    elapsed = time.monotonic() - began
    done.set()
    row = summarize(method, rate, chains, errors, len(times), len(pending), elapsed)
    row["arrived_per_min"] = 60.0 * len(times) / args.duration
    after = server_state(url)
    row["server"] = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in SERVER_COUNTERS}
    total = int(after.get("pool", {}).get("total", 0))
    row["pool_peak_share"] = peak["used"] / total if total else None
    row["owned_span_tokens_peak"] = peak["owned"]
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sglang-relay bench serve", description=__doc__)
    p.add_argument("--url", help="a running relay server (default: start one)")
    p.add_argument("--rates", default="2,4,8", help="chains per minute, comma list")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=300.0, help="seconds to wait for stragglers")
    p.add_argument("--methods", default="standard,relay,relay@speed,epic,cacheblend,naive")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"chain kinds and weights ({DEFAULT_MIX})")
    p.add_argument(
        "--out-tokens",
        type=int,
        default=96,
        help="output tokens of every agent (spans shorter than the server's min span, 32 by "
        "default, are not relayed: keep it well above)",
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=None,
        help="output tokens of a chain's last agent and of a fan-out's workers (default: "
        "--out-tokens); short answers "
        "after long pasted outputs are the shape where prefill, which relay saves, dominates",
    )
    p.add_argument("--slos", default="0.5,1,2,4", help="TTFT SLOs (s) for the goodput table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per rate and method, each with its own arrivals and chains (the summary "
        "pools them and gives each method's TTFT ratio to standard with a 95%% interval)",
    )
    p.add_argument(
        "--fixed-length",
        action="store_true",
        help="every output exactly its length (ignore_eos): equal decode work per method; "
        "by default outputs end where the model ends them, as in production",
    )
    p.add_argument("--quick", action="store_true", help="rates 2,6, 45 s, relay and standard")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write goodput vs SLO, TTFT and chain latency vs rate (PNG)")
    p.add_argument(
        "--replot",
        metavar="JSON",
        help="no run: the table and --plot of a saved --json (several: comma list, rows joined)",
    )
    args, server_flags = p.parse_known_args(argv)
    if args.replot:
        files = [Path(f) for f in args.replot.split(",")]
        rows = []
        for f in files:  # several files: a method's rows keep their file apart (name@stem)
            for r in json.loads(f.read_text())["rows"]:
                rows.append({**r, "method": f"{r['method']}@{f.stem}"} if len(files) > 1 else r)
        print(markdown(rows, [float(x) for x in args.slos.split(",")]))
        if args.plot:
            plot(rows, args.plot, title=", ".join(f.name for f in files))
        return 0
    if args.quick:
        args.rates, args.duration, args.methods = "2,6", 45.0, "standard,relay"
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_OPTIONS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {', '.join(METHOD_OPTIONS)}")
    parse_mix(args.mix)
    rates = [float(x) for x in args.rates.split(",")]
    slos = [float(x) for x in args.slos.split(",")]

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import server_at

    model = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model)
    rows = []
    with server_at(args.url, ["--model-path", model, *server_flags]) as url:
        generate(url, chat_prompt(tok, "Warm up.", "Hello"), {"max_new_tokens": 8})
        for rate in rates:
            for s in range(args.seeds):
                seed = args.seed + int(rate * 1000) + 7919 * s
                for method in methods:  # same arrivals (seed) for every method at a rate
                    row = run_rate(url, tok, method, rate, args, seed=seed)
                    row["seed"] = s
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("method", "rate", "seed", "completed",
                          "requests", "ttft_p90", "chain_latency_p50", "errors")}),
                          flush=True)  # fmt: skip
    print(markdown(rows, slos))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0
