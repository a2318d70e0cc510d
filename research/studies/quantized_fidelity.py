"""Relay's fidelity against the same server's standard prefill, on a running server:
run it once against an unquantized server and once against a quantized one, same workload.

    python research/studies/quantized_fidelity.py URL OUT.json [--workload heldout] [--n 22]

For each case of the workload (held-out by default: no profile or rule was fitted on it),
the upstream agent's output is generated greedily (96 tokens) on the server, pasted into
the downstream agent's prompt, and the downstream prompt is answered twice on the same
server: relay (the server's default) and ``standard`` (SGLang's own prefill), 24 greedy
tokens, the first step's top-20 logprobs. Per relay: KL(standard || relay) over the first
token's top-20 tokens of standard, both renormalized there (relay's missing entries take
its 20th logprob), first-token top-1 agreement, free-running agreement (common prefix / 24),
collapse (relay stops within 4 tokens where standard does not). Writes the rows and
bootstrap intervals (bench/intervals.py). ``--compare A.jsonl B.jsonl``: two runs' printed
rows side by side, over the relays both hold, with paired intervals. Findings:
research/log.md."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import requests
from transformers import AutoTokenizer

from sglang_relay.bench.intervals import bootstrap_ci
from sglang_relay.bench.workload import chat_ids
from sglang_relay.data import __file__ as data_init

N_UP, N_DOWN, TOP = 96, 24, 20


def generate(url: str, ids: list[int], n: int, relay=None, top: int = 0) -> dict:
    params = {"max_new_tokens": n, "temperature": 0}
    if relay is not None:  # relay's per-request options are SGLang sampling custom_params
        params["custom_params"] = {"relay": relay}
    body = {"input_ids": ids, "sampling_params": params}
    if top:
        body.update(return_logprob=True, top_logprobs_num=top)
    resp = requests.post(url + "/generate", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()


def first_top(out: dict) -> dict[int, float]:
    return {int(t): float(lp) for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]}


def kl_top(std: dict[int, float], rel: dict[int, float]) -> float:
    """KL(standard || relay) on standard's top-k tokens, both renormalized over them
    (relay's missing entries take its k-th logprob): >= 0, 0 only when they agree there."""
    floor = min(rel.values())
    p = {t: math.exp(lp) for t, lp in std.items()}
    q = {t: math.exp(rel.get(t, floor)) for t in std}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(p[t] / zp * math.log((p[t] / zp) / (q[t] / zq)) for t in p)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--workload", default="heldout")
    ap.add_argument("--n", type=int, default=22)
    args = ap.parse_args()
    info = requests.get(args.url + "/get_server_info", timeout=30).json()
    model = info["model_path"]
    tok = AutoTokenizer.from_pretrained(model)
    path = Path(data_init).parent / f"{args.workload}_workload.jsonl"
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for case in cases[: args.n]:
        fields = {"task": case.get("task", "")}
        for up in case["upstream"]:
            prompt = chat_ids(tok, up["system"], up["template"].format_map(fields))
            out = generate(args.url, prompt, N_UP)
            fields[up["name"]] = tok.decode(out["output_ids"], skip_special_tokens=True)
        down = case["downstream"]
        prompt = chat_ids(tok, down["system"], down["template"].format_map(fields))
        rel = generate(args.url, prompt, N_DOWN, top=TOP)
        std = generate(args.url, prompt, N_DOWN, relay="standard", top=TOP)
        assert (std["meta_info"].get("relay") or {}).get("reused_tokens", 0) == 0
        r_ids, s_ids = rel["output_ids"], std["output_ids"]
        relay = rel["meta_info"].get("relay") or {}
        rows.append(
            {
                "id": case["id"],
                "reused_tokens": relay.get("reused_tokens", 0),
                "reuse_rate": relay.get("reuse_rate"),
                "fallback": relay.get("fallback"),
                "kl": kl_top(first_top(std), first_top(rel)),
                "top1": float(r_ids[:1] == s_ids[:1]),
                "agree": common_prefix(r_ids, s_ids) / max(1, min(len(s_ids), N_DOWN)),
                "collapse": float(len(r_ids) < 4 <= len(s_ids)),
                "top_relay": first_top(rel),
                "top_standard": first_top(std),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    relayed = [r for r in rows if r["reused_tokens"] > 0]
    state = info["internal_states"][0]["relay"]
    summary = {"linear_method": state.get("linear_method"), "model": model, "relays": len(relayed)}
    for key in ("kl", "top1", "agree", "collapse", "reuse_rate"):
        vals = [r[key] for r in relayed]
        if vals:
            summary[key] = [sum(vals) / len(vals), *bootstrap_ci(vals)]
    print(json.dumps(summary), flush=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


def compare(paths: list[str]) -> dict:
    """Side by side from two runs' printed rows (one JSON object per line; a run cut short
    keeps its rows): each measure's mean with its interval over the relays both runs hold,
    and the paired interval of the difference (second minus first)."""
    from sglang_relay.bench.intervals import paired_ci

    runs = []
    for p in paths:
        rows = [json.loads(line) for line in Path(p).read_text().splitlines() if '"id"' in line]
        runs.append({r["id"]: r for r in rows if r["reused_tokens"] > 0})
    ids = sorted(set(runs[0]) & set(runs[1]))
    out: dict = {"relays": len(ids), "runs": paths}
    for key in ("kl", "top1", "agree", "collapse", "reuse_rate"):
        a, b = ([run[i][key] for i in ids] for run in runs)
        out[key] = {
            "first": [sum(a) / len(a), *bootstrap_ci(a)],
            "second": [sum(b) / len(b), *bootstrap_ci(b)],
            "second_minus_first": paired_ci(b, a),
        }
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--compare":  # --compare FIRST.jsonl SECOND.jsonl
        print(json.dumps(compare(sys.argv[2:4]), indent=1))
    else:
        main()
