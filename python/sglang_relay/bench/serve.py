"""``sglang-relay bench serve``: what relay buys a loaded server (open-loop agent chains).

Agent chains arrive as a Poisson process at each ``--rates`` (chains per minute) for
``--duration`` seconds (or ``--chains`` of them, however long they take) against one
server; one method per run (``--methods``: per-request ``custom_params.relay``, so every
method runs on the same server), the cache flushed between runs. Chain kinds (``--mix``,
or ``--workloads``: several mixes one after another, each its own rows) are in
:mod:`sglang_relay.bench.chain_kinds`: pipeline, fan-in, group chat, fan-out, deep chain,
tool loop (``--tool-pause``) and plain requests that relay nothing (the control). Outputs
end where the model ends them (early stops and the early-stop guard's redo count, as in
production); ``--fixed-length`` makes every method do the same decode work instead. A run
ends ``--drain`` s after its last arrival: requests not finished by then, or never sent,
are censored (SLO misses of the all-arrivals TTFT) and the server's stragglers aborted; a
tool loop's turn whose tool was still running has not arrived and is not counted.

Reported per method, rate and seed: the arrival rate achieved, chains completed per
minute, TTFT p50/p90 (p99 from 100 requests) of the requests that finished, of every
arrival (censored ones as misses) and of the requests that could relay, chain latency,
time per output token, the share of prompt tokens relayed, fallbacks by reason, and the
server's relay counters over the run (spans recorded / evicted, pool use). **Goodput** at
an SLO is the highest rate whose TTFT tail meets it (``serve_report.goodput``); over rates
and seeds with censored arrivals, the capacity tables (:mod:`sglang_relay.bench.capacity`)
read it at the achieved rate with bootstrap intervals. ``--seeds`` runs each rate several
times with fresh arrivals; the summary pools the seeds and gives each method's TTFT ratio
to standard with a 95 % interval. ``--resume`` keeps a ``--json`` file's rows and runs only
what it lacks (a long matrix over several sittings). ``--plot`` draws goodput against the
SLO, the TTFT tail and chain latency per rate (and the capacity curves); ``--replot``
redraws saved runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from sglang_relay.bench import capacity
from sglang_relay.bench.chain_kinds import (
    AGENTS,
    DEFAULT_MIX,
    TOPICS,
    chain_prompts,
    output_lengths,
    parse_mix,
)
from sglang_relay.bench.host import HostWatch
from sglang_relay.bench.serve_report import ChainRun, Record, markdown, plot, summarize
from sglang_relay.bench.traffic import counter_deltas, phase_times
from sglang_relay.bench.traffic import relay_state as server_state
from sglang_relay.client import flush_cache, generate
from sglang_relay.prompts import chat_prompt

METHOD_OPTIONS: dict[str, Any] = {
    "standard": "standard",
    "relay": None,  # the server's default operating point
    "relay@speed": {"reuse": "speed"},
    "epic": "epic",
    "cacheblend": "cacheblend",
    "naive": "naive",
}


def arrivals(
    rate_per_min: float, duration_s: float, seed: int, count: int | None = None
) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate_per_min``
    events per minute over ``duration_s`` (or its first ``count`` events, however long
    they take): exponential gaps, fixed seed."""
    if rate_per_min <= 0 or (duration_s <= 0 and not count):
        return []
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if (count and len(out) >= count) or (not count and t >= duration_s):
            return out
        out.append(t)


