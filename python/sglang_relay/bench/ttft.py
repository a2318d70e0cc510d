"""``sglang-relay bench ttft``: time to first token of relayed prompts, all methods, one server.

One real server (relay backend) runs every method side by side: each request picks its
method through ``custom_params.relay``; the methods are interleaved within each repetition
and every repetition uses a fresh prompt prefix, so no method profits from another's
radix-cache entries. Measured per (method, relayed span length, number of agents):

* ``standard``: SGLang's own prefill of the whole prompt;
* ``naive``: spliced KV, nothing recomputed: the *limit* a relay method can reach with the
  same attention implementation (``ratio_to_prefix_hit_limit`` = TTFT / naive TTFT);
* ``cacheblend``, ``epic``, ``relay``: selective recompute; ``relay@T`` (``T`` a reuse
  target or level name, e.g. ``relay@0.95`` or ``relay@speed``): relay at that operating
  point, per request (``{"method": "relay", "reuse": T}``), so every point is timed
  interleaved on the same server; ``relay@T:noprobe``: that point without its last-row
  probe (``"config": {"probe": null}``), which times what the probe costs;
* ``stock_prefix_hit``: the same prompt whose prefix up to the span's end is an exact radix
  hit, served by the stock attention backend (for ``relay vs stock prefix hit``).

Workload (``--workload FILE``, JSONL; the default ships in the package): one object per
line, ``{"kind": "sweep", "span_tokens": [...]}`` (one relayed span of each length behind an
agent template) or ``{"kind": "agents", "n_agents": [...], "output_tokens": N}`` (agent k's
prompt holds the outputs of agents 1..k-1), plus ``"system"``/``"template"`` strings.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_relay.bench.host import HostWatch
from sglang_relay.client import generate
from sglang_relay.core.config import METHODS
from sglang_relay.prompts import chat_prompt

DEFAULT_WORKLOAD = "ttft_workload.jsonl"


def load_workload(path: str | None) -> list[dict[str, Any]]:
    if path is None:
        text = resources.files("sglang_relay.data").joinpath(DEFAULT_WORKLOAD).read_text()
    else:
        text = Path(path).read_text()
    cases = [json.loads(line) for line in text.splitlines() if line.strip()]
    for case in cases:
        if case.get("kind") not in ("sweep", "agents"):
            raise ValueError(f"workload case has unknown kind: {case.get('kind')!r}")
    return cases


def _upstream(url: str, tok: Any, topic: str, n: int) -> str:
    """An upstream agent output of exactly ``n`` decoded tokens (its KV is what relays)."""
    system = "You are a thorough technical writer."
    prompt = chat_prompt(tok, system, f"Write at length about {topic}.")
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return generate(url, prompt, params).text


def _prefix_text(tok: Any, text: str, n_tokens: int) -> str:
    ids = tok(text, add_special_tokens=False).input_ids[:n_tokens]
    return tok.decode(ids)


def _relay_option(method: str) -> str | dict[str, Any]:
    """``custom_params.relay`` for a bench method name (``relay@T``: a reuse target;
    ``relay@T:noprobe``: the same point without its last-row probe, to time the probe)."""
    if method == "stock_prefix_hit":
        return "standard"
    if method.startswith("relay@"):
        target, _, variant = method.split("@", 1)[1].partition(":")
        if variant not in ("", "noprobe"):
            raise ValueError(f"unknown relay point variant {variant!r} (known: noprobe)")
        extra = {"config": {"probe": None}} if variant else {}
        try:
            return {"method": "relay", "reuse": float(target), **extra}
        except ValueError:
            return {"method": "relay", "reuse": target, **extra}  # a level name
    return method


def _phases(url: str) -> dict[str, float]:
    """The server's relay phase times (``SGLANG_RELAY_PHASE_TIMES=1``), ms by phase."""
    from sglang_relay.bench.traffic import phase_times, relay_state

    return {k[:-3]: v for k, v in phase_times(relay_state(url)).items() if k.endswith("_ms")}


