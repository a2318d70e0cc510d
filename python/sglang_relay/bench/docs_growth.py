"""The growth tables of docs/results.md ("Cost as the context grows"), from the committed
``bench ttft --phases`` runs over relayed contexts of 256 tokens to 16K
(``benchmark/growth_workload*.jsonl``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from sglang_relay.bench.docs_data import load, md_table, reps
from sglang_relay.bench.intervals import bootstrap_ci

# 256 to 8K tokens (rerun 2026-12-07, after the blocked CPU attention; the run before it:
# growth_2026-12-06.json), and 16K (2026-12-06)
GROWTH_RUNS = ("docs/bench/growth_2026-12-07.json", "docs/bench/growth_16k_2026-12-06.json")
POINTS = ("relay@0.80", "relay@0.90", "relay@0.95")
PHASES = ("match", "plan_batch", "prepare", "probe", "layers")


def _rows(root: Path) -> list[dict[str, Any]]:
    """Every run's rows, each with ``run``: the date in its file's name (the runs differ in
    code and machine state; the TTFT table says which row comes from which)."""
    out = []
    for rel in GROWTH_RUNS:
        if (root / rel).exists():
            day = Path(rel).stem.rsplit("_", 1)[-1]
            out += [{**r, "run": day} for r in load(root, rel)]
    return out


def _by(rows: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        table.setdefault(r["span_tokens"], {})[r["method"]] = r
    return dict(sorted(table.items()))


def ttft_table(root: Path) -> str:
    """TTFT per relayed length: standard, the limit, CacheBlend, relay's three points with
    TTFT / compute-proportional ideal."""
    head = ["relayed tokens", "prompt", "standard s", "naive (limit) s", "CacheBlend s (reuse)"]
    head += [f"{p.split('@')[1]} s (/ ideal)" for p in POINTS] + ["reps", "run"]
    body = []
    for span, m in _by(_rows(root)).items():
        std, naive, cb = m.get("standard"), m.get("naive"), m.get("cacheblend")
        if std is None or naive is None:
            continue
        blend = "-" if cb is None else f"{cb['ttft_median_s']:.2f} ({cb['reuse_rate']:.2f})"
        cells = [f"{span:,}", f"{std['prompt_tokens']:,}", f"{std['ttft_median_s']:.2f}",
                 f"{naive['ttft_median_s']:.2f}", blend]  # fmt: skip
        for p in POINTS:
            r = m.get(p)
            cells.append("-" if r is None else f"{r['ttft_median_s']:.2f} ({r['over_ideal']:.2f})")
        body.append(cells + [reps([std, naive, cb, *(m.get(p) for p in POINTS)]), std["run"]])
    return md_table(head, body)


def phases_table(root: Path) -> str:
    """Relay's own time per phase (ms, medians) at each length, the default point 0.80 and
    the probing 0.95, against the whole TTFT."""
    head = ["relayed tokens", "point", "TTFT ms", *(f"{p} ms" for p in PHASES), "rest ms"]
    body = []
    for span, m in _by(_rows(root)).items():
        for p in ("relay@0.80", "relay@0.95"):
            r = m.get(p)
            if r is None:
                continue
            ph = r.get("phases_ms", {})
            ttft = 1000 * r["ttft_median_s"]
            rest = ttft - sum(ph.get(k, 0.0) for k in PHASES)
            body.append([f"{span:,}", p.split("@")[1], f"{ttft:.0f}",
                         *(f"{ph.get(k, 0.0):.0f}" for k in PHASES), f"{rest:.0f}"])  # fmt: skip
    return md_table(head, body)


def _span(vals: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo}-{hi}"


def shares_table(root: Path) -> str:
    """What the bullets below the growth tables read, per relayed length: each method's
    reuse, relay's TTFT over CacheBlend's at each point, relay's bookkeeping and splice as a
    share of its TTFT (range over the three points), the probe's cost, the limit's own loop
    (rows it runs: the prompt's not reused), and the stock prefix hit's TTFT."""
    head = ["relayed tokens", "reuse: naive / CacheBlend / 0.80",
            "relay / CacheBlend TTFT: 0.80 / 0.90 / 0.95", "match + plan_batch % of TTFT",
            "prepare % of TTFT", "probe ms (% of TTFT): 0.90 / 0.95",
            "naive: loop ms, rows run, % of standard TTFT", "stock prefix hit s"]  # fmt: skip
    body = []
    for span, m in _by(_rows(root)).items():
        need = ("standard", "naive", "cacheblend", "stock_prefix_hit", *POINTS)
        if any(k not in m for k in need):
            continue
        std, naive, cb = m["standard"], m["naive"], m["cacheblend"]
        ttft = {p: 1000 * m[p]["ttft_median_s"] for p in POINTS}
        ph = {p: m[p].get("phases_ms", {}) for p in POINTS}
        probes = [f"{ph[p]['probe']:.0f} ({100 * ph[p]['probe'] / ttft[p]:.0f} %)"
                  if "probe" in ph[p] else "-" for p in POINTS[1:]]  # fmt: skip
        loop = naive.get("phases_ms", {}).get("layers", 0.0)
        body.append([
            f"{span:,}",
            " / ".join(f"{r['reuse_rate']:.2f}" for r in (naive, cb, m[POINTS[0]])),
            " / ".join(f"{m[p]['ttft_median_s'] / cb['ttft_median_s']:.2f}" for p in POINTS),
            _span([100 * (ph[p].get("match", 0.0) + ph[p].get("plan_batch", 0.0)) / ttft[p]
                   for p in POINTS], "{:.1f}"),
            _span([100 * ph[p].get("prepare", 0.0) / ttft[p] for p in POINTS]),
            " / ".join(probes),
            f"{loop:.0f}, {naive['prompt_tokens'] - int(naive['reused_tokens']):,}, "
            f"{100 * loop / (1000 * std['ttft_median_s']):.0f} %",
            f"{m['stock_prefix_hit']['ttft_median_s']:.2f}",
        ])  # fmt: skip
    return md_table(head, body)


SHORT_SPAN = "research/studies/data/short_span_2026-12-06/short_span_cost.json"


def profile_table(root: Path) -> str:
    """Where relay's layer loop spends its time at short spans (one py-spy profile of the
    scheduler: share of the samples in the relay extend's loop and the probe's, by kind of
    work) and what a layer's matrix products cost a row at each row count (the embedded
    model's shapes), from ``research/studies/short_span_cost.py``'s data file."""
    data = load(root, SHORT_SPAN)
    extend, probe = data["pyspy"]["extend"], data["pyspy"]["probe"]
    kinds = [k for k in extend if k != "samples"]
    body = [[k, f"{100 * extend[k]:.0f}", f"{100 * probe.get(k, 0.0):.0f}"] for k in kinds]
    body.append(["samples", f"{extend['samples']:,}", f"{probe['samples']:,}"])
    shares = md_table(["work", "extend % of samples", "probe % of samples"], body)
    head = ["rows", "one layer's products ms", "us a row", "30 layers ms"]
    rows = [[f"{r['rows']:,}", f"{r['layer_ms']:.2f}", f"{r['us_per_row']:.0f}",
             f"{r['stack_ms_30_layers']:.1f}"] for r in data["linear_rows"]]  # fmt: skip
    return shares + "\n\n" + md_table(head, rows) + f"\n\n({data['threads']} threads)"


AB_BLOCKS = "research/studies/data/cpu_attention_blocks_2026-12-07/ab_512.json"


def ab_table(root: Path) -> str:
    """An interleaved A/B of two servers (``research/studies/ab_servers.py --json``): per
    measure the medians, the per-round after / before ratio with its bootstrap interval and
    the rounds the change won (decode is tokens/s: higher wins), then relay over its ideal
    ``naive + 0.2 (standard - naive)`` from each side's medians."""
    samples = load(root, AB_BLOCKS)["samples"]
    med = {key: statistics.median(v) for key, v in samples.items()}
    body = []
    for m in dict.fromkeys(key.rsplit(" ", 1)[0] for key in samples):
        a, b = samples[f"{m} A"], samples[f"{m} B"]
        r = [y / x for x, y in zip(a, b, strict=True)]
        lo, hi = bootstrap_ci(r, "median")
        won = sum((x > 1) if m == "decode" else (x < 1) for x in r)
        ratio = f"{statistics.median(r):.3f} [{lo:.3f}, {hi:.3f}]"
        body.append([m, f"{med[f'{m} A']:.3f}", f"{med[f'{m} B']:.3f}", ratio, f"{won} / {len(r)}"])
    ideal = [
        med[f"relay {s}"] / (med[f"naive {s}"] + 0.2 * (med[f"standard {s}"] - med[f"naive {s}"]))
        for s in "AB"
    ]
    body.append(["relay / ideal (medians)", f"{ideal[0]:.2f}", f"{ideal[1]:.2f}", "-", "-"])
    head = ["measure (s; decode tokens/s)", "before", "after", "after / before per round",
            "rounds the change won"]  # fmt: skip
    return md_table(head, body)


