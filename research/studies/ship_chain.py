"""Span shipping on a two-agent chain whose agents run on two servers: what the receiving
server's relay of a shipped span costs and gives, beside the same relay on the server that
decoded the span and beside standard prefill.

Two relay servers on loopback: a publisher U (``--relay-ship-to``) and a receiver R
(``--relay-ship-listen``), Mooncake over TCP between them. Per chain (topic ``k``):

1. an engineer's explanation is decoded on U (``--out-tokens``, greedy); U records the span
   and offers it to R;
2. ``shipped``: the reviewer's prompt, quoting it whole, on R: R pulls the span when it
   matches the prompt (inside this request's TTFT) and relays it;
3. ``local``: the same prompt on U, relaying the span where it was decoded;
4. ``standard``: the same prompt on R with relay off and its own ``cache_salt`` (no prefix
   hit, no span): standard prefill.

TTFT is the client's (streamed, first chunk). Fidelity: first-token KL over the top-20
logprobs and top-1 agreement, shipped vs local (the claim: a shipped span relays as if it
had been decoded on R) and shipped vs standard (relay's own approximation). Ratios of mean
TTFT with 95 % bootstrap intervals over chains (paired). One JSON with every request.

    python research/studies/ship_chain.py --chains 12 \\
        --json research/studies/data/ship_chain_2026-11-29.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import requests
from transformers import AutoTokenizer

from hicache_chain import TOPICS, _kl
from sglang_relay.client import generate
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess, free_port
from sglang_relay.prompts import chat_prompt

TIER = ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
TOP = 20


def _ask(url: str, prompt: str, tokens: int, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": tokens, "temperature": 0.0}
    if extra.pop("standard", False):
        params["custom_params"] = {"relay": "off"}
    gen = generate(url, prompt, params, return_logprob=True, top_logprobs_num=TOP, **extra)
    top = (gen.meta.get("output_top_logprobs") or [[]])[0]
    return {
        "ttft_s": gen.ttft_s,
        "text": gen.text,
        "relay": gen.relay or {},
        "first_top": [[lp, tid] for lp, tid, _ in top],
    }


def run(publisher: str, receiver: str, tok: Any, args: argparse.Namespace) -> list[dict]:
    rows = []
    for k in range(args.chains):
        topic = TOPICS[k % len(TOPICS)]
        up_prompt = chat_prompt(
            tok, "You are a senior engineer.", f"Explain {topic} in detail, with an example."
        )
        up = _ask(publisher, up_prompt, args.out_tokens)
        down = chat_prompt(
            tok,
            "You are a strict reviewer.",
            f"Review this explanation of {topic}:\n\n{up['text'].strip()}\n\n"
            "Name its two weakest points.",
        )
        time.sleep(args.pause)  # the next agent is seconds away
        shipped = _ask(receiver, down, args.down_tokens)
        local = _ask(publisher, down, args.down_tokens)
        standard = _ask(receiver, down, args.down_tokens, standard=True, cache_salt=f"std-{k}")
        rows.append({"chain": k, "topic": topic, "upstream": up, "shipped": shipped,
                     "local": local, "standard": standard})  # fmt: skip
        print(
            f"chain {k}: reused {shipped['relay'].get('reused_tokens')} "
            f"ttft shipped {shipped['ttft_s']:.3f} local {local['ttft_s']:.3f} "
            f"standard {standard['ttft_s']:.3f}",
            flush=True,
        )
    return rows


def _ratio(num: list[float], den: list[float], resamples: int = 2000) -> dict[str, Any]:
    n, d = np.asarray(num), np.asarray(den)
    idx = np.random.default_rng(0).integers(0, len(n), size=(resamples, len(n)))
    boot = n[idx].mean(1) / d[idx].mean(1)
    ci = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
    return {"ratio": float(n.mean() / d.mean()), "ci95": ci}


def summary(rows: list[dict], receiver_stats: dict[str, Any]) -> dict[str, Any]:
    ttft = {m: [r[m]["ttft_s"] for r in rows] for m in ("shipped", "local", "standard")}
    kl_local = [_kl(r["local"]["first_top"], r["shipped"]["first_top"]) for r in rows]
    kl_std = [_kl(r["standard"]["first_top"], r["shipped"]["first_top"]) for r in rows]
    top1 = [r["shipped"]["first_top"][0][1] == r["local"]["first_top"][0][1] for r in rows]
    span = [int(r["shipped"]["relay"].get("reused_tokens") or 0) for r in rows]
    local_span = [int(r["local"]["relay"].get("reused_tokens") or 0) for r in rows]
    received = int(receiver_stats.get("ship_received_spans", 0))
    return {
        "chains": len(rows),
        "reused_tokens_shipped": sum(span),
        "reused_tokens_local": sum(local_span),
        "ttft_mean_s": {m: float(np.mean(v)) for m, v in ttft.items()},
        "ttft_shipped_over_standard": _ratio(ttft["shipped"], ttft["standard"]),
        "ttft_shipped_over_local": _ratio(ttft["shipped"], ttft["local"]),
        "first_kl_shipped_vs_local_max": max(x for x in kl_local if x is not None),
        "first_top1_shipped_as_local": sum(top1) / len(top1),
        "first_kl_shipped_vs_standard_mean": float(np.mean([x for x in kl_std if x is not None])),
        "spans_received": received,
        "pull_ms_per_span": receiver_stats.get("ship_pull_ms", 0) / max(received, 1),
        "pull_bytes_per_span": receiver_stats.get("ship_pull_bytes", 0) / max(received, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chains", type=int, default=12)
    p.add_argument("--out-tokens", type=int, default=256)
    p.add_argument("--down-tokens", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.5)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    model = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model)
    ship = free_port()
    base = ["--model-path", model, "--max-total-tokens", "16384", *TIER]
    receiver = ServerProcess([*base, "--relay-ship-listen", f"127.0.0.1:{ship}",
                              "--relay-ship-publishers", "u=*"])  # fmt: skip
    with receiver:
        with ServerProcess([*base, "--relay-ship-to", f"127.0.0.1:{ship}",
                            "--relay-ship-name", "u"]) as publisher:  # fmt: skip
            rows = run(publisher.url, receiver.url, tok, args)
            stats = {
                name: requests.get(s.url + "/get_server_info", timeout=30).json()[
                    "internal_states"
                ][0]["relay"]
                for name, s in (("publisher", publisher), ("receiver", receiver))
            }
    result = {"args": vars(args), "summary": summary(rows, stats["receiver"]),
              "relay_stats": stats, "rows": rows}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
