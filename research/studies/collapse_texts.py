"""The greedy replies behind a frontier run's collapse counts, as text.

A frontier point's collapse rate (``sglang-relay bench fidelity --frontier``) says how
many relays' free-running replies ended early or looped where exact prefill's did not;
this prints, for the chosen relays, the exact reply and each chosen point's reply (the
config stored in the frontier JSON, re-run on the reference executor), with its length,
tail loop and verdict, so a reader can see what a counted collapse looks like.

    python research/studies/collapse_texts.py --workload heldout72_workload.jsonl \\
        --frontier docs/bench/frontier_low_heldout72.json --points relay@0.60,epic@0.70 \\
        --ids cs-03,cs-11,cook-12,kids-01,kids-10

(docs/fidelity.md, "The low end": the shipped 0.70 point's five heldout72 collapses.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, help="packaged name or JSONL path")
    p.add_argument("--frontier", type=Path, required=True, help="a frontier run's --json")
    p.add_argument("--points", required=True, help="comma list of METHOD@TARGET rows")
    p.add_argument("--ids", required=True, help="comma list of relay ids")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    from sglang_relay.bench.evaluation import collapsed, load_bench_model, prepare_usable, tail_loop
    from sglang_relay.bench.fidelity import build_parser
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload
    from sglang_relay.core.config import RelayConfig
    from sglang_relay.core.reference import relay_prefill
    from sglang_relay.core.reference.measures import greedy_after_forced

    rows = {
        (r["method"], r["target"]): r
        for w in json.loads(args.frontier.read_text())["workloads"]
        for r in w["points"]
    }
    points = []
    for spec in args.points.split(","):
        method, target = spec.split("@")
        points.append((spec, RelayConfig.from_dict(rows[(method, float(target))]["config"])))
    bm = load_bench_model(build_parser().parse_args(["--threads", str(args.threads)]))
    ids = set(args.ids.split(","))
    cases = [c for c in load_workload(None, name=args.workload) if c.id in ids]
    usable, _ = prepare_usable(
        bm.ref, bm.tok, cases, None, bm.cache_dir, bm.fingerprint, GenSettings(), progress=False
    )
    for case, path in usable:
        relay = load_relay(path, case)
        cont = relay.continuation
        print(f"== {case.id}\nexact: {bm.tok.decode(cont)!r}")
        for spec, cfg in points:
            res = relay_prefill(bm.ref, relay.prompt, relay.spans, cfg, forced=cont[:-1])
            free = greedy_after_forced(bm.ref, res, cont, len(cont), [bm.tok.eos_token_id])
            print(
                f"{spec} (reuse {res.reuse_rate:.3f}): collapsed {collapsed(free, cont)}, "
                f"{len(free)} tokens, tail loop {tail_loop(free)}: {bm.tok.decode(free)!r}"
            )


if __name__ == "__main__":
    main()