DECODE_RUNS = (
    "research/studies/data/decode_batch_2026-12-07/decode_batch.json",
    "research/studies/data/decode_batch_2026-12-07/decode_batch_64.json",
)


def decode_batch_table(root: Path) -> str:
    """``research/studies/decode_batch.py`` runs: per run and batch, the time per output
    token of a ``--no-relay`` and a relay server (medians over rounds) and relay's over
    no-relay's per round with its interval; then where the py-spy samples of one batch of
    the largest size fell (decode forwards, prefills, and within decode forwards)."""
    body, spy = [], []
    for rel in DECODE_RUNS:
        data = load(root, rel)
        tokens, rounds = data["args"]["tokens"], data["args"]["rounds"]
        for r in data["rows"]:
            mid, lo, hi = r["relay_over_no_relay"]
            body.append([str(tokens), str(rounds), str(r["batch"]),
                         f"{statistics.median(r['no_relay_tpot_s']):.3f}",
                         f"{statistics.median(r['relay_tpot_s']):.3f}",
                         f"{mid:.2f} [{lo:.2f}, {hi:.2f}]"])  # fmt: skip
        shares = data["pyspy_shares"]
        total = sum(shares.values())
        decode = {k.split(": ", 1)[1]: n for k, n in shares.items() if k.startswith("decode: ")}
        d = sum(decode.values())
        relay = sum(n for k, n in shares.items() if ": relay" in k)
        prefill = sum(n for k, n in shares.items() if k.startswith("prefill: "))
        where = f"{100 * d / total:.0f} / {100 * prefill / total:.0f}"
        spy.append([str(tokens), f"{total:,}", where,
                    *(f"{100 * decode.get(c, 0) / d:.0f}" for c in
                      ("attention (SGLang torch_native)", "linear", "logits")),
                    str(relay)])  # fmt: skip
    head = ["tokens decoded", "rounds", "batch", "no-relay s / token", "relay s / token",
            "relay / no-relay per round"]  # fmt: skip
    head2 = ["tokens decoded", "samples", "% in decode / prefill forwards",
             "decode: SGLang attention %", "decode: products %", "decode: LM head %",
             "samples in relay's own work"]  # fmt: skip
    return md_table(head, body) + "\n\n" + md_table(head2, spy)


ATTENTION_TIMING = (
    "research/studies/data/cpu_attention_blocks_2026-12-07/blocked_attention_timing.json"
)


def attention_timing_table(root: Path) -> str:
    """``research/studies/blocked_attention_timing.py``: one layer's CPU extend attention of
    ``rows`` spread over ``context`` tokens, one mask over the whole context (before) and in
    blocks (after), against a causal kernel's share for the same rows."""
    data = load(root, ATTENTION_TIMING)
    body = [[f"{r['context']:,}", str(r["rows"]), str(r["blocks"]), f"{r['whole_ms']:.2f}",
             f"{r['blocks_ms']:.2f}", f"{r['causal_share_ms']:.2f}",
             f"{r['whole_ms'] / r['causal_share_ms']:.1f}"] for r in data["rows"]]  # fmt: skip
    head = ["context", "rows", "blocks", "one mask ms", "blocks ms", "causal share ms",
            "one mask / causal"]  # fmt: skip
    return md_table(head, body) + f"\n\n({data['meta']['threads']} threads, medians of 15 calls)"
