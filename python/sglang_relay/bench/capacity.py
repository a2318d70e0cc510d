"""Capacity an operator can plan on, from ``bench serve`` runs over several rates and seeds.

Every TTFT here is over *all* arrivals: a request that did not finish inside its run, or
was never sent because its chain was stuck, is censored and counts as a miss of any SLO
(``chain_ttfts_all``, ``None`` for a censored request). A rate is labelled by the rate its
arrivals achieved (mean over seeds), not the one offered. **Goodput** at an SLO is the
highest achieved rate whose p90 TTFT over all arrivals, pooled over the seeds, meets the
SLO, counting only rates below the first that misses it. Its 95 % interval is a
percentile bootstrap that resamples chains within each (rate, seed); methods are
resampled with the same chain indices (a seed gives every method the same arrivals and
chains), so the ratio method / baseline has a paired interval too.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from sglang_relay.bench.intervals import LEVEL, RESAMPLES, SEED
from sglang_relay.bench.serve_report import percentile

Runs = dict[float, list[dict[str, Any]]]  # rate -> the rows of its seeds


def by_workload(rows: list[dict[str, Any]]) -> dict[str, dict[str, Runs]]:
    """workload -> method -> rate -> rows (seed order), of rows with censored TTFTs."""
    out: dict[str, dict[str, Runs]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list))
    )
    for r in sorted(rows, key=lambda r: r.get("seed", 0)):
        if "chain_ttfts_all" in r:
            out[r.get("workload") or "mix"][r["method"]][r["rate"]].append(r)
    return out


def _values(runs: list[dict[str, Any]], picks: list[np.ndarray] | None) -> list[float]:
    """The TTFTs of ``runs``' chains (resampled by ``picks``, one index array per seed),
    censored requests as ``inf``."""
    out: list[float] = []
    for s, run in enumerate(runs):
        chains = run["chain_ttfts_all"]
        for i in range(len(chains)) if picks is None else picks[s]:
            out.extend(math.inf if t is None else t for t in chains[i])
    return out


def achieved(runs: list[dict[str, Any]]) -> float:
    """The arrival rate (chains/min) the seeds' runs achieved, their mean."""
    return float(np.mean([r["arrived_per_min"] for r in runs]))


def tails(
    per_rate: Runs, q: float = 90, picks: dict[float, list[np.ndarray]] | None = None
) -> list[tuple[float, float | None]]:
    """Per rate, ascending: (achieved rate, pooled ``q`` TTFT over all arrivals)."""
    return [(achieved(per_rate[rate]),
             percentile(_values(per_rate[rate], None if picks is None else picks[rate]), q))
            for rate in sorted(per_rate)]  # fmt: skip


def goodput(curve: list[tuple[float, float | None]], slo_s: float) -> float:
    """The highest achieved rate of ``curve`` (:func:`tails`) whose tail meets ``slo_s``,
    before the first rate that misses it; 0 if the lowest misses."""
    best = 0.0
    for rate, value in curve:
        if value is None or value > slo_s:
            break
        best = rate
    return best


def _interval(values: list[float]) -> tuple[float, float]:
    xs = np.sort(np.asarray(values, dtype=float))
    lo = xs[int(np.floor((1 - LEVEL) / 2 * (len(xs) - 1)))]
    hi = xs[int(np.ceil((1 + LEVEL) / 2 * (len(xs) - 1)))]
    return float(lo), float(hi)


