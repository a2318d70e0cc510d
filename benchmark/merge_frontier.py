"""Re-measure one method of a frontier run without re-running the others.

A new relay profile changes relay's rows only: the baselines' knobs do not depend on it,
and every method of a relay is scored against the same exact pass. This takes a frontier
JSON (``sglang-relay bench fidelity --frontier --json``) holding the baselines, and a
second one with the re-measured method(s) on the same workload, and writes the merged
run (the second run's rows replace the first's at the same method and target) with the
frontier's own tables, plus a paired before/after table of the replaced rows.

    python benchmark/merge_frontier.py docs/bench/frontier_heldout72.json new.json \\
        --json merged.json --markdown merged.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sglang_relay.bench.frontier_report import measure_verdicts, workload_markdown


def merge(base: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], list[tuple]]:
    """``(merged workload result, replaced pairs (target, before row, after row))``."""
    if base["workload"] != new["workload"]:
        raise SystemExit(f"workloads differ: {base['workload']} vs {new['workload']}")
    ids = {r["id"] for p in new["points"] for r in p["per_relay"]}
    if ids != {r["id"] for p in base["points"] for r in p["per_relay"]}:
        raise SystemExit("the two runs did not score the same relays")
    a, b = (set().union(*run["points"]) for run in (base, new))
    if a != b:
        raise SystemExit(
            f"the two runs measured different things ({sorted(a ^ b)}); re-run the base "
            "with this version of `sglang-relay bench fidelity --frontier`"
        )
    fresh = {(p["method"], p["target"]): p for p in new["points"]}
    points, replaced = [], []
    for p in base["points"]:
        after = fresh.pop((p["method"], p["target"]), None)
        if after is not None:
            replaced.append((p["target"], p, after))
        points.append(after or p)
    points += fresh.values()  # targets the base run did not have
    points.sort(key=lambda p: (p["target"] is not None, p["target"] or 0.0, p["method"]))
    return {**base, "points": points}, replaced


def before_after_table(replaced: list[tuple]) -> str:
    lines = [
        "| target | method | measure | after - before (95 % CI) | verdict |",
        "|---|---|---|---|---|",
    ]
    for target, before, after in replaced:
        for name, _, ci, word in measure_verdicts(after, [before]):
            lines.append(f"| {target:.2f} | {after['method']} | {name} | {ci} | {word} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="frontier JSON with every method")
    p.add_argument("new", help="frontier JSON with the re-measured method(s)")
    p.add_argument("--json", required=True)
    p.add_argument("--markdown", required=True)
    args = p.parse_args()
    base, new = (json.loads(Path(f).read_text()) for f in (args.base, args.new))
    if len(base["workloads"]) != len(new["workloads"]):
        raise SystemExit("the two runs have different workloads")
    merged, text = [], []
    for b, n in zip(base["workloads"], new["workloads"], strict=True):
        result, replaced = merge(b, n)
        merged.append(result)
        text.append(workload_markdown(result))
        text.append("Replaced rows, paired over the relays:\n\n" + before_after_table(replaced))
    run = {**base["run"], "merged": {"base": args.base, "new": args.new, "new_run": new["run"]}}
    Path(args.json).write_text(json.dumps({"run": run, "workloads": merged}, indent=1))
    Path(args.markdown).write_text("\n\n".join(text) + "\n")
    print("\n\n".join(text))


if __name__ == "__main__":
    main()
