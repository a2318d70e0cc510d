"""What ``bench fidelity --frontier`` reports: the points of each method's sweep with their
intervals, the verdict per measure against every baseline at equal reuse (a paired 95 %
interval that excludes zero), the comparison table and the KL-vs-reuse plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SWEPT = ("naive", "cacheblend", "epic", "relay")


STYLE = {"naive": "tab:gray", "cacheblend": "tab:blue", "epic": "tab:orange", "relay": "tab:red"}


def _value(row: dict[str, Any]) -> str:
    if row["knob"] is None:
        return "-"
    v = row["value"]
    return f"{row['knob']} {v}" if isinstance(v, int) else f"{row['knob']} {v:.3f}"


def _ci(row: dict[str, Any], name: str, fmt: str) -> str:
    """``value [lo, hi]`` of a summary measure (the value alone without an interval)."""
    value = format(row[name], fmt)
    ci = row.get("ci", {}).get(name)
    return value if ci is None else f"{value} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def points_table(rows: list[dict[str, Any]]) -> str:
    """Every point, every measure, with bootstrap 95 % intervals."""
    free = any("collapse_rate" in r for r in rows)
    head = (
        "| method | knob | target | reuse | KL mean | KL median | top-1 | TF top-1 (64) | "
        "greedy prefix (64) |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|"
    guarded = any("guard_rate" in r for r in rows)
    if free:
        head += " collapse rate | ROUGE-L (64) |"
        rule += "---|---|"
    if guarded:
        head += " guard redo rate | collapse rate, guard on |"
        rule += "---|---|"
    lines = [head + " relays |", rule + "---|"]
    for r in rows:
        target = "-" if r["target"] is None else f"{r['target']:.2f}"
        line = (
            f"| {r['method']} | {_value(r)} | {target} | {r['reuse_rate']:.3f} | "
            f"{_ci(r, 'first_token_kl', '.4f')} | {_ci(r, 'first_token_kl_median', '.4f')} | "
            f"{_ci(r, 'top1_agreement', '.3f')} | {_ci(r, 'tf_top1_agreement_64', '.3f')} | "
            f"{_ci(r, 'greedy_prefix_64', '.3f')} |"
        )
        if free:
            line += f" {_ci(r, 'collapse_rate', '.3f')} | {_ci(r, 'rouge_l_64', '.3f')} |"
        if guarded:
            line += f" {r.get('guard_rate', 0.0):.3f} | {_ci(r, 'collapse_rate_guarded', '.3f')} |"
        lines.append(line + f" {r['n_relays']} |")
    return "\n".join(lines)


def measure_verdicts(
    mine: dict[str, Any], baselines: list[dict[str, Any]]
) -> list[tuple[str, str, str, str]]:
    """Per measure: ``(measure, best baseline, paired 95 % interval of mine - it, verdict)``.
    The best baseline is the one with the best value of that measure; the interval
    resamples the relays both ran (:func:`~sglang_relay.bench.intervals.paired_ci`)."""
    from sglang_relay.bench.evaluation import MEASURES
    from sglang_relay.bench.intervals import paired_ci, verdict

    out = []
    mine_by_id = {r["id"]: r for r in mine["per_relay"]}
    for name, (field_name, stat, lower) in MEASURES.items():
        rivals = [b for b in baselines if name in b]
        if name not in mine or not rivals:
            continue
        best = (min if lower else max)(rivals, key=lambda b: b[name])
        pairs = [
            (mine_by_id[r["id"]][field_name], r[field_name])
            for r in best["per_relay"]
            if r["id"] in mine_by_id
        ]
        lo, hi = paired_ci([a for a, _ in pairs], [b for _, b in pairs], stat)
        out.append(
            (
                name,
                best["method"],
                f"[{lo:+.4f}, {hi:+.4f}]",
                verdict(lo, hi, lower_is_better=lower),
            )
        )
    return out


def verdict_table(rows: list[dict[str, Any]]) -> str:
    """Relay against the best baseline of each measure at each target: better, worse or a
    tie by the paired interval (a point is better only if no measure is worse)."""
    targets = sorted({r["target"] for r in rows if r["target"] is not None})
    lines = [
        "| target | measure | best baseline | relay - baseline (95 % CI) | verdict |",
        "|---|---|---|---|---|",
    ]
    for t in targets:
        at = {r["method"]: r for r in rows if r["target"] == t}
        baselines = [at[m] for m in ("cacheblend", "epic") if m in at]
        if "relay" not in at or not baselines:
            continue
        for name, base, ci, word in measure_verdicts(at["relay"], baselines):
            lines.append(f"| {t:.2f} | {name} | {base} | {ci} | {word} |")
    return "\n".join(lines)


def lower_count(mine: dict[str, Any], others: list[dict[str, Any]]) -> int:
    """Relays on which ``mine`` has a lower first-token KL than every row of ``others``."""
    by_id = [{r["id"]: r["first_token_kl"] for r in o["per_relay"]} for o in others]
    return sum(
        all(r["first_token_kl"] < o[r["id"]] for o in by_id if r["id"] in o)
        for r in mine["per_relay"]
    )


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """Per reuse target: each method's KL (mean / median) at its measured reuse, the method
    with the lowest mean, and on how many relays relay is below every baseline there."""
    methods = [m for m in ("cacheblend", "epic", "relay") if any(r["method"] == m for r in rows)]
    targets = sorted({r["target"] for r in rows if r["target"] is not None})
    head = "| target | " + " | ".join(f"{m}: KL mean / median (reuse)" for m in methods)
    lines = [
        head + " | lowest mean | relay below both (relays) |",
        "|---" * (len(methods) + 3) + "|",
    ]
    for t in targets:
        at = {r["method"]: r for r in rows if r["target"] == t}
        cells = []
        for m in methods:
            r = at.get(m)
            cells.append(
                "n/a"
                if r is None
                else f"{r['first_token_kl']:.4f} / {r['first_token_kl_median']:.4f} "
                f"({r['reuse_rate']:.3f})"
            )
        best = min(at.values(), key=lambda r: r["first_token_kl"])["method"] if at else "-"
        base = [at[m] for m in ("cacheblend", "epic") if m in at]
        below = (
            f"{lower_count(at['relay'], base)}/{at['relay']['n_relays']}"
            if "relay" in at and base
            else "-"
        )
        lines.append(f"| {t:.2f} | " + " | ".join(cells) + f" | {best} | {below} |")
    return "\n".join(lines)


def workload_markdown(result: dict[str, Any]) -> str:
    spans = result["span_tokens_range"]
    return (
        f"### {result['workload']} ({result['n_relays']} relays, spans {spans[0]}-{spans[1]} "
        f"tokens, mean {result['span_tokens_mean']:.0f})\n\n"
        + comparison_table(result["points"])
        + "\n\nRelay vs the best baseline per measure (paired bootstrap over the relays):\n\n"
        + verdict_table(result["points"])
        + "\n\nAll points (bootstrap 95 % intervals):\n\n"
        + points_table(result["points"])
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """KL (mean: solid, median: dashed) vs measured reuse, one curve per method, one panel
    per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(results), figsize=(5.6 * len(results), 4.4), squeeze=False, sharey=True
    )
    for ax, res in zip(axes[0], results, strict=True):
        for method in SWEPT:
            rows = sorted(
                (r for r in res["points"] if r["method"] == method), key=lambda r: r["reuse_rate"]
            )
            if not rows:
                continue
            x = [r["reuse_rate"] for r in rows]
            style = {"color": STYLE[method], "marker": "o" if method != "naive" else "s"}
            ax.plot(x, [r["first_token_kl"] for r in rows], label=f"{method} (mean)", **style)
            ax.plot(
                x,
                [r["first_token_kl_median"] for r in rows],
                linestyle="--",
                alpha=0.6,
                markersize=3,
                label=f"{method} (median)",
                **{**style, "marker": "."},
            )
        ax.set_yscale("log")
        ax.set_xlabel("reuse (token-layer, pooled)")
        ax.set_title(f"{res['workload']} ({res['n_relays']} relays)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("first-token KL vs exact prefill (nats)")
    axes[0][0].legend(fontsize=7, ncol=2, loc="upper left")
    fig.suptitle(f"Fidelity-reuse frontier ({results[0]['model']}, fp32, reference executor)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