def goodput_table(
    rows: list[dict[str, Any]],
    slos: list[float],
    baseline: str = "standard",
    q: float = 90,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> list[dict[str, Any]]:
    """Per workload, SLO and method: goodput with its interval, and goodput / the
    baseline's with a paired interval (``inf`` where the baseline's is 0)."""
    out = []
    rng = np.random.default_rng(seed)
    for workload, methods in by_workload(rows).items():
        rates = sorted({rate for per_rate in methods.values() for rate in per_rate})
        shape = {
            rate: [
                len(r["chain_ttfts_all"])
                for r in next(per_rate[rate] for per_rate in methods.values() if rate in per_rate)
            ]
            for rate in rates
        }
        draws = [{rate: [rng.integers(0, n, n) for n in shape[rate]] for rate in rates}
                 for _ in range(resamples)]  # fmt: skip
        point = {m: tails(pr, q) for m, pr in methods.items()}
        boot = {m: [tails(pr, q, d) for d in draws] for m, pr in methods.items()}
        for slo in slos:
            for m in methods:
                row = {"workload": workload, "slo_s": slo, "method": m,
                       "goodput": goodput(point[m], slo),
                       "interval": _interval([goodput(c, slo) for c in boot[m]])}  # fmt: skip
                if baseline in methods and m != baseline:
                    ratios = [_ratio(goodput(a, slo), goodput(b, slo))
                              for a, b in zip(boot[m], boot[baseline], strict=True)]  # fmt: skip
                    base = goodput(point[baseline], slo)
                    row["ratio"] = (_ratio(row["goodput"], base), *_interval(ratios))
                out.append(row)
    return out


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.inf if a > 0 else 1.0


def points(rows: list[dict[str, Any]], q: float = 90) -> list[dict[str, Any]]:
    """Per workload, method and rate: the achieved rate, chains, requests, censored
    requests and the p50 / ``q`` TTFT over all arrivals pooled over seeds."""
    out = []
    for workload, methods in by_workload(rows).items():
        for method, per_rate in methods.items():
            for rate, runs in sorted(per_rate.items()):
                values = _values(runs, None)
                out.append({
                    "workload": workload, "method": method, "offered": rate,
                    "achieved": achieved(runs), "seeds": len(runs),
                    "chains": sum(len(r["chain_ttfts_all"]) for r in runs),
                    "requests": len(values), "censored": sum(math.isinf(v) for v in values),
                    "p50": percentile(values, 50), f"p{q:g}": percentile(values, q),
                    "wall_s": sum(r.get("wall_s", 0.0) for r in runs),
                })  # fmt: skip
    return out


def _s(x: float | None) -> str:
    if x is None or math.isinf(x):
        return "miss"
    return f"{x:.2f}"


def markdown(rows: list[dict[str, Any]], slos: list[float], baseline: str = "standard") -> str:
    """The TTFT-vs-achieved-rate table and the goodput table of ``rows``."""
    lines = ["| workload | method | offered / achieved (chains/min) | seeds | chains | requests "
             "| censored | TTFT p50 / p90, all arrivals (s) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in points(rows):
        lines.append(
            f"| {p['workload']} | {p['method']} | {p['offered']:g} / {p['achieved']:.1f} | "
            f"{p['seeds']} | {p['chains']} | {p['requests']} | {p['censored']} | "
            f"{_s(p['p50'])} / {_s(p['p90'])} |"
        )
    lines += ["", "| workload | method | " + " | ".join(f"goodput at p90 <= {s:g} s [95 % CI]"
              for s in slos) + f" | / {baseline} at {slos[-1]:g} s [95 % CI] |",
              "|---|---|" + "---|" * (len(slos) + 1)]  # fmt: skip
    table = goodput_table(rows, slos, baseline)
    for workload, method in dict.fromkeys((t["workload"], t["method"]) for t in table):
        mine = [t for t in table if (t["workload"], t["method"]) == (workload, method)]
        cells = [f"{t['goodput']:.1f} [{t['interval'][0]:.1f}, {t['interval'][1]:.1f}]"
                 for t in mine]  # fmt: skip
        r = mine[-1].get("ratio")
        ratio = "-" if r is None else f"{_s(r[0])} [{_s(r[1])}, {_s(r[2])}]"
        lines.append(f"| {workload} | {method} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, slos: list[float]) -> None:
    """One panel per workload: p90 TTFT over all arrivals against the achieved rate, per
    method (a censored tail drawn at the top edge), the SLOs as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(rows)
    workloads = list(dict.fromkeys(p["workload"] for p in pts))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    finite = [p["p90"] for p in pts if p["p90"] is not None and not math.isinf(p["p90"])]
    top = 1.5 * max(finite + slos)
    for ax, w in zip(axes[0], workloads, strict=True):
        mine = [p for p in pts if p["workload"] == w]
        for i, m in enumerate(dict.fromkeys(p["method"] for p in mine)):
            xs = [p for p in mine if p["method"] == m]
            ys = [top if p["p90"] is None or math.isinf(p["p90"]) else p["p90"] for p in xs]
            ax.plot([p["achieved"] for p in xs], ys, "o-", color=f"C{i}", label=m)
        for s in slos:
            ax.axhline(s, color="grey", lw=0.6, ls=":")
        ax.set(title=w, xlabel="achieved rate (chains/min)", ylabel="p90 TTFT, all arrivals (s)",
               yscale="log", ylim=(None, top * 1.1))  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