def run_chain(
    url: str, tok: Any, kind: str, k: int, topic: str, relay: Any, out_tokens: int,
    answer_tokens: int | None = None, fixed_length: bool = False,
    on_record: Callable[[Record, float], None] | None = None,
    pauses: list[float] | None = None, stop: threading.Event | None = None,
    on_pause: Callable[[bool], None] | None = None,
) -> list[Record]:  # fmt: skip
    """One chain, agent after agent (a fan-in's first three agents are independent but run
    in order too: the client of a fan-in waits for all of them); a fan-out's workers are
    sent at once after the lead's brief; a tool loop waits ``pauses[i]`` seconds after
    turn ``i`` (its tool). Outputs stop at the model's end of text (and the early-stop
    guard's redo counts) unless ``fixed_length`` (``ignore_eos``). Each finished request
    goes to ``on_record`` with the ``time.monotonic()`` of its first token; a request the
    server aborted goes there only if a token came first (its TTFT is real), and ends the
    chain. Once ``stop`` is set no further request is sent; ``on_pause`` is told when a
    tool pause begins and ends (a pause the stop cuts ends the chain)."""
    lengths = output_lengths(kind, out_tokens, answer_tokens)
    stop = stop or threading.Event()

    def agent(i: int, outs: list[str]) -> tuple[str, Record]:
        if stop.is_set():
            raise TimeoutError("the run ended before this request was sent")
        system, user, quotes = chain_prompts(kind, k, topic, outs, i)
        params: dict[str, Any] = {"max_new_tokens": lengths[i], "temperature": 0.0,
                                  "ignore_eos": fixed_length}  # fmt: skip
        if relay is not None:
            params["custom_params"] = {"relay": relay}
        sent = time.monotonic()
        gen = generate(url, chat_prompt(tok, system, user), params)
        tokens = int(gen.meta.get("completion_tokens", lengths[i]))
        rec = Record(k, kind, i, quotes, gen.ttft_s, gen.latency_s, gen.prompt_tokens,
                     gen.relay or {}, output_tokens=tokens)  # fmt: skip
        finish = gen.meta.get("finish_reason")
        aborted = isinstance(finish, dict) and finish.get("type") == "abort"
        if on_record is not None and not (aborted and tokens < 1):
            on_record(rec, sent + gen.ttft_s)  # an abort chunk before any token is no TTFT
        if aborted:
            raise RuntimeError(f"aborted by the server: {finish.get('message', '')}")
        return gen.text.strip(), rec

    outs: list[str] = []
    records: list[Record] = []
    if kind == "fanout":
        text, rec = agent(0, [])
        with cf.ThreadPoolExecutor(max_workers=len(lengths) - 1) as workers:
            done = list(workers.map(lambda i: agent(i, [text]), range(1, len(lengths))))
        return [rec] + [r for _, r in done]
    for i in range(len(lengths)):
        if i and pauses:
            if on_pause is not None:
                on_pause(True)
            if stop.wait(pauses[i - 1]):
                raise TimeoutError("the run ended during a tool's pause")
            if on_pause is not None:
                on_pause(False)
        text, rec = agent(i, outs)
        outs.append(text)
        records.append(rec)
    return records


def tool_pauses(kind: str, rng: random.Random, bounds: tuple[float, float]) -> list[float]:
    """A tool loop's pauses between turns, uniform in ``bounds`` (s); none for other kinds."""
    if kind != "toolloop":
        return []
    return [rng.uniform(*bounds) for _ in range(AGENTS[kind] - 1)]


def _abort_all(url: str) -> None:
    """End every request still running on the server (a run's censored stragglers), so the
    next run starts on an idle server."""
    try:
        requests.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
    except requests.RequestException:
        pass  # the flush that starts the next run waits for idle anyway


