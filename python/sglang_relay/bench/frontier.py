"""``sglang-relay bench fidelity --frontier``: the fidelity-reuse frontier of every method.

One operating point per method hides the trade-off a user makes (EVALUATION.md: "a method
is better only if its curve is lower at equal reuse"), so this sweeps each method's budget
knob and measures every point on the same relays with the same offline reference executor
as ``bench fidelity`` (:func:`~sglang_relay.bench.evaluation.evaluate_relay`: one exact
prefill per relay, then one relay prefill per point, 64 teacher-forced tokens).

Knobs (the rest of each method's config is what ``bench fidelity`` runs,
:func:`~sglang_relay.bench.fidelity.method_configs`):

* ``naive``: no knob, one point (reuse 1).
* ``cacheblend``: ``top_ratio``, the share of span tokens recomputed in layers 1..L-1.
* ``epic``: ``first_k``, the first tokens of each span recomputed in every layer.
* ``relay``: the operating point a server runs for the target (``--relay-reuse``,
  :mod:`sglang_relay.core.operating`): the profile's frontier point for it (the profiled
  deviation rule, or the position-only first-k rule where that measured better on the
  calibration relays), each capped per span by ``max_ratio``; without a frontier in the
  profile, the profile's rule with its cap solved for the target. Where a rule selects
  fewer tokens than the cap, the measured reuse is above the target.

Each knob is set for a list of reuse targets by inverting METHOD.md's token-layer reuse,
``reuse = 1 - (|S| * dense + |I| * sparse) / (|S| * L)``: for ``top_ratio`` and
``max_ratio`` the largest share that keeps the target
(:func:`sglang_relay.core.operating.reuse_cap`, as the profiler sets relay's cap), for
``first_k`` the nearest whole number of tokens at the workload's mean span length.
Targets a method cannot reach (CacheBlend's dense layer 0 alone costs 1/L) are left out;
knob values that repeat are run once. Points of different methods that share a target sit
at about equal reuse, which is what the side-by-side table compares. The measured reuse
(pooled over the relays) is what the tables and the plot show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from sglang_relay.bench.evaluation import (
    FRONTIER_WORKLOADS,
    QUICK_FRONTIER_RELAYS,
    evaluate_relay,
    machine_info,
    method_configs,
    prepare_usable,
    summarize,
)
from sglang_relay.bench.frontier_report import SWEPT, plot, workload_markdown
from sglang_relay.bench.workload import (
    Case,
    GenSettings,
    load_relay,
    load_workload,
)
from sglang_relay.core.config import RelayConfig, load_profile
from sglang_relay.core.operating import Frontier, reuse_cap

KNOBS = {"cacheblend": "top_ratio", "epic": "first_k", "relay": "max_ratio"}


@dataclass(frozen=True)
class Point:
    """One point of a method's sweep: ``config`` has ``knob`` set to ``value`` for ``target``
    reuse (``knob`` ``None``: the method has no budget knob)."""

    method: str
    knob: str | None
    value: float | int | None
    target: float | None
    config: RelayConfig

    @property
    def label(self) -> str:
        return self.method if self.target is None else f"{self.method}@{self.target:.2f}"


def parse_targets(text: str) -> list[float]:
    """``"0.7,0.8"`` -> sorted unique reuse targets, each in (0, 1)."""
    try:
        values = sorted({float(t) for t in text.split(",") if t.strip()})
    except ValueError as exc:
        raise ValueError(f"reuse targets must be numbers: {text!r}") from exc
    if not values or not all(0.0 < t < 1.0 for t in values):
        raise ValueError(f"reuse targets must be in (0, 1); got {text!r}")
    return values


def knob_value(cfg: RelayConfig, num_layers: int, target: float, mean_span: float):
    """The knob of ``cfg.method`` set for ``target`` reuse, or ``None`` if out of reach."""
    knob = KNOBS[cfg.method]
    if knob == "first_k":
        # EPIC recomputes k tokens per span in every layer of its schedule
        sched = cfg.schedule(num_layers)
        share = (num_layers * (1.0 - target) - sched.dense_layers) / sched.sparse_layers
        k = round(share * mean_span)
        return k if k >= 1 else None
    return reuse_cap(cfg, num_layers, target)


def sweep_points(
    relay_cfg: RelayConfig,
    num_layers: int,
    mean_span: float,
    targets: list[float],
    methods: tuple[str, ...] | list[str] = SWEPT,
    frontier: Frontier | None = None,
) -> list[Point]:
    """Every method's points, in ``methods`` order, targets ascending; unreachable targets
    and repeated knob values dropped. Relay's point for a target is the operating point a
    server maps that target to (``frontier``: the profile's; without one, the profile's
    rule with its cap solved for the target)."""
    base = method_configs(relay_cfg, [m for m in methods if m in SWEPT])
    points: list[Point] = []
    for method in methods:
        if method == "naive":
            points.append(Point("naive", None, None, None, base["naive"]))
            continue
        if method not in KNOBS:
            raise ValueError(f"no frontier for method {method!r}; choose from {SWEPT}")
        seen: set[Any] = set()
        for target in sorted(targets):
            if method == "relay":
                try:
                    cfg = (frontier or Frontier()).point(base["relay"], target, num_layers).config
                except ValueError:  # out of reach for the rule
                    continue
                if cfg not in seen:
                    seen.add(cfg)
                    points.append(Point(method, "max_ratio", cfg.max_ratio, target, cfg))
                continue
            value = knob_value(base[method], num_layers, target, mean_span)
            if value is None or value in seen:
                continue
            seen.add(value)
            cfg = replace(base[method], **{KNOBS[method]: value})
            points.append(Point(method, KNOBS[method], value, target, cfg))
    return points


def evaluate_points(
    ref: Any,
    relays: Any,
    points: list[Point],
    progress: Any = None,
    stop_ids: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Summary rows (:func:`~sglang_relay.bench.evaluation.summarize`) of every point over
    ``relays`` (an iterable of :class:`~sglang_relay.bench.workload.RelayCase`, consumed
    once), each with its ``per_relay`` rows."""
    configs = {p.label: p.config for p in points}
    per_point: dict[str, list[dict[str, Any]]] = {p.label: [] for p in points}
    for relay in relays:
        for label, row in evaluate_relay(ref, relay, configs, stop_ids).items():
            per_point[label].append(row)
        if progress is not None:
            progress()
    rows = []
    for p in points:
        row = summarize(p.label, per_point[p.label], ref.num_layers)
        row.update(
            method=p.method,
            label=p.label,
            knob=p.knob,
            value=p.value,
            target=p.target,
            config=p.config.to_dict(),
            per_relay=per_point[p.label],
        )
        rows.append(row)
    return rows


