"""How far an *exact* prefill in bf16 is from the fp32 one: a yardstick for the frontier.

Every measure of the fidelity frontier (docs/fidelity.md) compares a method's KV with the
exact fp32 prefill of the same prompt. This computes the same measures for exact prefill
and decode with the model in **bf16** (the dtype the embedded model ships in and SGLang
serves it in on a GPU; every K/V row computed, nothing reused) against that fp32 reference,
on the same relays, and compares each frontier point with it relay by relay (paired
bootstrap 95 % intervals of point minus floor). A point that is no worse than the floor
on a measure is as close to fp32 standard as changing the serving dtype is.

    python benchmark/precision_floor.py --workload heldout72_workload.jsonl \\
        --frontier docs/bench/frontier_heldout72.json [--json OUT] [--threads 1]
    python benchmark/precision_floor.py --demo     # the demo chain, standard fp32 vs bf16

``--demo``: the packaged demo chain (``make demo``'s three agents, 256 tokens each) run
with standard prefill and greedy decoding twice, the model in fp32 (what the demo's CPU
server runs) and in bf16, each pipeline pasting its own outputs: how many leading tokens
of each agent's output the two share, the measure the demo's "same N/256 tok" column
reports for relay.

Offline, on the reference executor; the relays come from the fidelity bench's generation
cache (made by the frontier run); ~8 min per 72 relays at 1 thread on the 2-core VM.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

# the frontier's measures shown (sglang_relay.bench.evaluation.MEASURES), with their formats
SHOWN = {
    "first_token_kl": ".4f",
    "first_token_kl_median": ".4f",
    "top1_agreement": ".3f",
    "tf_top1_agreement_64": ".3f",
    "greedy_prefix_64": ".3f",
    "collapse_rate": ".3f",
    "rouge_l_64": ".3f",
}


def floor_rows(ref, low, relays, stop_ids) -> list[dict]:
    """Per relay: the fidelity measures of ``low`` (the model in another dtype)'s exact
    prefill and greedy reply against ``ref``'s (fp32), the frontier's per-relay fields."""
    from sglang_relay.bench.evaluation import collapsed, rouge_l
    from sglang_relay.core.reference import exact_prefill, fidelity, greedy_after_forced

    rows = []
    for relay in relays:
        cont = relay.continuation
        exact = exact_prefill(ref, relay.prompt, forced=cont[:-1])
        t0 = time.perf_counter()
        res = exact_prefill(low, relay.prompt, forced=cont[:-1])
        free = greedy_after_forced(low, res, cont, len(cont), stop_ids)
        row = fidelity(exact.logits, res.logits.float(), cont)
        row.update(
            id=relay.case.id,
            collapsed=int(collapsed(free, cont)),
            rouge_l=rouge_l(free, cont),
            span_tokens=relay.span_tokens,
            selected=0,
            reuse_rate=0.0,
            seconds=time.perf_counter() - t0,
        )
        rows.append(row)
    return rows


def compare(floor: list[dict], frontier: dict) -> str:
    """Markdown: the floor's measures, then each frontier point's paired interval of
    (point - floor) per measure with its verdict against the floor."""
    from sglang_relay.bench.evaluation import MEASURES
    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci, verdict

    by_id = {r["id"]: r for r in floor}
    head = "| row | " + " | ".join(SHOWN) + " |"
    lines = [head, "|---" * (len(SHOWN) + 1) + "|"]
    cells = []
    for name, fmt in SHOWN.items():
        field, stat, _ = MEASURES[name]
        values = [r[field] for r in floor]
        lo, hi = bootstrap_ci(values, stat)
        mid = statistics.median(values) if stat == "median" else statistics.fmean(values)
        cells.append(f"{mid:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]")
    lines.append(f"| exact, bf16 model ({len(floor)} relays) | " + " | ".join(cells) + " |")
    for row in frontier["points"]:
        if row.get("target") is None:
            continue
        pairs = [(r, by_id[r["id"]]) for r in row["per_relay"] if r["id"] in by_id]
        cells = []
        for name in SHOWN:
            field, stat, lower = MEASURES[name]
            lo, hi = paired_ci([a[field] for a, _ in pairs], [b[field] for _, b in pairs], stat)
            word = {"better": "better", "worse": "WORSE", "tie": "tie"}[
                verdict(lo, hi, lower_is_better=lower)
            ]
            cells.append(f"{word} [{lo:+.3f}, {hi:+.3f}]")
        label = f"{row['method']} @{row['target']:.2f} (reuse {row['reuse_rate']:.3f}) - floor"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def demo_chain(ref, low, tok, max_new_tokens: int | None = None) -> None:
    """Print each demo agent's shared leading tokens, fp32 pipeline vs bf16 pipeline
    (``max_new_tokens``: per agent, default the chain's)."""
    from sglang_relay.bench.workload import chat_ids
    from sglang_relay.core.reference import generate
    from sglang_relay.demo import load_chain

    chain = load_chain(None)
    n = max_new_tokens or chain["max_new_tokens"]
    eos = tok.eos_token_id
    texts = {"fp32": {"task": chain["task"]}, "bf16": {"task": chain["task"]}}
    print("| agent | fp32 tokens | bf16 tokens | shared leading tokens |\n|---|---|---|---|")
    for agent in chain["agents"]:
        outs = {}
        for name, model in (("fp32", ref), ("bf16", low)):
            prompt = chat_ids(tok, agent["system"], agent["template"].format(**texts[name]))
            rec = generate(model, [prompt], n, stop_ids=[eos], capture=False)[0]
            outs[name] = [t for t in rec.output if t != eos]
            texts[name][agent["name"]] = tok.decode(outs[name])
        a, b = outs["fp32"], outs["bf16"]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        same = min(len(a), len(b)) if same is None else same
        print(f"| {agent['name']} | {len(a)} | {len(b)} | {same} |", flush=True)
    live = json.loads((Path(__file__).parent / "data" / "demo_relay_chain.json").read_text())
    same = live["outs"]["Architect"].startswith(texts["fp32"]["Architect"])
    print(f"\nfp32 Architect is the live CPU server's (data/demo_relay_chain.json): {same}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", help="packaged name or JSONL path")
    p.add_argument("--frontier", type=Path, help="the frontier run's --json")
    p.add_argument("--demo", action="store_true", help="the demo chain in fp32 and bf16")
    p.add_argument("--demo-tokens", type=int, help="--demo: tokens per agent (default 256)")
    p.add_argument("--json", type=Path, help="write the floor's per-relay rows here")
    p.add_argument("--floor", type=Path, help="read the floor's rows from an earlier --json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--limit", type=int, help="first N usable relays only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_relay.bench.evaluation import default_cache_dir, prepare_usable
    from sglang_relay.bench.frontier import resolve_workloads
    from sglang_relay.bench.workload import GenSettings, load_relay, model_fingerprint
    from sglang_relay.core.reference import RefModel, load_model
    from sglang_relay.embedded_model import ensure_model

    model = ensure_model()
    tok = AutoTokenizer.from_pretrained(model)
    ref = load_model(str(model))
    low = RefModel(copy.deepcopy(ref.model).to(torch.bfloat16))
    if args.demo:
        demo_chain(ref, low, tok, args.demo_tokens)
        return
    if not args.workload or not args.frontier:
        p.error("--workload and --frontier (or --demo)")
    (name, cases), *_ = resolve_workloads(args.workload)
    fingerprint = model_fingerprint(model, ref.num_layers)
    usable, _ = prepare_usable(
        ref, tok, cases, args.limit, default_cache_dir(), fingerprint, GenSettings(), progress=False
    )
    relays = (load_relay(path, case) for case, path in usable)
    started = time.perf_counter()
    if args.floor:
        floor = json.loads(args.floor.read_text())["per_relay"]
    else:
        floor = floor_rows(ref, low, relays, [tok.eos_token_id])
    frontier = json.loads(args.frontier.read_text())
    workload = next(w for w in frontier["workloads"] if Path(w["workload"]).name == Path(name).name)
    print(f"### {name}: every point against exact prefill in bf16 (paired, point - floor)\n")
    print(compare(floor, workload))
    print(f"\n{len(floor)} relays, {time.perf_counter() - started:.0f} s, 1 torch thread(s)")
    if args.json:
        args.json.write_text(json.dumps({"workload": name, "per_relay": floor}, indent=1))


if __name__ == "__main__":
    main()