def run_rate(
    url: str, tok: Any, method: str, rate: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One open-loop run: chains submitted at their arrival times, whether or not earlier
    ones finished. After its arrivals (``args.duration`` s, or ``args.chains`` of them) it
    waits up to ``args.drain`` s, then ends: requests not finished by then (and those never
    sent) are censored, SLO misses in the all-arrivals TTFT; the server's stragglers are
    aborted."""
    rng = random.Random(seed)
    mix = parse_mix(args.mix)
    kinds, weights = list(mix), list(mix.values())
    times = arrivals(rate, args.duration, seed, args.chains)
    window = times[-1] if args.chains and times else args.duration  # arrivals' span (s)
    chains: list[ChainRun] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    bounds = tuple(float(x) for x in args.tool_pause.split(","))

    def one(k: int, run: ChainRun, topic: str, pauses: list[float]) -> None:
        def record(rec: Record, first_token_at: float) -> None:
            with lock:  # a first token after the run's end is no arrival that finished
                if first_token_at <= deadline:
                    run.records.append(rec)

        def pause(on: bool) -> None:
            with lock:
                run.pausing = on

        try:
            run_chain(url, tok, run.kind, k, topic, METHOD_OPTIONS[method], args.out_tokens,
                      args.answer_tokens, args.fixed_length, record, pauses, stop,
                      pause)  # fmt: skip
            with lock:
                if time.monotonic() <= deadline:
                    run.latency = time.monotonic() - began - run.start
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            if not stop.is_set():
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
    host = HostWatch()
    began = time.monotonic()
    deadline = began + window + args.drain
    pool = cf.ThreadPoolExecutor(max_workers=max(4, len(times)))
    futures = []
    try:
        for k, t in enumerate(times):
            time.sleep(max(0.0, began + t - time.monotonic()))
            kind = rng.choices(kinds, weights)[0]
            topic, pauses = rng.choice(TOPICS), tool_pauses(kind, rng, bounds)
            run = ChainRun(time.monotonic() - began, kind, AGENTS[kind])
            chains.append(run)
            futures.append(pool.submit(one, k, run, topic, pauses))
        _, pending = cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    finally:  # whatever happened, no chain sends anything more and the sampler ends
        stop.set()
        done.set()
    elapsed = time.monotonic() - began
    if pending:
        _abort_all(url)
    pool.shutdown(wait=True, cancel_futures=True)
    with lock:
        row = summarize(method, rate, chains, errors, len(times), len(pending), elapsed)
    row["arrived_per_min"] = 60.0 * len(times) / window if window > 0 else 0.0
    row["host"] = host.summary()  # steal: CPU the hypervisor gave other guests meanwhile
    after = server_state(url)
    row["server"] = counter_deltas(before, after)
    # a server started with SGLANG_RELAY_PHASE_TIMES=1: relay's own time by phase over the run
    was = phase_times(before)
    phases = {k: round(v - was.get(k, 0.0), 3) for k, v in phase_times(after).items()
              if v != was.get(k, 0.0)}  # fmt: skip
    if phases:
        row["phases"] = phases
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
    p.add_argument(
        "--chains",
        type=int,
        default=None,
        help="per run, this many chains (Poisson arrivals at the rate, however "
        "long they take) instead of --duration seconds of arrivals",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="several workloads in one invocation, separated by ';', each a mix like --mix "
        "(e.g. 'fanout;deep;toolloop:0.5,deep:0.5'), each its own rows ('workload' in "
        "each row); default: one workload, --mix",
    )
    p.add_argument(
        "--tool-pause",
        default="30,120",
        help="a tool loop's pause between turns: uniform in LO,HI seconds",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="with --json: keep its rows, run only the (workload, method, rate, seed) it "
        "lacks; refused if its runs had other settings (chains, duration, drain, lengths, "
        "tool pause, seed, server flags); the file is rewritten after every run",
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
        slos = [float(x) for x in args.slos.split(",")]
        print(markdown(rows, slos))
        if any("chain_ttfts_all" in r for r in rows):
            print("\n" + capacity.markdown(rows, slos))
        if args.plot:
            plot(rows, args.plot, title=", ".join(f.name for f in files))
            if any("chain_ttfts_all" in r for r in rows):
                capacity.plot(rows, str(Path(args.plot).with_suffix("")) + "_capacity.png", slos)
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
    workloads = [w.strip() for w in args.workloads.split(";")] if args.workloads else [args.mix]
    for w in workloads:
        parse_mix(w)
    out = Path(args.json) if args.json else None
    rows = json.loads(out.read_text())["rows"] if args.resume and out and out.exists() else []
    shape = run_settings(args, server_flags)
    other = {r.get("settings") for r in rows} - {shape}
    if other:
        p.error(f"--resume: {out} holds runs with other settings ({sorted(map(str, other))}, "
                f"these are {shape}): use another --json")  # fmt: skip
    have = {(r.get("workload"), r["method"], r["rate"], r.get("seed", 0)) for r in rows}
    with server_at(args.url, ["--model-path", model, *server_flags]) as url:
        generate(url, chat_prompt(tok, "Warm up.", "Hello"), {"max_new_tokens": 8})
        for workload in workloads:
            args.mix = workload
            for rate in rates:
                for s in range(args.seeds):
                    # one sequence per seed, the same at every rate (its gaps scaled by the
                    # rate: common random numbers), for every method
                    seed = args.seed + 7919 * s
                    for method in methods:
                        if (workload, method, rate, s) in have:
                            continue
                        began = time.monotonic()
                        row = run_rate(url, tok, method, rate, args, seed=seed)
                        row.update(
                            seed=s,
                            workload=workload,
                            settings=shape,
                            wall_s=time.monotonic() - began,
                        )
                        rows.append(row)
                        print(json.dumps({k: row[k] for k in ("workload", "method", "rate",
                              "seed", "arrived_per_min", "completed", "censored", "ttft_p90",
                              "ttft_all_p90", "wall_s", "host")}), flush=True)  # fmt: skip
                        if out:
                            _write(out, args, rows, server_flags)
    for workload in dict.fromkeys(r.get("workload") for r in rows):  # one at a time
        print(
            f"\n{workload or ''}\n"
            + markdown([r for r in rows if r.get("workload") == workload], slos)
        )
    if args.plot:
        plot(rows, args.plot)
    if any("chain_ttfts_all" in r for r in rows):
        print("\n" + capacity.markdown(rows, slos))
        if args.plot:
            capacity.plot(rows, str(Path(args.plot).with_suffix("")) + "_capacity.png", slos)
    if out:
        _write(out, args, rows, server_flags)
    return 0


def run_settings(args: argparse.Namespace, server_flags: list[str]) -> str:
    """What makes two runs of a (workload, method, rate, seed) the same run, as one short
    string: rows of a ``--resume`` file must share it."""
    keys = ("chains", "duration", "drain", "out_tokens", "answer_tokens", "fixed_length",
            "tool_pause", "seed")  # fmt: skip
    text = json.dumps([[k, getattr(args, k)] for k in keys] + [server_flags, "common arrivals"])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _write(
    path: Path, args: argparse.Namespace, rows: list[dict[str, Any]], flags: list[str]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    run = {"args": vars(args), "server_flags": flags, "rows": rows}
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(path)
