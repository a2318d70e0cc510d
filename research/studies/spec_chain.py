"""Relay on a speculative server (NGRAM) beside the same server without speculation: does
speculative decoding change what relay reuses or what it computes, and what does NGRAM
accept on agent outputs?

One relay server at a time on loopback (so the two never share the 2 cores): ``ngram``
(``--speculative-algorithm NGRAM``, SGLang's defaults) and ``plain`` (no speculation).
Per chain (topic ``k``), on each server:

1. an engineer's explanation is decoded (``--out-tokens``, greedy, EOS ignored): upstream
   decode time, and on ``ngram`` SGLang's acceptance counters (tokens per verify step,
   correct drafts / proposed drafts);
2. a reviewer's prompt quoting it whole is relayed: reused tokens over the span's tokens
   (relay hit rate), selected tokens, first-token top-20 logprobs, TTFT (streamed).

Compared per chain: the upstream texts (greedy speculation must not change a token), the
relay hit rate, first-token KL between the two servers' relays and top-1 agreement; mean
decode time ratio with a 95 % bootstrap interval over chains (paired). One JSON with
every request.

    python research/studies/spec_chain.py --chains 12 \\
        --json research/studies/data/spec_chain_2026-11-29.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import requests
from transformers import AutoTokenizer

from hicache_chain import TOPICS, _kl
from sglang_relay.client import generate
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess
from sglang_relay.prompts import chat_prompt
from ship_chain import _ask, _ratio

SPEC_KEYS = ("spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts",
             "spec_verify_ct")  # fmt: skip


def _upstream(url: str, prompt: str, tokens: int) -> dict[str, Any]:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    gen = generate(url, prompt, params)
    meta = gen.meta or {}
    return {"text": gen.text, "e2e_s": meta.get("e2e_latency"), "ttft_s": gen.ttft_s,
            **{k: meta.get(k) for k in SPEC_KEYS}}  # fmt: skip


def run(url: str, tok: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for k in range(args.chains):
        topic = TOPICS[k % len(TOPICS)]
        up_prompt = chat_prompt(
            tok, "You are a senior engineer.", f"Explain {topic} in detail, with an example."
        )
        up = _upstream(url, up_prompt, args.out_tokens)
        down = chat_prompt(
            tok,
            "You are a strict reviewer.",
            f"Review this explanation of {topic}:\n\n{up['text'].strip()}\n\n"
            "Name its two weakest points.",
        )
        span = len(tok(up["text"], add_special_tokens=False)["input_ids"])
        relayed = _ask(url, down, args.down_tokens)
        rows.append({"chain": k, "topic": topic, "upstream": up, "relayed": relayed,
                     "span_tokens": span})  # fmt: skip
        print(
            f"chain {k}: accept {up.get('spec_accept_length')} decode {up['e2e_s']:.2f}s "
            f"reused {relayed['relay'].get('reused_tokens')}/{span}",
            flush=True,
        )
    return rows


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ngram, plain = runs["ngram"], runs["plain"]
    pairs = list(zip(ngram, plain, strict=True))
    same_text = [a["upstream"]["text"] == b["upstream"]["text"] for a, b in pairs]
    kl = [_kl(b["relayed"]["first_top"], a["relayed"]["first_top"]) for a, b in pairs]
    top1 = [a["relayed"]["first_top"][0][1] == b["relayed"]["first_top"][0][1] for a, b in pairs]

    def hit(rows: list[dict[str, Any]]) -> float:
        reused = sum(int(r["relayed"]["relay"].get("reused_tokens") or 0) for r in rows)
        return reused / max(1, sum(r["span_tokens"] for r in rows))

    correct = sum(int(r["upstream"]["spec_num_correct_drafts"] or 0) for r in ngram)
    proposed = sum(int(r["upstream"]["spec_num_proposed_drafts"] or 0) for r in ngram)
    decode = {m: [r["upstream"]["e2e_s"] for r in rows] for m, rows in runs.items()}
    return {
        "chains": len(ngram),
        "upstream_identical": f"{sum(same_text)}/{len(same_text)}",
        "relay_hit_rate": {m: hit(rows) for m, rows in runs.items()},
        "selected_tokens_mean": {
            m: float(np.mean([r["relayed"]["relay"].get("selected_tokens", 0) for r in rows]))
            for m, rows in runs.items()
        },
        "first_kl_ngram_vs_plain_max": max(x for x in kl if x is not None),
        "first_top1_ngram_as_plain": sum(top1) / len(top1),
        "accept_length_mean": float(np.mean([r["upstream"]["spec_accept_length"] for r in ngram])),
        "accepted_drafts_over_proposed": correct / max(1, proposed),
        "upstream_decode_s_mean": {m: float(np.mean(v)) for m, v in decode.items()},
        "upstream_decode_ngram_over_plain": _ratio(decode["ngram"], decode["plain"]),
        "relay_ttft_ngram_over_plain": _ratio(
            [r["relayed"]["ttft_s"] for r in ngram], [r["relayed"]["ttft_s"] for r in plain]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chains", type=int, default=12)
    p.add_argument("--out-tokens", type=int, default=192)
    p.add_argument("--down-tokens", type=int, default=4)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    model = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model)
    base = ["--model-path", model, "--max-total-tokens", "16384"]
    runs, stats = {}, {}
    for name, extra in (("ngram", ["--speculative-algorithm", "NGRAM"]), ("plain", [])):
        with ServerProcess([*base, *extra]) as server:
            generate(server.url, "Warm up.", {"max_new_tokens": 8, "temperature": 0.0})
            runs[name] = run(server.url, tok, args)
            info = requests.get(server.url + "/get_server_info", timeout=30).json()
            stats[name] = info["internal_states"][0]["relay"]
    result = {"args": vars(args), "summary": summary(runs), "relay_stats": stats, "runs": runs}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
