"""Capacity an operator can plan on, from ``bench serve`` runs over several rates and seeds.

Every TTFT here is over *all* arrivals: a request that did not finish inside its run, or
was never sent because its chain was stuck behind one that did not, is censored and
misses any SLO (``chain_ttfts_all``, ``None`` at the agent's place). (A tool loop's turn
still waiting for its tool when the run ended has not arrived yet: it is not counted.)
A rate is labelled by the rate its arrivals achieved (mean over seeds), not the one
offered.

A rate **meets** an SLO when at least 90 % of its arrivals, pooled over its seeds, have a
TTFT within it (attainment; the p90 read as a nearest rank, so one censored request in ten
does not fail a rate that 90 % of requests met). **Goodput** at an SLO is the highest
achieved rate that meets it, counting only rates below the first offered rate that does
not. Its 95 % interval is a percentile bootstrap that resamples, within each (rate, seed),
blocks of :data:`BLOCK` consecutive chains in arrival order (chains that arrive together
share the server's load, so single chains are not independent), circularly; every
method is resampled with the same blocks (a seed gives every method the same arrivals and
chains), so the ratio method / baseline has a paired interval. Goodput only takes the
tested rates' values: its interval says which tested rates keep meeting the SLO when the
chains are resampled, not a continuous band; where the highest rate tested meets the SLO,
goodput is only known to be at least that (">=", and a ratio of two such is no ratio); a
ratio 0 / 0 has no value and is left out of its interval (the tables count such
resamples).
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

import numpy as np

from sglang_relay.bench.intervals import LEVEL, RESAMPLES, SEED
from sglang_relay.bench.serve_report import percentile

ATTAINMENT = 0.9  # the share of arrivals within the SLO a rate must reach
BLOCK = 5  # chains per resampled block, in arrival order

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


def _chains(run: dict[str, Any]) -> list[np.ndarray]:
    return [np.array([math.inf if t is None else t for t in c], dtype=float)
            for c in run["chain_ttfts_all"]]  # fmt: skip


def _values(runs: list[dict[str, Any]]) -> np.ndarray:
    parts = [v for run in runs for v in _chains(run)]
    return np.concatenate(parts) if parts else np.empty(0)


def achieved(runs: list[dict[str, Any]]) -> float:
    """The arrival rate (chains/min) the seeds' runs achieved, their mean."""
    return float(np.mean([r["arrived_per_min"] for r in runs]))


