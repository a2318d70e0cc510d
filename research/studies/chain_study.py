"""Second hops: relays whose upstream output was itself decoded over a relayed prompt.

Every fidelity workload measures single hops: each upstream output's decode KV is exact.
On a relay server a chain's later agent (the demo's Developer, a workload's second
upstream agent whose prompt quotes the first one's output) decodes over a prompt that was
relayed too, so its span KV carries that relay's error into the next relay. Here, for each
relay of a workload with such an upstream agent, that agent's text is teacher-forced over
its own prompt relayed by the same method at the same point (reference
``generate(relayed=...)``), and the downstream relay is measured both ways: every
user-visible measure per method and point, and paired intervals of chain minus single hop
and of relay minus EPIC on the chains (docs/fidelity.md, "The chain as the server runs
it").

    python research/studies/chain_study.py [--workload humaneval82_workload.jsonl] [--limit N]
        [--targets 0.8,0.9,0.95] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MEASURES = ("first_token_kl", "top1", "greedy_prefix", "collapsed", "rouge_l")


def chained_relay(ref, relay, cfg, match_min: int) -> None:
    """Re-decode (same text) each upstream record of ``relay`` after the first whose prompt
    quotes an earlier record's output, over that prompt relayed under ``cfg``. Records are
    changed in place, so the relay's span occurrences follow them."""
    from sglang_relay.bench.workload import find_spans
    from sglang_relay.core.reference import generate

    for i, rec in enumerate(relay.records[1:], 1):
        spans = find_spans(rec.prompt, relay.records[:i], match_min)
        if not spans:
            continue
        (new,) = generate(ref, [rec.prompt], 0, force=[rec.output], relayed=[(spans, cfg)])
        rec.k, rec.v, rec.hidden, rec.influence = new.k, new.v, new.hidden, new.influence
        rec.prompt_k, rec.context = new.prompt_k, {}


def quotes_upstream(case) -> bool:
    """An upstream agent's template holds an earlier upstream agent's output."""
    names = [a.name for a in case.upstream]
    return any("{" + n + "}" in a.template for i, a in enumerate(case.upstream) for n in names[:i])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="humaneval82_workload.jsonl")
    p.add_argument("--limit", type=int, default=None, help="first N usable relays only")
    p.add_argument("--targets", default="0.8,0.9,0.95")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="per-relay rows, rewritten after each relay")
    p.add_argument("--report", default=None, help="print the tables of a --json file and stop")
    args = p.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report({(d["method"], d["target"], d["upstream"]): d["rows"] for d in saved})
        return
    from sglang_relay.bench.evaluation import evaluate_relay, load_bench_model, prepare_usable
    from sglang_relay.bench.fidelity import build_parser
    from sglang_relay.bench.frontier import parse_targets, sweep_points
    from sglang_relay.bench.workload import GenSettings, find_spans, load_relay, load_workload
    from sglang_relay.core.config import load_profile
    from sglang_relay.core.operating import Frontier

    bm = load_bench_model(build_parser().parse_args(["--threads", str(args.threads)]))
    ref, tok, gen = bm.ref, bm.tok, GenSettings()
    stop_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")} - {None})
    # only cases whose upstream agents quote one another are generated (the rest: no chain)
    cases = [c for c in load_workload(None, name=args.workload) if quotes_upstream(c)]
    usable, _ = prepare_usable(ref, tok, cases, args.limit, bm.cache_dir, bm.fingerprint, gen,
                               progress=False)  # fmt: skip
    chains = []
    for case, path in usable:  # relays with a second hop: an upstream prompt quoting another
        relay = load_relay(path, case)
        if any(find_spans(r.prompt, relay.records[:i], gen.match_min)
               for i, r in enumerate(relay.records[1:], 1)):  # fmt: skip
            chains.append((case, path, [s.length for s in relay.spans]))
    if not chains:
        raise SystemExit(f"{args.workload}: no relay has an upstream prompt quoting another")
    mean_span = statistics.fmean(n for _, _, lengths in chains for n in lengths)  # per span
    frontier = Frontier.from_profile(load_profile(bm.profile_path)[1])
    points = sweep_points(bm.relay_cfg, ref.num_layers, mean_span, parse_targets(args.targets),
                          ("relay", "epic"), frontier)  # fmt: skip
    print(f"{args.workload}: {len(chains)} relays with a second hop (of {len(usable)} quoting)")
    rows: dict[tuple[str, float, str], list[dict]] = {}
    started = time.perf_counter()
    configs = {pt.label: pt.config for pt in points}
    for case, path, _ in chains:
        # single hops: every point in one call (one exact prefill shared by all of them)
        single = evaluate_relay(ref, load_relay(path, case), configs, stop_ids)
        for pt in points:  # second hops: the upstream records depend on the point
            relay = load_relay(path, case)
            chained_relay(ref, relay, pt.config, gen.match_min)
            chain = evaluate_relay(ref, relay, {pt.label: pt.config}, stop_ids)
            rows.setdefault((pt.method, pt.target, "single"), []).append(single[pt.label])
            rows.setdefault((pt.method, pt.target, "chain"), []).append(chain[pt.label])
        print(f"  {case.id} ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.json:
            dump = [{"method": m, "target": t, "upstream": h, "rows": rs}
                    for (m, t, h), rs in rows.items()]  # fmt: skip
            Path(args.json).write_text(json.dumps(dump, default=str))

    report(rows)


def report(rows: dict[tuple[str, float, str], list[dict]]) -> None:
    """Per (method, point, hop) means with bootstrap intervals, then paired intervals of
    chain minus single hop per method and of relay minus EPIC on chains."""
    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci

    def col(key, m):
        return [float(r[m]) for r in rows[key]]

    print("\n| method | target | upstream | reuse | " + " | ".join(MEASURES) + " |")
    print("|---|---|---|---|" + "---|" * len(MEASURES))
    for (method, target, hop), rs in rows.items():
        cells = []
        for m in MEASURES:
            values = col((method, target, hop), m)
            lo, hi = bootstrap_ci(values)
            cells.append(f"{statistics.mean(values):.4f} [{lo:.4f}, {hi:.4f}]")
        reuse = statistics.mean(r["reuse_rate"] for r in rs)
        print(f"| {method} | {target} | {hop} | {reuse:.3f} | " + " | ".join(cells) + " |")
    print("\npaired 95 % intervals of the mean difference")
    print("| target | compared | " + " | ".join(MEASURES) + " |")
    print("|---|---|" + "---|" * len(MEASURES))
    targets = sorted({t for _, t, _ in rows})
    pairs = [(f"{m}: chain - single", (m, "chain"), (m, "single")) for m in ("relay", "epic")]
    pairs.append(("chain: relay - epic", ("relay", "chain"), ("epic", "chain")))
    for target in targets:
        for name, (ma, ha), (mb, hb) in pairs:
            if (ma, target, ha) not in rows or (mb, target, hb) not in rows:
                continue
            cells = []
            for m in MEASURES:
                a, b = col((ma, target, ha), m), col((mb, target, hb), m)
                lo, hi = paired_ci(a, b)
                cells.append(
                    f"{statistics.mean(a) - statistics.mean(b):+.4f} [{lo:+.4f}, {hi:+.4f}]"
                )
            print(f"| {target} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
