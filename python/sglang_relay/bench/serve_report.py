"""What ``bench serve`` reports from its rows: TTFT tails that say how many requests stand
behind them, goodput at each SLO, the summary over seeds with bootstrap intervals, the plot.

A run's p99 is only reported from :data:`P99_MIN_REQUESTS` requests (below that it is the
worst one or two requests); goodput is then read from the p90, and the tables say which.
Over several seeds per rate, each method's TTFT is pooled over the seeds and set against
the baseline's as a ratio (baseline / method) with a 95 % bootstrap interval that
resamples whole chains within each seed, so a claim like "lower tail" holds only where the
interval excludes 1.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_relay.bench.intervals import LEVEL, RESAMPLES, SEED

P99_MIN_REQUESTS = 100


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-100) by linear interpolation; None without values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    if pos == lo or xs[hi] == xs[lo]:  # no interpolation (and none toward an infinite miss)
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tail(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 (None under :data:`P99_MIN_REQUESTS` values), max."""
    enough = len(values) >= P99_MIN_REQUESTS
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99) if enough else None,
        "max": max(values) if values else None,
    }


def tail_key(rows: list[dict[str, Any]]) -> str:
    """``ttft_p99`` where every row has one, else ``ttft_p90``."""
    return "ttft_p99" if all(r.get("ttft_p99") is not None for r in rows) else "ttft_p90"