def _measure(url: str, prompt: str, method: str, phases: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0}
    params["custom_params"] = {"relay": _relay_option(method)}
    before = _phases(url) if phases else {}
    gen = generate(url, prompt, params)
    relay = gen.relay or {}
    spent = {k: v - before.get(k, 0.0) for k, v in _phases(url).items()} if phases else {}
    return {
        "phases_ms": {k: round(v, 3) for k, v in spent.items() if v > 0},
        "ttft": gen.ttft_s,
        "reuse_rate": float(relay.get("reuse_rate", 0.0)),
        "reused_tokens": int(relay.get("reused_tokens", 0)),
        "cached_tokens": gen.cached_tokens,
        "prompt_tokens": gen.prompt_tokens,
    }


def _downstream(tok: Any, case: dict[str, Any], rep: int, relayed: list[str]) -> tuple[str, str]:
    """(prompt, stock-hit variant): a fresh system prefix per repetition."""
    system = case.get("system", "You are agent {rep} of a review pipeline.").format(rep=rep)
    body = "\n\n".join(f"Output of agent {i + 1}:\n{t}" for i, t in enumerate(relayed))
    template = case.get("template", "{outputs}\n\nSummarize the outputs above in one line.")
    user = template.format(outputs=body)
    return chat_prompt(tok, system, user), chat_prompt(tok, system, user + " Be brief.")


def run(
    url: str,
    tok: Any,
    cases: list[dict[str, Any]],
    reps: int,
    methods: list[str],
    progress: bool = True,
    phases: bool = False,
) -> list[dict[str, Any]]:
    need: dict[str, int] = {}
    for case in cases:
        if case["kind"] == "sweep":  # one whole upstream output per length (a prefix of a
            for n in case["span_tokens"]:  # longer one is a quote: relay declines it)
                need[f"sweep{n}"] = int(n)
        else:
            for k in range(1, max(case["n_agents"])):
                need[f"agent{k}"] = int(case["output_tokens"])
    subjects = [
        "caching strategies",
        "network protocols",
        "compiler passes",
        "file systems",
        "GPU scheduling",
        "consensus algorithms",
        "memory allocators",
        "query planning",
    ]
    topics = {
        key: f"the design of distributed databases (part {n})"
        if key.startswith("sweep")
        else subjects[i % len(subjects)]
        for i, (key, n) in enumerate(need.items())
    }
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=len(need) or 1) as pool:
        futures = {key: pool.submit(_upstream, url, tok, topics[key], n) for key, n in need.items()}
        outputs = {key: f.result() for key, f in futures.items()}
    if progress:
        print(f"[ttft] upstream outputs ready in {time.perf_counter() - t0:.0f}s", flush=True)

    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    points: list[tuple[int, int, list[str], dict[str, Any]]] = []
    for case in cases:
        if case["kind"] == "sweep":
            for n in case["span_tokens"]:
                points.append((n, 2, [_prefix_text(tok, outputs[f"sweep{n}"], n)], case))
        else:
            for agents in case["n_agents"]:
                texts = [outputs[f"agent{k}"] for k in range(1, agents)]
                points.append((int(case["output_tokens"]) * (agents - 1), agents, texts, case))
    # standard must come after the relay methods of a prompt (it puts the whole prompt in
    # the radix tree); the relay methods rotate their order from one repetition to the next
    relay_methods = [m for m in methods if m != "standard"]
    total = reps * len(points)
    done = 0
    for rep in range(reps):
        for span_tokens, agents, texts, case in points:
            prompt, variant = _downstream(tok, case, rep * 100000 + span_tokens + agents, texts)
            k = rep % max(1, len(relay_methods))
            order = relay_methods[k:] + relay_methods[:k]
            if "standard" in methods:
                order.append("standard")
            for method in order:
                samples.setdefault((method, span_tokens, agents), []).append(
                    _measure(url, prompt, method, phases)
                )
            if "standard" in methods:
                # standard inserted the whole prompt: its prefix is now an exact radix hit
                samples.setdefault(("stock_prefix_hit", span_tokens, agents), []).append(
                    _measure(url, variant, "stock_prefix_hit")
                )
            done += 1
            if progress:
                print(f"\r[ttft] {done}/{total} prompts", end="", flush=True)
    if progress:
        print()
    return summarize(samples)


