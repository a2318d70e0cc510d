"""The README's results table, every row from committed data: fidelity at reuse 0.80 on the
two held-out workloads, TTFT at 1,024 relayed tokens from the newest run of the shipped
points, the seeded fan-out under load, goodput under a TTFT SLO per workload of the capacity
run, plain decode on a relay server, faults beside calm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sglang_relay.bench.chain_kinds import AGENTS
from sglang_relay.bench.docs_data import (
    default_point,
    fx,
    load,
    md_table,
    newest_shipped,
    point_label,
    spread,
    ttft_runs,
)
from sglang_relay.bench.docs_fidelity import BASELINES, at_target, frontier_points, verdicts
from sglang_relay.bench.docs_serve import CAPACITY_RUNS, seeded_summary

FRONTIERS = ("docs/bench/frontier_humaneval82.json", "docs/bench/frontier_heldout72.json")
README_POINTS = (0.80, 0.90, 0.95)
FANOUT = "docs/bench/serve_fanout_seeds.json"
DECODE = "docs/bench/decode_pairs.json"
CHAOS = "docs/bench/chaos.json"


def _fidelity_rows(root: Path, target: float) -> list[list[str]]:
    ats = [at_target(frontier_points(root, rel), target) for rel in FRONTIERS]
    vs = [verdicts(at) for at in ats]
    n = " / ".join(str(at["relay"]["n_relays"]) for at in ats)
    rows = []
    measures = (
        ("first_token_kl", "first-token KL vs exact prefill", ".4f", True),
        ("top1_agreement", "first-token top-1", ".3f", False),
        ("collapse_rate", "replies that collapse (loop or end early)", ".3f", True),
    )
    for key, what, fmt, lower in measures:
        mine, best = [], []
        for at, v in zip(ats, vs, strict=True):
            text = format(at["relay"][key], fmt)
            mine.append(f"**{text}**" if v[key][0] == "better" else text)
            rival = (min if lower else max)(at[m][key] for m in BASELINES if m in at)
            best.append(format(rival, fmt))
        words = [v[key][0] for v in vs]
        if set(words) == {"tie"}:
            verdict = "ties (the paired interval holds 0)"
        elif set(words) == {"better"}:
            verdict = "bold: better beyond the paired 95 % bootstrap interval"
        else:
            verdict = " / ".join(words) + " by the paired 95 % interval (bold: better)"
        where = (
            f"{n} relays (HumanEval82 / heldout72: `{Path(FRONTIERS[0]).name}`, "
            f"`{Path(FRONTIERS[1]).name}`)"
            if not rows
            else "same relays"
        )
        rows.append(
            [
                f"{what} at reuse {target:.2f}" + (" (mean)" if key == "first_token_kl" else ""),
                " / ".join(mine),
                "best baseline " + " / ".join(best),
                f"{where}; {verdict}",
            ]
        )
    return rows


def _ttft_row(root: Path) -> tuple[list[str], str]:
    default = default_point(root)
    run = newest_shipped(root, README_POINTS)
    if run is None:
        raise ValueError("no committed TTFT run measured the shipped points 0.80, 0.90, 0.95")
    cells = [run.row(point_label(p, default), 1024) for p in README_POINTS]
    std, naive = run.row("standard", 1024), run.row("naive", 1024)
    assert std is not None and naive is not None and all(c is not None for c in cells)
    speed = [f"{fx(c['speedup_vs_standard'])} {'faster ' if i == 0 else ''}at {p:.2f}"
             for i, (p, c) in enumerate(zip(README_POINTS, cells, strict=True)) if c]  # fmt: skip
    at_default = [
        r.row(point_label(default, default), 1024)["speedup_vs_standard"]  # type: ignore[index]
        for r in ttft_runs(root)
        if default in r.shipped and r.row(point_label(default, default), 1024) is not None
    ]
    row = [
        f"TTFT with 1,024 relayed tokens ({std['prompt_tokens']:,}-token prompt)",
        ", ".join(speed),
        f"standard prefill {std['ttft_median_s']:.2f} s; nothing recomputed "
        f"{fx(naive['speedup_vs_standard'])}",
        f"medians of {std['n']} repetitions, methods interleaved on one server "
        f"(`{Path(run.file).name}`); at "
        f"{default:.2f} the {len(at_default)} committed runs of the shipped point give "
        f"{spread(at_default, unit='x')}",
    ]
    return row, run.file


def _fanout_row(root: Path) -> list[str]:
    summary = seeded_summary(root, FANOUT)
    rows = load(root, FANOUT)["rows"]
    relay = [p for p in summary["points"] if p["method"] == "relay"]
    rates = " and ".join(f"{p['rate']:g}" for p in relay)
    p50 = [p["ttft_p50_ratio"] for p in relay]
    p90 = [p["ttft_p90_ratio"] for p in relay]

    def ratio(rs: list[Any]) -> str:
        text = spread([r[0] for r in rs], ".1f", "x")
        return f"**{text}**" if all(r[1] > 1 for r in rs) else text

    k = len(summary["goodput_per_seed"])
    requests = [r["requests"] for r in rows]
    return [
        f"fan-out under load (a lead's brief read by 4 workers), {rates} chains/min",
        f"TTFT p50 {ratio(p50)} lower [CI {spread([x for r in p50 for x in r[1:]])}], "
        f"p90 {ratio(p90)} [CI {spread([x for r in p90 for x in r[1:]])}]",
        "standard prefill on the same arrivals",
        f"{k} seeds per rate, {spread(requests, 'd')} requests per run, outputs ending "
        f"naturally; intervals resample chains; `{Path(FANOUT).name}`",
    ]


NAMES = {"standard": "standard", "cacheblend": "CacheBlend", "epic": "EPIC"}  # alternatives


WORKLOADS = {"fanout": "fan-out", "deep": f"deep chain, {AGENTS['deep']} agents in sequence",
             "toolloop": "tool loop",
             "toolloop:0.5,fanout:0.5": f"tool loops of {AGENTS['toolloop']} turns with a tool "
             "pause between, half and half with fan-outs, on a bound pool with a host tier",
             }  # fmt: skip


def _capacity_rows(root: Path) -> list[list[str]]:
    """One row per workload of the capacity runs, in :data:`WORKLOADS` order: goodput per SLO
    over achieved rates (censored arrivals as misses), relay against standard with the
    paired interval; bold where the interval excludes 1."""
    from sglang_relay.bench.capacity import goodput_table, points

    found: dict[str, list[str]] = {}
    source: dict[str, str] = {}  # workload -> its file
    for rel in CAPACITY_RUNS:
        data = load(root, rel)
        slos = [float(s) for s in data["args"]["slos"].split(",")]
        table, pts = goodput_table(data["rows"], slos), points(data["rows"])
        for w in dict.fromkeys(p["workload"] for p in pts):
            if w in source:  # one row per workload: which file's would be a silent choice
                raise ValueError(f"workload {w!r} is in two capacity runs: {source[w]}, {rel}")
            source[w] = rel
            mine = [p for p in pts if p["workload"] == w]
            theirs = [t for t in table if t["workload"] == w]
            found[w] = _capacity_row(w, theirs, mine, slos, rel)
    return [found[w] for w in WORKLOADS if w in found]


def _capacity_row(
    workload: str,
    table: list[dict[str, Any]],
    pts: list[dict[str, Any]],
    slos: list[float],
    rel: str,
) -> list[str]:
    from sglang_relay.bench.capacity import bound

    at = {(t["method"], t["slo_s"]): t for t in table}
    rates = sorted({p["offered"] for p in pts})
    counts = sorted({p["seeds"] for p in pts})  # rates may have different seed counts
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    chains = min(p["chains"] // p["seeds"] for p in pts)

    def cell(method: str, slo: float) -> str:
        t = at[(method, slo)]
        lo, hi = t["interval"]
        return f"{'>= ' if t['at_top'] else ''}{t['goodput']:.1f} [{lo:.1f}-{hi:.1f}]"

    def ratio(slo: float) -> str:
        if at[("relay", slo)]["at_top"] and at[("standard", slo)]["at_top"]:
            return "both at the highest rate tested: no ratio"
        r = at[("relay", slo)]["ratio"]
        if r[0] == float("inf"):
            return "standard: none, even at the lowest rate"
        if math.isnan(r[0]):  # neither meets the lowest rate tested
            return "standard: none either, no ratio"
        text = f"{bound(at[('relay', slo)], at[('standard', slo)])}{r[0]:.2f}x standard's"
        lo = "inf" if r[1] == float("inf") else f"{r[1]:.2f}"
        hi = "inf" if r[2] == float("inf") else f"{r[2]:.2f}"
        body = f"{text} [{lo}-{hi}]"
        return f"**{body}**" if r[1] > 1 else body

    return [
        f"agent chains under a TTFT SLO ({WORKLOADS[workload]}), {len(rates)} rates, "
        f"{min(p['achieved'] for p in pts):.1f}-{max(p['achieved'] for p in pts):.1f} "
        "chains/min achieved",
        "goodput, chains/min achieved, at p90 TTFT <= "
        + "; ".join(f"{s:g} s: {cell('relay', s)} ({ratio(s)})" for s in slos),
        " · ".join(
            f"{NAMES[m]}: " + "; ".join(cell(m, s) for s in slos)
            for m in NAMES
            if (m, slos[0]) in at
        ),
        f"{chains} chains per rate and seed, {seeds} seed(s) a rate; requests not finished in a "
        f"run count as misses; intervals resample blocks of chains; `{Path(rel).name}`",
    ]


def _decode_row(root: Path) -> list[str]:
    rows = load(root, DECODE)
    batches = " and ".join(str(r["batch"]) for r in rows)
    ratios = " and ".join(f"{r['relay_over_plain']:.3f}x" for r in rows)
    lo = min(r["relay_over_plain_ci"][0] for r in rows)
    hi = max(r["relay_over_plain_ci"][1] for r in rows)
    r0 = rows[0]
    return [
        f"plain decode on a relay server (no relayed request), batch {batches}",
        f"{ratios} plain SGLang's tokens/s [95 %: {lo:.3f}-{hi:.3f}]",
        "`--no-relay`",
        f"{r0['server_pairs']} server pairs x {r0['rounds']} paired rounds; `{DECODE}`, "
        '[docs/results.md](docs/results.md) "Decode overhead"',
    ]


def _chaos_row(root: Path) -> list[str]:
    data = load(root, CHAOS)
    chaos = data["runs"]["chaos"]
    faults = {k: v for k, v in chaos["faults"].items() if k != "share"}
    relayed = sum(w["relayed"] for w in chaos["windows"])
    could = sum(w["could_relay"] for w in chaos["windows"])
    agree = data["agreement"]
    faulty, control = agree["chaos vs calm"], agree["calm again vs calm (control)"]

    def where(d: dict[str, Any]) -> tuple[Any, ...]:
        return d["chain"], d["output"], d["token"]

    same = {where(d) for d in faulty["divergences"]} <= {where(d) for d in control["divergences"]}
    odd = faulty["chains_compared"] - faulty["identical"]
    other = "the other one differs" if odd == 1 else f"the other {odd} differ"
    differ = f"{other} the same way in the fault-free control" if same else f"{other} from it"
    minutes = data["run"]["args"]["duration"] / 60
    return [
        f"faulty clients among good chains ({sum(faults.values())} faults of "
        f"{sum(v > 0 for v in faults.values())} kinds, {minutes:g} minutes)",
        f"{chaos['errors']} errors, {chaos['leaked_slots']} leaked slots, hit rate "
        f"{relayed}/{could}; {faulty['identical']} of {faulty['chains_compared']} good chains "
        f"gave calm's outputs, {differ}",
        f"without faults, run twice: {control['identical']} of {control['chains_compared']} "
        "identical",
        f"one run each, {chaos['chains_concurrent']} concurrent clients; `{CHAOS}`, "
        "[docs/reliability.md](docs/reliability.md)",
    ]


def results_table(root: Path) -> str:
    """The README's results table with its caption (which file, how many runs)."""
    ttft, ttft_file = _ttft_row(root)
    rows = _fidelity_rows(root, 0.80) + [ttft, _fanout_row(root), *_capacity_rows(root)]
    rows.append(_decode_row(root))
    rows.append(_chaos_row(root))
    table = md_table(["measure", "relay", "the alternative", "behind it"], rows)
    return table + (
        f"\n\nTTFT row: `{ttft_file}`, the newest committed run that measured the points the "
        "server ships (0.80 with the context rule, 0.90 and 0.95 with the last-row probe), "
        "read from the profile committed with each run; the spread at 0.80 is over every "
        "committed TTFT run of that point on the embedded model "
        "(`docs/bench/`, `research/studies/data/`). Generated by `make docs-numbers`."
    )