def goodput(rows: list[dict[str, Any]], slo_s: float, key: str = "ttft_p99") -> float:
    """The highest arrival rate (chains/min) whose ``key`` meets ``slo_s``, counting only
    rates below the first one that misses it (a rate past saturation that happens to pass
    does not count); 0 if the lowest rate misses."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r["rate"]):
        value = row.get(key)
        if value is None or value > slo_s or row.get("incomplete", 0):
            break
        best = row["rate"]
    return best


def goodput_curve(
    rows: list[dict[str, Any]], slos: list[float], key: str = "ttft_p99"
) -> dict[str, list[float]]:
    """Per method, :func:`goodput` at each SLO of ``slos``."""
    methods = dict.fromkeys(r["method"] for r in rows)
    return {
        m: [goodput([r for r in rows if r["method"] == m], s, key) for s in slos] for m in methods
    }


@dataclass
class Record:
    """One request of a chain as the client saw it."""

    chain: int
    kind: str
    agent: int
    could_relay: bool
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    relay: dict[str, Any] = field(default_factory=dict)
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (decode speed as this request saw it);
        ``output_tokens`` is what the server generated (an early stop ends it sooner)."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ChainRun:
    """One arrived chain of a run: when it arrived (s from the run's start), its kind, how
    many requests it makes, those that finished (as they finished), its latency if it
    finished, and whether it was waiting for a tool when the run ended (its later turns
    had not arrived yet)."""

    start: float
    kind: str
    planned: int
    records: list[Record] = field(default_factory=list)
    latency: float | None = None
    pausing: bool = False

    def slots(self) -> list[float]:
        """TTFT per request that arrived, at its agent's place: ``inf`` for one that did
        not finish in the run, or was not sent because the chain was stuck; the turns
        after a tool pause the run's end cut are left out."""
        done = {r.agent: r.ttft_s for r in self.records}
        arrived = max(done, default=-1) + 1 if self.pausing else self.planned
        return [done.get(i, math.inf) for i in range(arrived)]


def _finite(x: float | None) -> float | None:
    """None for a tail beyond the run (an infinite, censored value): JSON has no inf."""
    return None if x is None or math.isinf(x) else x


def summarize(
    method: str,
    rate: float,
    chains: list[ChainRun],
    errors: list[str],
    arrived: int,
    incomplete: int,
    elapsed_s: float,
) -> dict[str, Any]:
    """One row of the report. TTFT over the requests that finished (``ttft_*``) and over
    every request of every arrived chain (``ttft_all_*``), where a request that never
    finished inside the run (or was never sent: its chain was stuck) is censored, counted
    as a miss of any SLO (``censored``; ``None`` where the tail is such a miss)."""
    chains = sorted(chains, key=lambda c: c.start)
    finished = [c for c in chains if c.latency is not None]
    records = [r for c in chains for r in sorted(c.records, key=lambda r: r.agent)]
    ttft = [r.ttft_s for r in records]
    down = [r.ttft_s for r in records if r.could_relay]
    latency = [c.latency for c in finished if c.latency is not None]
    tpot = [t for r in records if (t := r.tpot_s) is not None]
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for c in finished:
        by_kind[c.kind].append(c.latency or 0.0)
    every = [c.slots() for c in chains]
    prompt = sum(r.prompt_tokens for r in records)
    relayed = sum(int(r.relay.get("reused_tokens", 0)) for r in records)
    fallbacks = collections.Counter(
        str(r.relay["fallback"]).split(":")[0] for r in records if r.relay.get("fallback")
    )
    return {
        "method": method,
        "rate": rate,
        "arrived": arrived,
        "completed": len(finished),
        "incomplete": incomplete,
        "censored": sum(t == math.inf for c in every for t in c),
        "pending_tool": sum(c.planned - len(e) for c, e in zip(chains, every, strict=True)),
        "errors": len(errors),
        "error_samples": errors[:3],
        "chains_per_min": 60.0 * len(finished) / elapsed_s if elapsed_s > 0 else 0.0,
        **{f"ttft_{k}": v for k, v in tail(ttft).items()},
        **{f"ttft_all_{k}": _finite(v) for k, v in tail([t for c in every for t in c]).items()},
        **{f"ttft_relayable_{k}": v for k, v in tail(down).items()},
        **{f"chain_latency_{k}": v for k, v in tail(latency).items()},
        "chain_latency_p50_by_kind": {k: percentile(v, 50) for k, v in sorted(by_kind.items())},
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "requests": len(records),
        "chain_ttfts": [[round(r.ttft_s, 4) for r in c.records] for c in finished],
        "chain_ttfts_all": [[None if t == math.inf else round(t, 4) for t in c] for c in every],
        "relayed_prompt_share": relayed / prompt if prompt else 0.0,
        "fallbacks": dict(fallbacks),
        "reuse_rate_mean": statistics.fmean(
            [float(r.relay.get("reuse_rate", 0.0)) for r in records if r.relay.get("spans_matched")]
            or [0.0]
        ),
    }


def _ratio_ci(
    base: list[list[list[float]]],
    other: list[list[list[float]]],
    q: float,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """``q``-quantile TTFT of ``base`` over that of ``other`` (each: per seed, per chain,
    its requests' TTFTs, pooled over seeds) and its percentile-bootstrap interval, chains
    resampled with replacement within each seed."""

    def pooled(runs: list[list[list[float]]], rng: np.random.Generator | None) -> float:
        values: list[float] = []
        for chains in runs:
            picks = range(len(chains)) if rng is None else rng.integers(0, len(chains), len(chains))
            for i in picks:
                values.extend(chains[i])
        return float(np.percentile(values, q))

    rng = np.random.default_rng(seed)
    point = pooled(base, None) / pooled(other, None)
    boot = [pooled(base, rng) / pooled(other, rng) for _ in range(resamples)]
    lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return point, float(lo), float(hi)


def seeded(
    rows: list[dict[str, Any]], slos: list[float], baseline: str = "standard"
) -> dict[str, Any]:
    """Over the seeds of each rate: per method, the TTFT pooled over seeds (p50 / p90 /
    p99 from :data:`P99_MIN_REQUESTS`), the arrival rate achieved, and the TTFT ratio
    ``baseline / method`` at p50 and p90 with intervals; per seed, each method's goodput
    at each SLO (read from :func:`tail_key`)."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by[(r["method"], r["rate"])].append(r)
    out: dict[str, Any] = {"points": [], "goodput_per_seed": {}, "baseline": baseline}
    for (method, rate), runs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ttfts = [t for r in runs for chain in r["chain_ttfts"] for t in chain]
        point = {
            "method": method,
            "rate": rate,
            "seeds": len(runs),
            "arrived_per_min": [round(r["arrived_per_min"], 2) for r in runs],
            "requests": len(ttfts),
            "ttft": tail(ttfts),
            "incomplete": sum(r.get("incomplete", 0) for r in runs),
            "errors": sum(r["errors"] for r in runs),
        }
        base = by.get((baseline, rate))
        if base is not None and method != baseline:
            for q in (50, 90):
                point[f"ttft_p{q}_ratio"] = _ratio_ci(
                    [r["chain_ttfts"] for r in base], [r["chain_ttfts"] for r in runs], q
                )
        out["points"].append(point)
    key = tail_key(rows)
    out["goodput_key"] = key
    for s in sorted({r.get("seed", 0) for r in rows}):
        mine = [r for r in rows if r.get("seed", 0) == s]
        out["goodput_per_seed"][str(s)] = goodput_curve(mine, slos, key)
    return out


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict[str, Any]], slos: list[float]) -> str:
    key = tail_key(rows)
    lines = [
        "| method | seed | rate offered / arrived (chains/min) | completed/min | requests "
        "| TTFT p50 / p90 / p99 (s) | relayable TTFT p90 | chain latency p50 (s) | TPOT p50 (ms) "
        "| relayed prompt share | fallbacks | pool peak | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tpot = r.get("tpot_p50")
        lines.append(
            f"| {r['method']} | {r.get('seed', 0)} | {r['rate']:g} / "
            f"{r.get('arrived_per_min', r['rate']):.1f} | {r['chains_per_min']:.1f} | "
            f"{r.get('requests', '-')} | {_f(r['ttft_p50'])} / {_f(r.get('ttft_p90'))} / "
            f"{_f(r['ttft_p99'])} | {_f(r.get('ttft_relayable_p90'))} | "
            f"{_f(r['chain_latency_p50'])} | {'-' if tpot is None else f'{1000 * tpot:.0f}'} | "
            f"{r['relayed_prompt_share']:.2f} | {r['fallbacks'] or '-'} | "
            f"{_f(r.get('pool_peak_share'))} | {r['errors']} |"
        )
    seeds = sorted({r.get("seed", 0) for r in rows})
    label = key.replace("ttft_", "")
    lines += ["", f"goodput (chains/min offered) at each {label} TTFT SLO"
              + (f", per seed ({len(seeds)})" if len(seeds) > 1 else ""), "",
              "| method | seed | " + " | ".join(f"<= {s:g} s" for s in slos) + " |",
              "|---|---" + "|---" * len(slos) + "|"]  # fmt: skip
    for s in seeds:
        mine = [r for r in rows if r.get("seed", 0) == s]
        for m, curve in goodput_curve(mine, slos, key).items():
            lines.append(f"| {m} | {s} | " + " | ".join(f"{g:g}" for g in curve) + " |")
    if len(seeds) > 1:
        lines += ["", seeded_markdown(seeded(rows, slos))]
    return "\n".join(lines)


def seeded_markdown(summary: dict[str, Any]) -> str:
    base = summary["baseline"]
    lines = [
        f"| method | rate | seeds | arrived/min per seed | requests | TTFT p50 / p90 / p99 (s), "
        f"pooled | {base} / method TTFT p50 [95 % CI] | p90 [95 % CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ratio(p: dict[str, Any], q: int) -> str:
        r = p.get(f"ttft_p{q}_ratio")
        return "-" if r is None else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"

    for p in summary["points"]:
        t = p["ttft"]
        lines.append(
            f"| {p['method']} | {p['rate']:g} | {p['seeds']} | {p['arrived_per_min']} | "
            f"{p['requests']} | {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | "
            f"{ratio(p, 50)} | {ratio(p, 90)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Three panels: goodput vs TTFT SLO per method (a step curve, :func:`tail_key`), the
    TTFT tail vs offered rate, and chain latency p50 (solid) / max (dashed) vs offered rate.
    Several seeds: the first seed's rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = min((r.get("seed", 0) for r in rows), default=0)
    rows = [r for r in rows if r.get("seed", 0) == first]
    key = tail_key(rows)
    worst = max((r[key] for r in rows if r.get(key) is not None), default=4.0)
    top = max(8.0, 1.25 * worst)
    slos = [round(top * i / 100, 3) for i in range(1, 101)]  # up to past the worst tail
    curves = goodput_curve(rows, slos, key)
    label = key.replace("ttft_", "")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (method, curve) in enumerate(curves.items()):
        color = f"C{i}"
        axes[0].step(slos, curve, where="post", label=method, color=color)
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["rate"])
        rates = [r["rate"] for r in mine]
        axes[1].plot(rates, [r[key] for r in mine], "o-", label=method, color=color)
        axes[2].plot(rates, [r["chain_latency_p50"] for r in mine], "o-", color=color,
                     label=f"{method} p50")  # fmt: skip
        worst = [r.get("chain_latency_max", r.get("chain_latency_p99")) for r in mine]
        axes[2].plot(rates, worst, "s--", color=color, label=f"{method} max")
    axes[0].set(xlabel=f"SLO: {label} TTFT (s)", ylabel="goodput (chains/min offered)",
                title="Goodput vs SLO")  # fmt: skip
    axes[1].set(xlabel="offered rate (chains/min)", ylabel=f"{label} TTFT (s)", title="TTFT tail")
    axes[2].set(xlabel="offered rate (chains/min)", ylabel="chain latency (s)",
                title="Chain latency")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