def summarize(samples: dict[tuple[str, int, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    med = {k: statistics.median(s["ttft"] for s in v) for k, v in samples.items()}
    for (method, span_tokens, agents), vals in sorted(samples.items(), key=lambda kv: kv[0][1:]):
        ttfts = sorted(s["ttft"] for s in vals)
        p90 = ttfts[min(len(ttfts) - 1, int(round(0.9 * (len(ttfts) - 1))))]
        std = med.get(("standard", span_tokens, agents))
        limit = med.get(("naive", span_tokens, agents))
        m = med[(method, span_tokens, agents)]
        reuse = statistics.median(s["reuse_rate"] for s in vals)
        # the compute-proportional ideal: nothing but the (1 - reuse) share of the prefill
        ideal = limit + (1 - reuse) * (std - limit) if std and limit else None
        names = sorted({k for s in vals for k in s.get("phases_ms", {})})
        rows.append(
            {
                "method": method,
                "span_tokens": span_tokens,
                "n_agents": agents,
                "prompt_tokens": vals[0]["prompt_tokens"],
                "reused_tokens": statistics.median(s["reused_tokens"] for s in vals),
                "ttft_median_s": round(m, 4),
                "ttft_p90_s": round(p90, 4),
                "reuse_rate": round(statistics.median(s["reuse_rate"] for s in vals), 4),
                "speedup_vs_standard": round(std / m, 2) if std else None,
                "ratio_to_prefix_hit_limit": round(m / limit, 2) if limit else None,
                "ideal_s": round(ideal, 4) if ideal is not None and reuse > 0 else None,
                "over_ideal": round(m / ideal, 3) if ideal and reuse > 0 else None,
                "phases_ms": {
                    k: round(statistics.median(s.get("phases_ms", {}).get(k, 0.0) for s in vals), 2)
                    for k in names
                },
                "n": len(vals),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | span tokens | agents | prompt | TTFT median s | p90 s | reuse | "
        "speedup vs standard | / limit |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['span_tokens']} | {r['n_agents']} | {r['prompt_tokens']} | "
            f"{r['ttft_median_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['reuse_rate']:.2f} | "
            f"{r['speedup_vs_standard']} | {r['ratio_to_prefix_hit_limit']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench ttft", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument(
        "--spans",
        default=None,
        help="comma list of relayed span lengths: only the span sweep, at these lengths "
        "(e.g. 1024,2048; default: the workload's cases)",
    )
    parser.add_argument("--workload", help="JSONL workload (default: the packaged one)")
    parser.add_argument("--json", help="write raw rows here")
    parser.add_argument("--url", help="use a running relay server instead of starting one")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time relay's phases per request (SGLANG_RELAY_PHASE_TIMES=1 on the server it "
        "starts; a --url server must run with it)",
    )
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import server_at

    methods = [m for m in args.methods.split(",") if m]
    unknown = {m for m in methods if m not in METHODS and not m.startswith("relay@")}
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    cases = load_workload(args.workload)
    if args.quick:
        for case in cases:
            if case["kind"] == "sweep":
                case["span_tokens"] = [n for n in case["span_tokens"] if n <= 1024]
            else:
                case["n_agents"] = [n for n in case["n_agents"] if n <= 4]
    if args.spans:
        try:
            spans = sorted({int(n) for n in args.spans.split(",") if n.strip()})
        except ValueError:
            spans = []
        if not spans or min(spans) < 32:
            parser.error("--spans must be a comma list of lengths >= 32")
        cases = [dict(c, span_tokens=spans) for c in cases if c["kind"] == "sweep"]
    reps = args.reps or (3 if args.quick else 7)
    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    if args.phases:
        import os

        os.environ["SGLANG_RELAY_PHASE_TIMES"] = "1"  # the server started below inherits it
    with server_at(args.url, ["--model-path", model_path, *server_flags]) as url:
        started = time.time()
        host = HostWatch()  # the hypervisor's steal meanwhile (bench/host.py)
        rows = run(url, tok, cases, reps, methods, phases=args.phases)
        elapsed = time.time() - started
        host_shares = host.summary()
    print(markdown(rows))
    if args.json:
        meta = {
            "machine": platform.platform(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
            "reps": reps,
            "elapsed_s": round(elapsed, 1),
            "host": host_shares,
        }
        Path(args.json).write_text(json.dumps([{**r, "run": meta} for r in rows], indent=1))
    return 0
