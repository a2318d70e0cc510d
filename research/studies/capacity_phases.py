"""Relay against CacheBlend and EPIC under load, per (rate, seed) of a ``bench serve`` file
whose runs hold relay's phase times (``SGLANG_RELAY_PHASE_TIMES=1``) and the host's CPU
steal (``host``): the layer loop's time per relay extend, the run's steal and its p90 TTFT
over all arrivals, and relay's layer time over CacheBlend's per pair of runs (a workload,
a rate and a seed), summarized per workload.

    python research/studies/capacity_phases.py docs/bench/capacity_2026-12-06.json

Only the time is compared: the methods' reuse differs (relay's default point, CacheBlend
and EPIC keep slightly different shares of the span; the file's ``reuse_rate_mean``)."""

from __future__ import annotations

import json
import statistics
import sys

METHODS = ("relay", "cacheblend", "epic")
QUIET = 0.01  # a run whose steal share stayed under this counts as quiet


Key = tuple[str, float, int]  # workload, offered rate, seed


def pairs(rows: list[dict]) -> dict[Key, dict[str, tuple[float, float, float]]]:
    out: dict[Key, dict[str, tuple[float, float, float]]] = {}
    for r in rows:
        ph, host = r.get("phases"), r.get("host") or {}
        if not ph or r["method"] not in METHODS or not ph.get("layers_n"):
            continue
        per_extend = ph["layers_ms"] / ph["layers_n"]
        steal = host.get("steal_share", float("nan"))
        key = (r.get("workload") or "mix", r["rate"], r.get("seed", 0))
        out.setdefault(key, {})[r["method"]] = (
            per_extend, steal, r["ttft_all_p90"])  # fmt: skip
    return out


def main(path: str) -> None:
    rows = json.load(open(path))["rows"]
    print("| workload | offered rate | seed | method | layer loop ms per extend | steal % "
          "| p90 TTFT s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {}
    quiet: dict[str, list[float]] = {}
    for (workload, rate, seed), got in sorted(pairs(rows).items()):
        for m in METHODS:
            if m in got:
                ms, steal, p90 = got[m]
                p90_s = "miss" if p90 is None else f"{p90:.2f}"  # None: over a tenth censored
                print(f"| {workload} | {rate:g} | {seed} | {m} | {ms:.0f} | {100 * steal:.1f} "
                      f"| {p90_s} |")  # fmt: skip
        if "relay" in got and "cacheblend" in got:
            x = got["relay"][0] / got["cacheblend"][0]
            ratios.setdefault(workload, []).append(x)
            if all(got[m][1] < QUIET for m in ("relay", "cacheblend")):  # nan: not quiet
                quiet.setdefault(workload, []).append(x)
    for workload, xs in ratios.items():
        print(f"\n{workload}: relay / CacheBlend layer ms per extend, {len(xs)} pairs: "
              f"{', '.join(f'{x:.2f}' for x in xs)}; median {statistics.median(xs):.2f}; "
              f"at or below 1 in {sum(x <= 1 for x in xs)}")  # fmt: skip
        if quiet.get(workload):
            q = quiet[workload]
            print(f"{workload}: pairs with both runs' steal under {100 * QUIET:.0f} %: "
                  f"{len(q)}, median {statistics.median(q):.2f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
