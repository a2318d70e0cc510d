"""Relay against CacheBlend and EPIC under load, per (rate, seed) of a ``bench serve`` file
whose runs hold relay's phase times (``SGLANG_RELAY_PHASE_TIMES=1``) and the host's CPU
steal (``host``): the layer loop's time per relay extend, the run's steal and its p90 TTFT
over all arrivals, and relay's layer time over CacheBlend's per pair of runs.

    python research/studies/capacity_phases.py docs/bench/capacity_2026-12-06.json

Only the time is compared: the methods' reuse differs (relay's default point, CacheBlend
and EPIC keep slightly different shares of the span; the file's ``reuse_rate_mean``)."""

from __future__ import annotations

import json
import statistics
import sys

METHODS = ("relay", "cacheblend", "epic")
QUIET = 0.01  # a run whose steal share stayed under this counts as quiet


def pairs(rows: list[dict]) -> dict[tuple[float, int], dict[str, tuple[float, float, float]]]:
    out: dict[tuple[float, int], dict[str, tuple[float, float, float]]] = {}
    for r in rows:
        ph, host = r.get("phases"), r.get("host") or {}
        if not ph or r["method"] not in METHODS or not ph.get("layers_n"):
            continue
        per_extend = ph["layers_ms"] / ph["layers_n"]
        steal = host.get("steal_share", float("nan"))
        out.setdefault((r["rate"], r.get("seed", 0)), {})[r["method"]] = (
            per_extend, steal, r["ttft_all_p90"])  # fmt: skip
    return out


def main(path: str) -> None:
    rows = json.load(open(path))["rows"]
    print("| offered rate | seed | method | layer loop ms per extend | steal % | p90 TTFT s |")
    print("|---|---|---|---|---|---|")
    ratios, quiet = [], []
    for (rate, seed), got in sorted(pairs(rows).items()):
        for m in METHODS:
            if m in got:
                ms, steal, p90 = got[m]
                print(f"| {rate:g} | {seed} | {m} | {ms:.0f} | {100 * steal:.1f} | {p90:.2f} |")
        if "relay" in got and "cacheblend" in got:
            x = got["relay"][0] / got["cacheblend"][0]
            ratios.append(x)
            if all(got[m][1] < QUIET for m in ("relay", "cacheblend")):  # nan: not quiet
                quiet.append(x)
    if ratios:
        print(f"\nrelay / CacheBlend layer ms per extend, {len(ratios)} pairs: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}; "
              f"at or below 1 in {sum(x <= 1 for x in ratios)}")  # fmt: skip
    if quiet:
        print(f"pairs with both runs' steal under {100 * QUIET:.0f} %: {len(quiet)}, "
              f"median {statistics.median(quiet):.2f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
