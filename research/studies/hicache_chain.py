"""Agent chains whose device pool turns over between agents: relay's hit rate with the
HiCache host tier, without it, and with a pool large enough that nothing is evicted.

Each chain is the serving bench's ``pipeline`` (Planner -> Engineer -> Reviewer, each agent
quoting every earlier output, greedy). Between two agents of a chain, unrelated traffic
(``--fillers`` prompts of ``--filler-tokens`` tokens, 2-token replies: other users, or a
tool call's wait) passes through the server, enough to push the chain's KV off a small
device pool. Three servers run the same requests in the same order, one after another:

* ``large``: a device pool of ``--large-pool`` tokens, nothing evicted (the reference);
* ``hicache``: ``--small-pool`` tokens with ``--enable-hierarchical-cache`` (write_through;
  on this CPU SGLang's host tier with the stand-in, ``SGLANG_RELAY_CPU_HICACHE=1``); relay's
  host tier keeps the spans;
* ``small``: ``--small-pool`` tokens, no HiCache: an evicted span is gone.

Hit rate: the span tokens relayed into downstream prompts (relay's ``reused_tokens``), over
what the ``large`` run relayed on the same requests (95 % bootstrap over requests).
Fidelity against the ``large`` run, per downstream agent: the same greedy output (whole),
the first-token top-1 and the first-token KL over the top-20 logprobs both servers
returned. Writes one JSON (every request's relay info) and prints the table.

    python research/studies/hicache_chain.py --chains 8 \\
        --json research/studies/data/hicache_chain_2026-11-28.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np
import requests
from transformers import AutoTokenizer

from sglang_relay.bench.chain_kinds import chain_prompts as _chain_prompts
from sglang_relay.client import generate
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess
from sglang_relay.prompts import chat_prompt

TOPICS = [
    "binary search", "hash maps", "TCP handshakes", "garbage collection", "B-trees",
    "rate limiting", "consistent hashing", "bloom filters", "LRU caches", "mutexes",
    "backpressure", "idempotent APIs", "vector clocks", "tries", "heap sort", "quorum reads",
]  # fmt: skip
HICACHE = [
    "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
    "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
    "--hicache-ratio", "4",
]  # fmt: skip
TOP = 20


def _filler(tok: Any, k: int, j: int, tokens: int) -> str:
    words = " ".join(f"item{(k * 131 + j * 17 + w) % 997}" for w in range(tokens))
    return chat_prompt(tok, f"Clerk {k}.{j}.", f"Count these: {words}")


def run(url: str, tok: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for k in range(args.chains):
        topic = TOPICS[k % len(TOPICS)]
        outs: list[str] = []
        for i in range(3):
            system, user, quotes = _chain_prompts("pipeline", k, topic, outs, i)
            params = {"max_new_tokens": args.out_tokens, "temperature": 0.0}
            gen = generate(
                url,
                chat_prompt(tok, system, user),
                params,
                return_logprob=True,
                top_logprobs_num=TOP,
            )
            meta = gen.meta
            top = (meta.get("output_top_logprobs") or [[]])[0]
            rows.append(
                {
                    "chain": k,
                    "agent": i,
                    "quotes": quotes,
                    "output": gen.text,
                    "relay": gen.relay or {},
                    "first_top": [[lp, tid] for lp, tid, _ in top],
                }
            )
            outs.append(gen.text.strip())
            if i < 2:  # the pause: other traffic passes through
                for j in range(args.fillers):
                    generate(url, _filler(tok, k, j, args.filler_tokens), {"max_new_tokens": 2})
    return rows


def _kl(p_top: list, q_top: list) -> float | None:
    """KL(p || q) over p's top tokens that q also returned (renormalised on them)."""
    q = {tid: lp for lp, tid in q_top}
    common = [(lp, q[tid]) for lp, tid in p_top if tid in q]
    if not common:
        return None
    zp = math.log(sum(math.exp(a) for a, _ in common))
    zq = math.log(sum(math.exp(b) for _, b in common))
    return sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in common)


def _ratio_ci(num: list[int], den: list[int], resamples: int = 2000) -> list[float]:
    """95 % percentile bootstrap of sum(num) / sum(den), requests resampled in pairs."""
    rng = np.random.default_rng(0)
    n, d = np.asarray(num, float), np.asarray(den, float)
    idx = rng.integers(0, len(n), size=(resamples, len(n)))
    ratios = n[idx].sum(1) / np.maximum(d[idx].sum(1), 1)
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per run, over the downstream agents (those quoting earlier outputs): relayed tokens,
    their ratio to the ``large`` run's on the same requests (95 % bootstrap interval over
    requests), and agreement with the ``large`` run."""
    ref = {(r["chain"], r["agent"]): r for r in runs["large"]}
    out = {}
    for name, rows in runs.items():
        down = [r for r in rows if r["quotes"]]
        pairs = [(r, ref[(r["chain"], r["agent"])]) for r in down]
        reused = [int(r["relay"].get("reused_tokens") or 0) for r, _ in pairs]
        base = [int(q["relay"].get("reused_tokens") or 0) for _, q in pairs]
        same = [r["output"] == q["output"] for r, q in pairs]
        top1 = [
            bool(r["first_top"]) and r["first_top"][0][1] == q["first_top"][0][1] for r, q in pairs
        ]
        kls = [x for x in (_kl(q["first_top"], r["first_top"]) for r, q in pairs) if x is not None]
        fallbacks: dict[str, int] = {}
        for r in down:
            fb = r["relay"].get("fallback")
            if fb:
                fallbacks[fb] = fallbacks.get(fb, 0) + 1
        out[name] = {
            "downstream_requests": len(down),
            "reused_tokens": sum(reused),
            "hit_vs_large": sum(reused) / sum(base) if sum(base) else None,
            "hit_vs_large_ci95": _ratio_ci(reused, base) if sum(base) else None,
            "same_output_as_large": sum(same) / len(same) if same else None,
            "first_top1_as_large": sum(top1) / len(top1) if top1 else None,
            "first_kl_vs_large_mean": sum(kls) / len(kls) if kls else None,
            "first_kl_vs_large_max": max(kls) if kls else None,
            "fallbacks": fallbacks,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chains", type=int, default=8)
    p.add_argument("--out-tokens", type=int, default=96)
    p.add_argument("--fillers", type=int, default=5)
    p.add_argument("--filler-tokens", type=int, default=500)
    p.add_argument("--small-pool", type=int, default=2048)
    p.add_argument("--large-pool", type=int, default=32768)
    p.add_argument("--only", nargs="*", default=["large", "hicache", "small"])
    p.add_argument("--json", required=True)
    args = p.parse_args()
    model = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model)
    servers = {
        "large": (["--max-total-tokens", str(args.large_pool)], None),
        "hicache": (
            ["--max-total-tokens", str(args.small_pool), *HICACHE],
            {"SGLANG_RELAY_CPU_HICACHE": "1"},
        ),
        "small": (["--max-total-tokens", str(args.small_pool)], None),
    }
    runs, stats = {}, {}
    for name in args.only:
        flags, env = servers[name]
        t0 = time.time()
        with ServerProcess(["--model-path", model, *flags], env=env) as server:
            runs[name] = run(server.url, tok, args)
            info = requests.get(server.url + "/get_server_info", timeout=30).json()
            stats[name] = info["internal_states"][0]["relay"]
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    result = {
        "args": vars(args),
        "summary": summary(runs) if "large" in runs else None,
        "relay_stats": stats,
        "runs": runs,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
