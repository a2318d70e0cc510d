"""The fidelity tables of docs/fidelity.md, from the committed ``bench fidelity`` runs: each
method at its default, the frontier of the two held-out workloads with the paired verdicts,
and what each shipped operating point buys (its KL beside its TTFT)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sglang_relay.bench.docs_data import (
    PROFILE,
    TtftRun,
    default_point,
    fx,
    load,
    md_table,
    point_label,
    spread,
)

# The measures of a frontier table, in its column order: (summary key, header, format).
SHOWN = (
    ("first_token_kl", "KL mean", ".4f"),
    ("first_token_kl_median", "KL median", ".4f"),
    ("top1_agreement", "first-token top-1", ".3f"),
    ("tf_top1_agreement_64", "TF top-1 (64)", ".3f"),
    ("greedy_prefix_64", "greedy prefix (64)", ".3f"),
    ("collapse_rate", "collapse rate", ".3f"),
    ("rouge_l_64", "ROUGE-L (64)", ".3f"),
)
SHORT = {"first_token_kl": "KL mean", "first_token_kl_median": "KL median",
         "top1_agreement": "top-1", "tf_top1_agreement_64": "TF top-1",
         "greedy_prefix_64": "greedy prefix", "collapse_rate": "collapse rate",
         "rouge_l_64": "ROUGE-L"}  # fmt: skip
BASELINES = ("cacheblend", "epic")


def frontier_points(root: Path, rel: str) -> list[dict[str, Any]]:
    """Every point of a frontier run's (single) workload."""
    return load(root, rel)["workloads"][0]["points"]


def at_target(points: list[dict[str, Any]], target: float) -> dict[str, dict[str, Any]]:
    return {p["method"]: p for p in points if p["target"] == target}


def verdicts(at: dict[str, dict[str, Any]]) -> dict[str, tuple[str, float, float]]:
    """Per measure: relay against the best baseline of that measure on the same relays,
    ``(verdict, lo, hi)`` of the paired 95 % interval of relay minus it."""
    from sglang_relay.bench.evaluation import MEASURES
    from sglang_relay.bench.intervals import paired_ci, verdict

    mine = {r["id"]: r for r in at["relay"]["per_relay"]}
    out = {}
    for name, _, _ in SHOWN:
        field, stat, lower = MEASURES[name]
        rivals = [at[m] for m in BASELINES if m in at and name in at[m]]
        if name not in at["relay"] or not rivals:
            continue
        best = (min if lower else max)(rivals, key=lambda b: b[name])
        pairs = [(mine[r["id"]][field], r[field]) for r in best["per_relay"] if r["id"] in mine]
        lo, hi = paired_ci([a for a, _ in pairs], [b for _, b in pairs], stat)
        out[name] = (verdict(lo, hi, lower_is_better=lower), lo, hi)
    return out


def quick_table(root: Path, rel: str = "docs/bench/fidelity_quick.json") -> str:
    """``bench fidelity --quick``: each method at its default setting."""
    head = ["method", "reuse", "recomputed", "KL first token (mean / median)", "top-1",
            "TF top-1 (64)", "greedy prefix (64)", "first divergence (median)",
            "relays"]  # fmt: skip
    body = []
    for r in load(root, rel):
        name = f"**{r['method']}**" if r["method"] == "relay" else r["method"]
        kl = f"{r['first_token_kl']:.4f} / {r['first_token_kl_median']:.4f}"
        body.append([name, f"{r['reuse_rate']:.3f}", f"{r['recomputed_fraction']:.3f}",
                     f"**{kl}**" if r["method"] == "relay" else kl,
                     f"{r['top1_agreement']:.3f}", f"{r['tf_top1_agreement_64']:.3f}",
                     f"{r['greedy_prefix_64']:.3f}", f"{r['first_divergence']:g}",
                     str(r["n_relays"])])  # fmt: skip
    return md_table(head, body)


def frontier_table(root: Path, rel: str) -> str:
    """Every point of a held-out frontier with its bootstrap 95 % interval; bold where relay
    is better than the best baseline of that measure by the paired interval."""
    points = frontier_points(root, rel)
    head = ["method", "target", "reuse"] + [h for _, h, _ in SHOWN] + ["relays"]
    body = []
    for t in sorted({p["target"] for p in points if p["target"] is not None}):
        at = at_target(points, t)
        better = {k for k, (v, _, _) in verdicts(at).items() if v == "better"}
        for method in ("relay", *sorted(BASELINES, reverse=True)):
            if method not in at:
                continue
            p = at[method]
            cells = [f"**{method}**" if method == "relay" else method, f"{t:.2f}",
                     f"{p['reuse_rate']:.3f}"]  # fmt: skip
            for key, _, fmt in SHOWN:
                ci = p.get("ci", {}).get(key)
                text = format(p[key], fmt)
                text = f"**{text}**" if method == "relay" and key in better else text
                cells.append(text if ci is None else f"{text} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]")
            body.append(cells + [str(p["n_relays"])])
    return md_table(head, body)