def resolve_workloads(spec: str | None) -> list[tuple[str, list[Case]]]:
    """``(label, cases)`` per comma-separated item: a JSONL file, or a packaged name."""
    items = [s.strip() for s in (spec or ",".join(FRONTIER_WORKLOADS)).split(",") if s.strip()]
    out = []
    for item in items:
        if Path(item).is_file():
            out.append((Path(item).name, load_workload(item)))
        elif resources.files("sglang_relay.data").joinpath(item).is_file():
            out.append((item, load_workload(None, name=item)))
        else:
            raise ValueError(f"no workload file or packaged workload named {item!r}")
    return out


def run_frontier(args: argparse.Namespace) -> int:
    """``bench fidelity --frontier`` (arguments from :func:`fidelity.build_parser`)."""
    try:
        targets = parse_targets(args.reuse_targets)
        workloads = resolve_workloads(args.workload)
    except ValueError as exc:
        print(f"bench fidelity --frontier: {exc}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "standard"]
    bad = [m for m in methods if m not in SWEPT]
    if bad or not methods:
        print(f"--frontier sweeps {', '.join(SWEPT)}; got {bad or methods}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from sglang_relay.bench.evaluation import load_bench_model

    started = time.perf_counter()
    model_dir, profile_path, relay_cfg, ref, tok, fingerprint, cache_dir = load_bench_model(args)
    limit = args.n_relays or (QUICK_FRONTIER_RELAYS if args.quick else None)
    gen = GenSettings()

    results = []
    for label, cases in workloads:
        t0 = time.perf_counter()
        usable, skipped = prepare_usable(
            ref, tok, cases, limit, cache_dir, fingerprint, gen, progress=not args.no_progress
        )
        for case, reason in skipped:
            print(f"{label}: skipped {case.id}: {reason}", file=sys.stderr)
        if not usable:
            print(f"{label}: no usable relay case", file=sys.stderr)
            return 1
        spans = []  # span occurrence lengths over the workload, to set EPIC's k
        for case, path in usable:
            spans += [s.length for s in load_relay(path, case).spans]
        mean_span = statistics.fmean(spans)
        try:
            data = load_profile(profile_path)[1] if profile_path else None
            frontier = Frontier.from_profile(data)
            points = sweep_points(
                relay_cfg, ref.num_layers, mean_span, targets, methods, frontier=frontier
            )
        except ValueError as exc:  # e.g. a profile's layer range this model lacks
            print(f"bad method settings: {exc}", file=sys.stderr)
            return 2
        gen_s = time.perf_counter() - t0
        bar = tqdm(
            total=len(usable), desc=f"{label}: {len(points)} points", disable=args.no_progress
        )
        relays = (load_relay(path, case) for case, path in usable)
        rows = evaluate_points(
            ref, relays, points, progress=bar.update, stop_ids=[tok.eos_token_id]
        )
        bar.close()
        per_relay_spans = [r["span_tokens"] for r in rows[0]["per_relay"]]
        results.append(
            {
                "workload": label,
                "model": model_dir.name,
                "n_relays": len(usable),
                "skipped": [c.id for c, _ in skipped],
                "span_occurrence_mean": mean_span,
                "span_tokens_mean": statistics.fmean(per_relay_spans),
                "span_tokens_range": [min(per_relay_spans), max(per_relay_spans)],
                "seconds_generation": gen_s,
                "seconds_evaluation": time.perf_counter() - t0 - gen_s,
                "points": rows,
            }
        )
        print(workload_markdown(results[-1]) + "\n", flush=True)

    total_s = time.perf_counter() - started
    footer = (
        f"Model {model_dir.name} ({ref.num_layers} layers, fp32), relay profile "
        f"{profile_path.name if profile_path else 'none (defaults)'}, targets "
        f"{', '.join(f'{t:.2f}' for t in targets)}; {total_s:.0f} s total, "
        f"{torch.get_num_threads()} torch threads."
    )
    print(footer)
    if args.markdown:
        text = "\n\n".join(workload_markdown(r) for r in results) + "\n\n" + footer + "\n"
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(results, Path(args.plot))
    if args.json:
        meta = {
            "model": str(model_dir),
            "profile": str(profile_path) if profile_path else None,
            "relay_config": relay_cfg.to_dict(),
            "targets": targets,
            "methods": methods,
            "n_relays_limit": limit,
            "quick": bool(args.quick),
            "machine": machine_info(),
            "generation": asdict(gen),
            "seconds_total": total_s,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"run": meta, "workloads": results}, indent=1))
    return 0