def block_picks(n: int, rng: np.random.Generator, block: int = BLOCK) -> np.ndarray:
    """``n`` chain indices: circular blocks of ``block`` consecutive chains from random
    starts (a moving-block bootstrap in arrival order)."""
    if n == 0:
        return np.empty(0, dtype=np.int64)
    b = max(1, min(block, n))
    starts = rng.integers(0, n, (n + b - 1) // b)
    return ((starts[:, None] + np.arange(b)[None, :]) % n).reshape(-1)[:n]


class Curve:
    """One method's runs of one workload as per-chain counts: for each (rate, seed), each
    chain's requests and how many of them met each SLO, so a resample's attainment is two
    sums."""

    def __init__(self, per_rate: Runs, slos: list[float]) -> None:
        self.rates = sorted(per_rate)
        self.achieved = [achieved(per_rate[r]) for r in self.rates]
        self.keys: list[list[tuple[float, int]]] = []
        self.n: dict[tuple[float, int], np.ndarray] = {}
        self.met: dict[tuple[float, int], np.ndarray] = {}
        for rate in self.rates:
            keys = []
            for run in per_rate[rate]:
                key = (rate, int(run.get("seed", 0)))
                chains = _chains(run)
                self.n[key] = np.array([len(c) for c in chains], dtype=float)
                self.met[key] = np.array([[float((c <= s).sum()) for s in slos] for c in chains],
                                         dtype=float).reshape(len(chains), len(slos))  # fmt: skip
                keys.append(key)
            self.keys.append(keys)

    def chains(self) -> dict[tuple[float, int], int]:
        return {k: len(v) for k, v in self.n.items()}

    def attainment(self, picks: dict[tuple[float, int], np.ndarray] | None = None) -> np.ndarray:
        """``[rates, slos]`` share of arrivals within each SLO (chains resampled by
        ``picks``, keyed by (rate, seed))."""
        out = []
        for keys in self.keys:
            n = sum(float(self.n[k][picks[k]].sum() if picks else self.n[k].sum()) for k in keys)
            met = sum((self.met[k][picks[k]] if picks else self.met[k]).sum(axis=0) for k in keys)
            out.append(met / n if n else np.zeros_like(met))
        return np.array(out)

    def goodput(self, share: np.ndarray) -> np.ndarray:
        """Per SLO, the highest achieved rate meeting it before the first rate that does
        not (``share``: :meth:`attainment`)."""
        best = np.zeros(share.shape[1])
        alive = np.ones(share.shape[1], dtype=bool)
        for i, rate in enumerate(self.achieved):
            alive &= share[i] >= ATTAINMENT
            best = np.where(alive, np.maximum(best, rate), best)
        return best


def goodput_table(
    rows: list[dict[str, Any]],
    slos: list[float],
    baseline: str = "standard",
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> list[dict[str, Any]]:
    """Per workload, SLO and method: goodput with its interval, and goodput / the
    baseline's with a paired interval (``inf`` where only the baseline's is 0)."""
    out = []
    rng = np.random.default_rng(seed)
    for workload, methods in by_workload(rows).items():
        curves = {m: Curve(pr, slos) for m, pr in methods.items()}
        shape: dict[tuple[float, int], int] = {}
        for m, c in curves.items():
            for key, n in c.chains().items():
                if shape.setdefault(key, n) != n:
                    raise ValueError(
                        f"{workload}: rate {key[0]:g}, seed {key[1]}: {m} has {n} "
                        f"chains, another method {shape[key]}: not the same runs"
                    )
        point = {m: c.goodput(c.attainment()) for m, c in curves.items()}
        boot = {m: np.empty((resamples, len(slos))) for m in curves}
        for b in range(resamples):
            picks = {key: block_picks(n, rng) for key, n in shape.items()}
            for m, c in curves.items():
                boot[m][b] = c.goodput(c.attainment(picks))
        for j, slo in enumerate(slos):
            for m in curves:
                row = {
                    "workload": workload,
                    "slo_s": slo,
                    "method": m,
                    "goodput": float(point[m][j]),
                    "interval": _interval(boot[m][:, j]),
                    "at_top": bool(point[m][j] >= curves[m].achieved[-1] > 0),
                }
                if baseline in curves and m != baseline:
                    ratios = _ratios(boot[m][:, j], boot[baseline][:, j])
                    defined = ratios[~np.isnan(ratios)]
                    row["ratio"] = (
                        float(_ratios(point[m][j : j + 1], point[baseline][j : j + 1])[0]),
                        *(_interval(defined) if defined.size else (math.nan,) * 2),
                    )
                    row["ratio_undefined"] = int(resamples - defined.size)
                out.append(row)  # fmt: skip
    return out


def _ratios(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.where(a > 0, np.inf, np.nan))


def _interval(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(
        np.asarray(values, dtype=float), [(1 - LEVEL) / 2, (1 + LEVEL) / 2], method="inverted_cdf"
    )  # an element, never a blend with inf
    return float(lo), float(hi)


def points(rows: list[dict[str, Any]], q: float = 90) -> list[dict[str, Any]]:
    """Per workload, method and rate: the achieved rate, chains, requests, censored
    requests, the tool turns the runs' ends cut (``cut``: still waiting for their tool, not
    arrived, not counted), the p50 / ``q`` TTFT over all arrivals pooled over seeds, and
    the median over seeds of each run's median time per output token (``tpot``, finished
    requests)."""
    out = []
    for workload, methods in by_workload(rows).items():
        for method, per_rate in methods.items():
            for rate, runs in sorted(per_rate.items()):
                values = _values(runs).tolist()
                tpots = [r["tpot_p50"] for r in runs if r.get("tpot_p50") is not None]
                out.append({
                    "workload": workload, "method": method, "offered": rate,
                    "achieved": achieved(runs), "seeds": len(runs),
                    "chains": sum(len(r["chain_ttfts_all"]) for r in runs),
                    "requests": len(values), "censored": sum(math.isinf(v) for v in values),
                    "cut": sum(int(r.get("pending_tool") or 0) for r in runs),
                    "p50": percentile(values, 50), f"p{q:g}": percentile(values, q),
                    "wall_s": sum(r.get("wall_s", 0.0) for r in runs),
                    "tpot": statistics.median(tpots) if tpots else None,
                })  # fmt: skip
    return out


def with_cut_as_misses(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each run's tool turns cut by its end (``pending_tool``) counted as
    arrivals that missed every SLO (appended to its last chain: no point estimate depends
    on which chain holds them)."""
    out = []
    for r in rows:
        cut, chains = int(r.get("pending_tool") or 0), r.get("chain_ttfts_all")
        if cut and chains:
            r = {**r, "chain_ttfts_all": [*chains[:-1], [*chains[-1], *[None] * cut]]}
        out.append(r)
    return out


def cut_sensitivity(rows: list[dict[str, Any]], slos: list[float]) -> str:
    """One sentence: whether counting the cut tool turns as misses would change a goodput
    (point estimates) or by how much it moves a pooled p90; empty if no run cut one."""
    cut = sum(int(r.get("pending_tool") or 0) for r in rows if "chain_ttfts_all" in r)
    if not cut:
        return ""
    worst = with_cut_as_misses(rows)
    changed = []
    for workload, methods in by_workload(rows).items():
        other = by_workload(worst)[workload]
        for method, per_rate in methods.items():
            a, b = Curve(per_rate, slos), Curve(other[method], slos)
            for slo, x, y in zip(slos, a.goodput(a.attainment()), b.goodput(b.attainment()),
                                 strict=True):  # fmt: skip
                if x != y:
                    changed.append(f"{workload} {method} at {slo:g} s ({x:.1f} -> {y:.1f})")
    shift = max(
        (q["p90"] - p["p90"] for p, q in zip(points(rows), points(worst), strict=True)
         if math.isfinite(q["p90"]) and math.isfinite(p["p90"])),
        default=0.0,
    )  # fmt: skip
    verdict = ("changes the goodput of " + ", ".join(changed)) if changed else "changes no goodput"
    return (
        f"Counting the {cut} tool turns cut by the runs' ends as misses (never sent, "
        f"their TTFT unknown) {verdict} (point estimates); it moves a pooled p90 by at most "
        f"{shift:.2f} s."
    )


def _s(x: float | None) -> str:
    if x is None or math.isinf(x):
        return "miss" if x is None or x > 0 else "-"
    if math.isnan(x):
        return "-"
    return f"{x:.2f}"


def _r(x: float) -> str:
    return "inf" if math.isinf(x) else _s(x)


def bound(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """How to read ``row``'s ratio to ``base`` (two :func:`goodput_table` rows of one SLO):
    ``">= "`` when ``row``'s goodput is at the highest rate tested (only a lower bound),
    ``"<= "`` when only the baseline's is, else ``""``."""
    if row["at_top"]:
        return ">= "
    return "<= " if base is not None and base["at_top"] else ""


def markdown(rows: list[dict[str, Any]], slos: list[float], baseline: str = "standard") -> str:
    """The TTFT-vs-achieved-rate table and the goodput table of ``rows``."""
    pts = points(rows)
    cut = any(p["cut"] for p in pts)  # a column only where a run's end cut a tool turn
    lines = ["| workload | method | offered / achieved (chains/min) | seeds | chains | requests "
             "| censored | " + ("tool turns cut by the end | " if cut else "")
             + "TTFT p50 / p90, all arrivals (s) "
             "| time per output token (ms): runs' p50, median of seeds |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if cut else "")]  # fmt: skip
    for p in pts:
        tpot = "-" if p["tpot"] is None else f"{1000 * p['tpot']:.0f}"
        lines.append(
            f"| {p['workload']} | {p['method']} | {p['offered']:g} / {p['achieved']:.1f} | "
            f"{p['seeds']} | {p['chains']} | {p['requests']} | {p['censored']} | "
            + (f"{p['cut']} | " if cut else "")
            + f"{_s(p['p50'])} / {_s(p['p90'])} | {tpot} |"
        )
    note = cut_sensitivity(rows, slos)
    lines += ["", note] if note else []
    head = " | ".join(f"TTFT <= {s:g} s: goodput [95 % CI]; / {baseline} [95 % CI]" for s in slos)
    lines += ["", f"| workload | method | {head} |", "|---|---|" + "---|" * len(slos)]
    table = goodput_table(rows, slos, baseline)
    for workload, method in dict.fromkeys((t["workload"], t["method"]) for t in table):
        cells = []
        for t in (t for t in table if (t["workload"], t["method"]) == (workload, method)):
            top = ">= " if t["at_top"] else ""  # the highest rate tested met it
            cell = f"{top}{t['goodput']:.1f} [{t['interval'][0]:.1f}, {t['interval'][1]:.1f}]"
            base = next((b for b in table if (b["workload"], b["method"], b["slo_s"])
                         == (workload, baseline, t["slo_s"])), None)  # fmt: skip
            if "ratio" in t and t["at_top"] and base is not None and base["at_top"]:
                cell += "; both >= the highest rate tested, no ratio"
            elif "ratio" in t and math.isinf(t["ratio"][0]):
                cell += f"; {baseline} none at the lowest rate tested"
            elif "ratio" in t:
                r = t["ratio"]
                cell += f"; {bound(t, base)}{_r(r[0])} [{_r(r[1])}, {_r(r[2])}]"
                if t["ratio_undefined"]:
                    cell += f" ({t['ratio_undefined']} resamples 0 / 0)"
            cells.append(cell)
        lines.append(f"| {workload} | {method} | " + " | ".join(cells) + " |")
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
