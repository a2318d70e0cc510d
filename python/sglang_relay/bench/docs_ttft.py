"""The TTFT tables of docs/results.md, from the committed ``bench ttft`` runs
(:mod:`sglang_relay.bench.docs_data` says how a run's configuration is read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sglang_relay.bench.docs_data import (
    default_point,
    fx,
    label_point,
    last_commit,
    load,
    md_table,
    profile_points,
    reps,
)

BASELINES = {"epic": "EPIC (first 16)", "cacheblend": "CacheBlend (0.15)"}


def _keys(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The (span tokens, agents) rows of a run, in the run's order."""
    seen: list[tuple[int, int]] = []
    for r in rows:
        key = (r["span_tokens"], r["n_agents"])
        if key not in seen:
            seen.append(key)
    return seen


def _at(rows: list[dict[str, Any]], method: str, key: tuple[int, int]) -> dict[str, Any] | None:
    for r in rows:
        if r["method"] == method and (r["span_tokens"], r["n_agents"]) == key:
            return r
    return None


def quick_table(root: Path, rel: str = "docs/ttft_quick.json") -> str:
    """``bench ttft --quick``: every shape, relay against standard, the limit and stock."""
    rows = load(root, rel)
    head = ["span tokens", "agents", "prompt", "standard s", "relay s", "reuse",
            "relay speedup", "relay / limit", "relay / stock hit", "cacheblend speedup",
            "epic speedup", "reps"]  # fmt: skip
    body = []
    for key in _keys(rows):
        std, relay = _at(rows, "standard", key), _at(rows, "relay", key)
        stock = _at(rows, "stock_prefix_hit", key)
        if std is None or relay is None:
            continue
        cells = [str(key[0]), str(key[1]), str(relay["prompt_tokens"]),
                 f"{std['ttft_median_s']:.3f}", f"{relay['ttft_median_s']:.3f}",
                 f"{relay['reuse_rate']:.2f}", fx(relay["speedup_vs_standard"]),
                 f"{relay['ratio_to_prefix_hit_limit']:.2f}",
                 "-" if stock is None
                 else f"{relay['ttft_median_s'] / stock['ttft_median_s']:.2f}"]  # fmt: skip
        for m in ("cacheblend", "epic"):
            r = _at(rows, m, key)
            cells.append("-" if r is None else fx(r["speedup_vs_standard"]))
        used = [std, relay, stock] + [_at(rows, m, key) for m in ("cacheblend", "epic")]
        body.append(cells + [reps(used)])
    return md_table(head, body)


def _columns(root: Path, runs: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[str, str]]:
    """(header, method label) of every method the runs hold: relay's points in order, each
    point's ``:noprobe`` twin after it, then EPIC, CacheBlend and the limit (naive). A point
    is marked ``(probe)`` when the profile committed with the run probes it."""
    default = default_point(root)
    labels = {r["method"] for _, rows in runs for r in rows}
    probed: set[float] = set()
    for rel, _ in runs:
        configs = profile_points(root, last_commit(root, rel)[1])
        probed |= {t for t, c in configs.items() if c.get("probe") is not None}
    points = sorted({p for p in (label_point(x, default) for x in labels) if p is not None})
    cols = []
    for p in points:
        label = "relay" if p == default else f"relay@{p:.2f}"
        if label not in labels:
            label = f"relay@{p:g}"
        name = f"relay {p:.2f}" + (" (default)" if p == default else "")
        cols.append((name + (" (probe)" if p in probed else ""), label))
        twin = next((x for x in labels if x.startswith("relay@") and x.endswith(":noprobe")
                     and label_point(x.partition(":")[0], default) == p), None)  # fmt: skip
        if twin is not None:
            cols.append((f"{p:.2f} without its probe", twin))
    cols += [(name, m) for m, name in BASELINES.items() if m in labels]
    return cols + [("limit (naive)", "naive")]


def speedup_table(root: Path, rels: list[str], suffixes: list[str] | None = None) -> str:
    """Speedup vs the same run's standard prefill of every method of one or more runs, one
    row per (span, agents) of each run; EPIC's and CacheBlend's measured reuse in brackets."""
    runs = [(rel, load(root, rel)) for rel in rels]
    suffixes = suffixes or [""] * len(rels)
    cols = _columns(root, runs)
    head = ["span tokens", "agents", "standard s"] + [c for c, _ in cols] + ["reps"]
    body = []
    for (_, rows), suffix in zip(runs, suffixes, strict=True):
        for key in _keys(rows):
            std = _at(rows, "standard", key)
            if std is None:
                continue
            cells, used = [f"{key[0]}{suffix}", str(key[1]), f"{std['ttft_median_s']:.3f}"], [std]
            for _, label in cols:
                r = _at(rows, label, key)
                used.append(r)
                if r is None:
                    cells.append("-")
                elif label in BASELINES:
                    cells.append(f"{fx(r['speedup_vs_standard'])} ({r['reuse_rate']:.2f})")
                else:
                    cells.append(fx(r["speedup_vs_standard"]))
            body.append(cells + [reps(used)])
    return md_table(head, body)


POINTS_RUNS = ("docs/bench/ttft_points.json", "docs/bench/ttft_long.json")


def points_table(root: Path) -> str:
    return speedup_table(root, list(POINTS_RUNS), ["", " (long run)"])


def probe_table(root: Path) -> str:
    return speedup_table(root, ["docs/bench/ttft_probe.json"])


def low_points_table(root: Path) -> str:
    return speedup_table(root, ["docs/bench/ttft_low_points.json"])


def target_line(root: Path, target: float = 3.0) -> str:
    """The runtime issue's TTFT target (speedup >= 3 at >= 1K relayed tokens, reuse >= 0.80)
    against every committed run of the shipped default point."""
    from sglang_relay.bench.docs_data import point_label, spread, ttft_runs

    default = default_point(root)
    label = point_label(default, default)
    runs = [r for r in ttft_runs(root) if default in r.shipped]
    parts = []
    for span in (1024, 2048):
        got = [r.row(label, span) for r in runs]
        vals = [g["speedup_vs_standard"] for g in got if g is not None]
        if vals:
            below = sum(v < target for v in vals)
            parts.append(
                f"at {span:,} tokens {spread(vals, unit='x')} over {len(vals)} runs"
                + (f", below {target:g}x in {below}" if below else "")
            )
    higher = [
        r.row(point_label(p, default), span)
        for r in ttft_runs(root)
        for p in r.shipped
        if p > default
        for span in (1024, 2048)
    ]
    low = min(h["speedup_vs_standard"] for h in higher if h is not None)
    short = any("below" in p for p in parts)
    return (
        f"* speedup vs standard >= {target:g} for relayed spans >= 1K tokens at reuse >= "
        f"{default:.2f}: **{'met in some runs, not all' if short else 'met'}** at {default:.2f} "
        f"(every committed run of the shipped point: {'; '.join(parts)}); the shipped points "
        f"above it give at least {fx(low)} at 1K and 2K in every committed run."
    )