def verdict_table(root: Path, rel: str) -> str:
    """Per target: the measures relay is better / worse on (with the paired interval of
    relay minus the best baseline) and the ties."""
    points = frontier_points(root, rel)
    body = []
    for t in sorted({p["target"] for p in points if p["target"] is not None}):
        v = verdicts(at_target(points, t))

        def named(word: str, v: dict[str, tuple[str, float, float]] = v) -> str:
            got = [f"{SHORT[k]} [{lo:+.3f}, {hi:+.3f}]" for k, (w, lo, hi) in v.items()
                   if w == word]  # fmt: skip
            return ", ".join(got) or "none"

        ties = ", ".join(SHORT[k] for k, (w, _, _) in v.items() if w == "tie") or "none"
        n = str(at_target(points, t)["relay"]["n_relays"])
        body.append([f"{t:.2f}", named("better"), ties, named("worse"), n])
    return md_table(["target", "better", "tie", "worse", "relays"], body)


WORKLOADS = (("fidelity_workload.jsonl", "fidelity"), ("heldout_workload.jsonl", "held-out"),
             ("humaneval_workload.jsonl", "HumanEval"))  # fmt: skip


def _ttft_cell(run: TtftRun, label: str) -> str | None:
    a, b = run.row(label, 1024), run.row(label, 2048)
    if a is None or b is None:
        return None
    return (f"{a['ttft_median_s']:.3f} s ({fx(a['speedup_vs_standard'])}) / "
            f"{b['ttft_median_s']:.3f} s ({fx(b['speedup_vs_standard'])})")  # fmt: skip


def points_table(root: Path, rel: str = "docs/bench/frontier.json") -> str:
    """Each operating point of the shipped profile: its rule, its KL on the three 16-relay
    workloads and against the best baseline's at the same reuse, and its TTFT at 1K / 2K
    relayed tokens from the newest run that measured the point as shipped."""
    from sglang_relay.bench.docs_data import newest_shipped

    data = load(root, rel)
    default = default_point(root)
    frontier = {round(p["target"], 2): p for p in load(root, PROFILE)["frontier"]}
    by_workload = {w["workload"]: w["points"] for w in data["workloads"]}
    main = newest_shipped(root, [default, 0.9, 0.95], spans=(1024, 2048))
    head = ["point (`--relay-reuse` / `\"reuse\"`)", "rule (shipped profile)",
            "KL " + " / ".join(n for _, n in WORKLOADS), "x best baseline's KL",
            "TTFT 1K / 2K (speedup)", "without its probe, same run"]  # fmt: skip
    body = []
    for t, entry in sorted(frontier.items()):
        kls, ratios = [], []
        for wl, _ in WORKLOADS:
            at = at_target(by_workload[wl], t)
            same = at["relay"].get("config") == entry["config"]  # else: an earlier profile's
            kls.append(f"{at['relay']['first_token_kl']:.4f}" + ("" if same else " (other config)"))
            best = min(at[m]["first_token_kl"] for m in BASELINES if m in at)
            ratios.append(at["relay"]["first_token_kl"] / best)
        label = point_label(t, default)
        run = main if main is not None and t in main.shipped else None
        run = (
            run
            if run is not None and _ttft_cell(run, label)
            else newest_shipped(root, [t], spans=(1024, 2048))
        )
        ttft, twin = "not measured", "not measured"
        if run is not None:
            ttft = _ttft_cell(run, label) or ttft
            ttft += "" if run is main else f" (`{Path(run.file).name}`)"
            twin = _ttft_cell(run, f"{label}:noprobe") or twin
        probe = entry["config"].get("probe") is not None
        twin = twin if probe else "(no probe)"
        name = f"{t:.2f}" + (" (default)" if t == default else "")
        body.append([name, "context + probe" if probe else "context", " / ".join(kls),
                     spread(ratios, unit="x"), ttft, twin])  # fmt: skip
    table = md_table(head, body)
    if main is not None:
        std = [main.row("standard", s) for s in (1024, 2048)]
        table += (
            f"\n\nTTFT: `{main.file}` (the newest committed run of the shipped 0.80, 0.90 and "
            f"0.95 points; medians of {std[0]['n']} repetitions, standard prefill "
            f"{std[0]['ttft_median_s']:.2f} s at 1K, {std[1]['ttft_median_s']:.2f} s at 2K) "
            "unless a cell names another run, which ran on another VM state: compare "
            "speedups, not seconds, across runs. KL: `" + rel + "` (16 relays per workload)."
        )
    return table
