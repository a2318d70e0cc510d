"""``sglang-relay bench chaos``: faults beside calm, on the same seeded chains.

Three runs of ``bench load``'s agent chains, each on a fresh server with a KV pool small
enough that spans are evicted while their consumers arrive: **calm** (no faults),
**chaos** (a faulty client replaces the downstream agent of ``--fault-share`` of the
chains: it gives up mid-prefill, disconnects mid-stream, has SGLang abort its request
mid-decode through ``/abort_request``, or sends malformed relay options, in equal
shares) and **calm again** (the control: what concurrency alone changes between two runs
without faults). Client ``w``'s ``j``-th chain is the same in every run, so the good
chains all three completed are compared output for output (greedy decoding), split by
whether the downstream agent relayed in both runs, in neither, or in one (a span evicted
in one run only). Reported per run: requests served, faulty clients by kind, errors that
were not the client's doing, fallbacks by reason, relay hit rate, leaked KV slots, and per
window: server RSS, relay side memory, hit rate, relayed TTFT.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from sglang_relay.bench.evaluation import first_divergence as first_token_divergence
from sglang_relay.bench.load import load_server_args, log_errors, run_load, verdict

RUNS = (("calm", False), ("chaos", True), ("calm again", False))


def agreement(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How the good chains both runs completed compare, output for output: all outputs
    identical, split by whether the downstream agent relayed in both runs, in neither, or
    in one."""
    a, b = base["outputs"], other["outputs"]
    both = sorted(set(a) & set(b))
    out: dict[str, Any] = {"chains_compared": len(both), "identical": 0, "groups": {}}
    for k in both:
        key = {(True, True): "relayed_in_both", (False, False): "relayed_in_neither"}.get(
            (a[k]["down_relayed"], b[k]["down_relayed"]), "relayed_in_one"
        )
        group = out["groups"].setdefault(key, {"chains": 0, "identical": 0, "upstream_same": 0})
        same = a[k]["ids"] == b[k]["ids"]
        group["chains"] += 1
        group["identical"] += same
        group["upstream_same"] += a[k]["ids"][0] == b[k]["ids"][0]
        out["identical"] += same
        if not same:
            out.setdefault("divergences", []).append(first_divergence(k, key, a[k], b[k]))
    return out


def first_divergence(k: str, group: str, a: dict[str, Any], b: dict[str, Any]) -> dict:
    """Where two runs of one chain first part: which output (0 the upstream agent), which
    token, and in each run the logprob gap between its two likeliest tokens there (a gap
    near 0 is a near-tie that batch numerics alone can flip)."""
    for i, (x, y) in enumerate(zip(a["ids"], b["ids"], strict=False)):
        if x == y:
            continue
        t = first_token_divergence(x, y)
        gaps = [_gap(run, i, t) for run in (a, b)]
        return {"chain": k, "group": group, "output": i, "token": t,
                "gap_base": gaps[0], "gap_other": gaps[1]}  # fmt: skip
    return {"chain": k, "group": group, "output": None}


def _gap(run: dict[str, Any], output: int, token: int) -> float | None:
    m = (run.get("margins") or [None] * (output + 1))[output]
    return m[token] if m is not None and token < len(m) else None


def hit_rate(run: dict[str, Any]) -> str:
    could = sum(w["could_relay"] for w in run["windows"])
    relayed = sum(w["relayed"] for w in run["windows"])
    return f"{relayed}/{could} = {relayed / could:.2f}" if could else "-"


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    names = list(runs)

    def row(label: str, get) -> str:
        return f"| {label} | " + " | ".join(str(get(runs[n])) for n in names) + " |"

    def faults(run: dict[str, Any]) -> str:
        return json.dumps({k: v for k, v in run["faults"].items() if k != "share"})

    def ttft(w: dict[str, Any]) -> str:
        return f"{w['ttft_p50_s']} / {w['ttft_p90_s']} / {w['ttft_max_s']} ({w['ttft_n']})"

    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [
        row("chains completed", lambda r: r["chains_completed"]),
        row("requests served (200)", lambda r: r["requests_served"]),
        row("faulty clients by kind", faults),
        row("errors not caused by the client", lambda r: r["errors"]),
        row("relays into a namespace that stored nothing", lambda r: r["wrong_namespace_relays"]),
        row("fallbacks by reason", lambda r: json.dumps(r["fallbacks"], sort_keys=True)),
        row("downstream relay hit rate", hit_rate),
        row("leaked KV slots after", lambda r: r["leaked_slots"]),
        row("server healthy after", lambda r: r["healthy_after"]),
        row("server RSS MB, max per window", lambda r: [w["rss_mb_max"] for w in r["windows"]]),
        row("relay side MB, max per window", lambda r: [w["side_mb_max"] for w in r["windows"]]),
        row("hit rate per window", lambda r: [w["hit_rate"] for w in r["windows"]]),
        row("relayed TTFT p50 / p90 / max s (n)", lambda r: [ttft(w) for w in r["windows"]]),
    ]
    lines += [
        "",
        "| good chains vs calm | compared | all outputs identical | downstream relayed in "
        "both: identical | in neither | in one run only |",
        "|---|---|---|---|---|---|",
    ]
    for label, agr in result["agreement"].items():

        def frac(key: str, groups=agr["groups"]) -> str:
            g = groups.get(key)
            return f"{g['identical']}/{g['chains']}" if g else "-"

        lines.append(
            f"| {label} | {agr['chains_compared']} | {agr['identical']} | "
            f"{frac('relayed_in_both')} | {frac('relayed_in_neither')} | {frac('relayed_in_one')} |"
        )
    for label, agr in result["agreement"].items():
        for d in agr.get("divergences", []):
            lines.append(
                f"- {label}: chain {d['chain']} ({d['group']}) first parts at output "
                f"{d['output']}, token {d.get('token')}; top-2 logprob gap there "
                f"{d.get('gap_base')} (calm) / {d.get('gap_other')}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench chaos", description=__doc__)
    parser.add_argument("--chains", type=int, default=12, help="concurrent good clients")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--window", type=float, default=60.0, help="report window (s)")
    parser.add_argument("--pool-tokens", type=int, default=4000, help="KV pool (tokens)")
    parser.add_argument("--fault-share", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    server_args = load_server_args(model_path, args.pool_tokens, server_flags)
    runs: dict[str, dict[str, Any]] = {}
    for name, faulty in RUNS:
        server = ServerProcess(server_args).start()
        try:
            print(f"[chaos] {name}: {args.chains} chains for {args.duration:.0f}s", flush=True)
            runs[name] = run_load(
                server.url, tok, args.chains, args.duration, seed=args.seed,
                window=min(args.window, args.duration), pid=server.proc.pid, faults=faulty,
                fault_share=args.fault_share,
            )  # fmt: skip
            runs[name]["server_log_errors"] = log_errors(server.log_tail(200))
        finally:
            server.stop()
    result = {
        "runs": runs,
        "agreement": {
            "chaos vs calm": agreement(runs["calm"], runs["chaos"]),
            "calm again vs calm (control)": agreement(runs["calm"], runs["calm again"]),
        },
        "run": {
            "machine": platform.platform(),
            "args": vars(args),
            "server_args": server_args[2:],
        },
    }
    for run in runs.values():
        run.pop("outputs")
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    bad = [f"{name}: {line}" for name, run in runs.items() for line in verdict({"load": run})]
    for line in bad:
        print(f"[chaos] FAILED: {line}")
    return 1 if bad else 0
