"""The serving tables of docs/results.md, from the committed ``bench serve`` and
``bench decode`` runs: agent chains under load (each run's rows, the goodput per SLO, the
seeded fan-out with its intervals) and plain decode on a relay server."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_relay.bench.docs_data import load, md_table


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pair(a: float | None, b: float | None) -> str:
    return f"{_s(a)} / {_s(b)}"


Column = tuple[str, Callable[[dict[str, Any]], str]]
OFFERED: Column = (
    "chains/min offered / done",
    lambda r: f"{r['rate']:g} / {r['chains_per_min']:.1f}",
)
TTFT: Column = ("TTFT p50 / p99 (s)", lambda r: _pair(r["ttft_p50"], r["ttft_p99"]))
RELAYABLE: Column = (
    "relayable TTFT p50 / p99 (s)",
    lambda r: _pair(r["ttft_relayable_p50"], r["ttft_relayable_p99"]),
)
LATENCY: Column = (
    "chain latency p50 / p99 (s)",
    lambda r: _pair(r["chain_latency_p50"], r["chain_latency_p99"]),
)
TPOT: Column = (
    "TPOT p50 (ms)",
    lambda r: "-" if r.get("tpot_p50") is None else f"{1000 * r['tpot_p50']:.0f}",
)
RELAYED: Column = ("prompt tokens relayed", lambda r: f"{r['relayed_prompt_share']:.2f}")
POOL: Column = ("KV pool peak", lambda r: f"{100 * r['pool_peak_share']:.0f} %")
DONE: Column = ("chains done / arrived", lambda r: f"{r['completed']} / {r['arrived']}")
REUSE: Column = (
    "reuse",
    lambda r: f"{r['reuse_rate_mean']:.2f}" if r["relayed_prompt_share"] else "-",
)
RELEASED: Column = (
    "owned spans released for room (tokens)",
    lambda r: (
        f"{r['server']['owned_spans_released_for_room']} "
        f"({r['server']['owned_tokens_released_for_room']:,})"
        if r["relayed_prompt_share"]
        else "-"
    ),
)
FALLBACKS: Column = ("fallbacks", lambda r: str(sum(r["fallbacks"].values())))
REQUESTS: Column = ("requests", lambda r: str(r["requests"]))

FANOUT_RUN = "docs/bench/serve_fanout.json"
SERVE_TABLES: dict[str, tuple[str, tuple[Column, ...]]] = {
    "serve-first": (
        "docs/bench/serve.json",
        (
            OFFERED,
            TTFT,
            RELAYABLE,
            ("chain latency p50 (s)", lambda r: _s(r["chain_latency_p50"])),
            RELAYED,
            REUSE,
            REQUESTS,
        ),
    ),  # fmt: skip
    "serve-answers16": (
        "docs/bench/serve_answers16.json",
        (OFFERED, TTFT, RELAYABLE, LATENCY, RELAYED, DONE, REQUESTS),
    ),
    "serve-fanout": (
        FANOUT_RUN,
        (OFFERED, TTFT, LATENCY, TPOT, RELAYED, POOL, REQUESTS),
    ),
    "serve-pressure": (
        "docs/bench/serve_pressure3072.json",
        (
            ("chains/min", lambda r: f"{r['chains_per_min']:.2f}"),
            TTFT,
            RELAYABLE,
            LATENCY,
            RELAYED,
            REUSE,
            RELEASED,
            FALLBACKS,
            REQUESTS,
        ),
    ),  # fmt: skip
}


def _rows(root: Path, rel: str) -> list[dict[str, Any]]:
    data = load(root, rel)
    return data["rows"] if isinstance(data, dict) else data


def serve_table(root: Path, name: str) -> str:
    """One ``bench serve`` run: a row per (rate, method), the columns of ``name``."""
    rel, cols = SERVE_TABLES[name]
    body = [[r["method"]] + [f(r) for _, f in cols] for r in _rows(root, rel)]
    return md_table(["method"] + [h for h, _ in cols], body)


def goodput_table(root: Path, rel: str, slos: tuple[float, ...]) -> str:
    """Goodput (the highest offered rate whose TTFT tail meets the SLO) per method."""
    from sglang_relay.bench.serve_report import goodput_curve, tail_key

    rows = _rows(root, rel)
    key = tail_key(rows)
    head = ["method"] + [f"goodput @ {key[5:]} TTFT <= {s:g} s" if i == 0 else f"{s:g} s"
                         for i, s in enumerate(slos)]  # fmt: skip
    curves = goodput_curve(rows, list(slos), key)
    return md_table(head, [[m] + [f"{g:g}" for g in c] for m, c in curves.items()])


def fanout_goodput(root: Path) -> str:
    return goodput_table(root, FANOUT_RUN, (1, 1.5, 2, 3, 4, 6))


@functools.cache
def seeded_summary(root: Path, rel: str = "docs/bench/serve_fanout_seeds.json") -> dict[str, Any]:
    """:func:`~sglang_relay.bench.serve_report.seeded` of a seeded run (its bootstrap takes
    seconds: computed once per process)."""
    from sglang_relay.bench.serve_report import seeded

    data = load(root, rel)
    slos = [float(s) for s in data["args"]["slos"].split(",")]
    return seeded(data["rows"], slos)


def fanout_seeds_table(root: Path, rel: str = "docs/bench/serve_fanout_seeds.json") -> str:
    """The fan-out with seeds: TTFT pooled over seeds, standard / relay at p50 and p90 with
    bootstrap intervals over chains, chains finished."""
    rows = _rows(root, rel)
    summary = seeded_summary(root, rel)
    head = ["rate offered", "arrived per seed (chains/min)", "method", "seeds", "requests",
            "TTFT p50 / p90 / p99, seeds pooled (s)", "standard / relay TTFT p50 [95 % CI]",
            "p90 [95 % CI]", "chains finished (of arrived)"]  # fmt: skip
    body = []
    for p in summary["points"]:
        t = p["ttft"]
        mine = [r for r in rows if r["method"] == p["method"] and r["rate"] == p["rate"]]
        ratio = [p.get(f"ttft_p{q}_ratio") for q in (50, 90)]
        body.append([
            f"{p['rate']:g}", ", ".join(f"{a:g}" for a in p["arrived_per_min"]), p["method"],
            str(p["seeds"]), str(p["requests"]),
            f"{_s(t['p50'])} / {_s(t['p90'])} / {_s(t['p99'])}",
            *("" if r is None else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]" for r in ratio),
            f"{sum(r['completed'] for r in mine)} of {sum(r['arrived'] for r in mine)}",
        ])  # fmt: skip
    return md_table(head, body)


def fanout_seeds_goodput(root: Path, rel: str = "docs/bench/serve_fanout_seeds.json") -> str:
    summary = seeded_summary(root, rel)
    per_seed = summary["goodput_per_seed"]
    slos = [float(s) for s in load(root, rel)["args"]["slos"].split(",")]
    methods = list(next(iter(per_seed.values())))
    head = [f"SLO ({summary['goodput_key'][5:]} TTFT)"] + [
        f"{m}, seeds " + " / ".join(per_seed) for m in methods
    ]
    body = [
        [f"<= {s:g} s"] + [" / ".join(f"{per_seed[k][m][i]:g}" for k in per_seed) for m in methods]
        for i, s in enumerate(slos)
    ]
    return md_table(head, body)


def decode_table(root: Path, rel: str = "docs/bench/decode_pairs.json") -> str:
    """Plain decode, relay server over ``--no-relay`` server: rate and server CPU per token,
    geometric means of paired ratios with the two-stage bootstrap interval."""
    head = ["batch", "plain tok/s", "relay tok/s", "relay / plain rate [95 %]",
            "server CPU ms/token plain, relay", "relay / plain CPU [95 %]",
            "server pairs x rounds"]  # fmt: skip
    body = []
    for r in load(root, rel):
        lo, hi = r["relay_over_plain_ci"]
        clo, chi = r["relay_over_plain_cpu_ci"]
        body.append([
            str(r["batch"]), f"{r['plain_tokens_per_s']:.1f}", f"{r['relay_tokens_per_s']:.1f}",
            f"{r['relay_over_plain']:.3f} [{lo:.3f}, {hi:.3f}]",
            f"{r['plain_cpu_ms_per_token']:.2f}, {r['relay_cpu_ms_per_token']:.2f}",
            f"{r['relay_over_plain_cpu']:.3f} [{clo:.3f}, {chi:.3f}]",
            f"{r['server_pairs']} x {r['rounds']}",
        ])  # fmt: skip
    return md_table(head, body)


# the capacity runs: the fan-out and the deep chain on the default server; tool loops mixed
# with fan-outs on a server of their own (a bound pool and a HiCache host tier: server
# flags, so a file of their own)
CAPACITY_RUN = "docs/bench/capacity_2026-12-06.json"
TOOLLOOP_RUN = "docs/bench/capacity_toolloop_2026-12-07.json"
CAPACITY_RUNS = (CAPACITY_RUN, TOOLLOOP_RUN)
# the tool loop's mix again, relay only, with a span budget and host tier too small to hold
# its spans through the pauses: what the retention counters show under pressure
RETENTION_TIGHT = "docs/bench/retention_tight_2026-12-07.json"


def capacity_tables(root: Path, rel: str = CAPACITY_RUN) -> str:
    """The capacity run (``bench serve --chains ... --seeds ...``): p50 / p90 TTFT over all
    arrivals (censored ones as misses) per workload, method and achieved rate, then goodput
    at each SLO with bootstrap intervals and the ratio to standard."""
    from sglang_relay.bench import capacity

    data = load(root, rel)
    slos = [float(s) for s in data["args"]["slos"].split(",")]
    minutes = sum(r["wall_s"] for r in data["rows"]) / 60
    took = f"{len(data['rows'])} runs, {minutes:.0f} minutes of runs (`wall_s`)."
    # rows before 2026-12-07 did not record the host
    steal = [r.get("host", {}).get("steal_share") for r in data["rows"]]
    steal = [x for x in steal if x is not None]
    if steal:
        took += (
            f" CPU steal by the hypervisor, recorded in {len(steal)} of them: median "
            f"{100 * statistics.median(steal):.1f} %, highest {100 * max(steal):.1f} %."
        )
    return capacity.markdown(data["rows"], slos) + "\n\n" + took


def retention_table(root: Path, rel: str = TOOLLOOP_RUN) -> str:
    """Where a run's recorded spans went (``bench serve`` rows' server counters over the
    run): recorded, pushed off the device for room, copied to the host tier and back, and
    the prompts that pasted an output whose span was gone from both (``span_evicted``).
    Host copies freed are the TTL's and the full tier's; a copy dropped with its span (the
    store's own bound) has no counter of its own."""
    rows = _rows(root, rel)

    def count(r: dict[str, Any], *keys: str) -> str:
        return str(sum(int(r["server"].get(k, 0)) for k in keys))

    def declined(r: dict[str, Any]) -> str:  # a copy there that could not come back
        keys = [k for k in r["server"] if k.startswith("host_restores_declined_")]
        return count(r, *keys, "host_restore_errors")

    def evicted(r: dict[str, Any]) -> str:  # host copies freed: TTL / room (by priority)
        host = {k: v for k, v in r["server"].items() if k.startswith("host_evicted_")}
        ttl = host.pop("host_evicted_ttl", 0)
        return f"{ttl} / {sum(host.values())}"

    head = ["method", "seed", "offered / achieved", "KV pool peak", "spans recorded",
            "owned spans peak (tokens)", "owned spans released for room (tokens)",
            "host copies / restores", "restores missed (no copy) / declined or failed",
            "host copies freed: TTL / room", "fallback span_evicted", "fallbacks, all reasons",
            "prompt tokens relayed"]  # fmt: skip
    body = []
    for r in rows:
        relays = r["method"] != "standard"
        body.append([
            r["method"], str(r.get("seed", 0)), f"{r['rate']:g} / {r['arrived_per_min']:.1f}",
            POOL[1](r), count(r, "recorded_spans"),
            f"{int(r.get('owned_span_tokens_peak') or 0):,}" if relays else "-",
            RELEASED[1](r) if relays else "-",
            f"{count(r, 'host_backups')} / {count(r, 'host_restores')}" if relays else "-",
            f"{count(r, 'host_restores_missed_no_copy')} / {declined(r)}" if relays else "-",
            evicted(r) if relays else "-", count(r, "fallback_span_evicted"),
            count(r, "fallbacks"), RELAYED[1](r),
        ])  # fmt: skip
    return md_table(head, body)
