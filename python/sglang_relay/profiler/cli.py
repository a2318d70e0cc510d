"""``sglang-relay profile``'s command line: load the calibration relays, run the curves, the
search and the frontier, write ``profile.json`` and ``profile.png`` (or ``--add-frontier``
to an existing profile)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sglang_relay.bench.evaluation import add_cache_and_threads
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference import (
    exact_prefill,
)
from sglang_relay.profiler.curves import mean_curves, relay_curves
from sglang_relay.profiler.rules import (
    FRONTIER_TARGETS,
    QUICK_FRONTIER_TARGETS,
    consistent_base,
    run_frontier,
)
from sglang_relay.profiler.search import KL_TIE, Search, describe, run_search

# the packaged calibration relays: 16 in the evaluation workload's four kinds, then 64 in
# eight list-heavy kinds of their own (the free-running measures' failure modes, loops and
# early ends, need more relays than 16 to show). --quick takes the first 8
CALIBRATION = "calibration_workload.jsonl,calibration_loops_workload.jsonl"


def plot(curves: dict[str, list[float]], search: list[dict[str, Any]], chosen, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    layers = list(range(len(curves["value_cos"])))
    a = ax[0, 0]
    a.plot(layers, curves["value_cos"], "o-", label="value cosine")
    a.plot(layers, curves["key_cos"], "s-", label="key cosine (re-rotated)")
    a.set_xlabel("layer")
    a.set_ylabel("cosine reused vs exact")
    a.set_title("KV similarity, decode vs downstream prefill")
    a.legend()
    a = ax[0, 1]
    a.plot(layers, curves["stream_rel_dev"], "o-", color="C3")
    a.set_xlabel("layer (stream entering it)")
    a.set_ylabel("relative deviation")
    a.set_title("residual stream deviation")
    a = ax[1, 0]
    mid = [i + 0.5 for i in layers[:-1]]
    a.plot(mid, curves["spearman_value"], "o-", label="Spearman, value deviation")
    a.plot(mid, curves["spearman_key"], "s-", label="Spearman, key deviation")
    a.plot(layers, curves["top15_share"], "^-", label="share of deviation in top 15 %")
    a.set_xlabel("layer")
    a.set_ylim(0, 1.02)
    a.set_title("token sparsity and adjacent-layer rank stability")
    a.legend()
    a = ax[1, 1]
    xs = [e["metrics"]["reuse_min"] for e in search]
    ys = [e["metrics"]["first_token_kl"] for e in search]
    a.scatter(xs, ys, c="C0", s=18, label="candidates (calibration)")
    if chosen is not None:
        a.scatter(
            [chosen["metrics"]["reuse_min"]],
            [chosen["metrics"]["first_token_kl"]],
            c="C3",
            s=80,
            marker="*",
            label="chosen",
        )
    a.set_xlabel("reuse (min over relays)")
    a.set_ylabel("first-token KL (mean)")
    a.set_title("search")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-relay profile", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="HF model dir (default: embedded)")
    p.add_argument("--out", default="relay-profile", help="output folder")
    p.add_argument("--quick", action="store_true", help="8 relays, a smaller search")
    p.add_argument(
        "--workload",
        default=None,
        help=f"calibration relays: a comma list of JSONL files or packaged names (default: "
        f"{CALIBRATION})",
    )
    p.add_argument("--n-relays", type=int, default=None, help="calibration relays to use")
    p.add_argument("--min-reuse", type=float, default=0.80, help="reuse constraint")
    p.add_argument(
        "--frontier-targets",
        default=None,
        help="reuse targets of the operating points written into the profile (default "
        f"{','.join(f'{t:.2f}' for t in FRONTIER_TARGETS)}; with --quick "
        f"{','.join(f'{t:.2f}' for t in QUICK_FRONTIER_TARGETS)})",
    )
    p.add_argument(
        "--add-frontier",
        metavar="PROFILE",
        default=None,
        help="only (re)compute the operating points of an existing profile JSON, in place",
    )
    p.add_argument(
        "--head-floors",
        default="",
        help="operating points: also try the context rules with each span's first K tokens "
        "forced, for each K of this comma list (default none: measured in docs/fidelity.md, "
        "a calibration-only gain)",
    )
    add_cache_and_threads(p)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 < args.min_reuse < 1.0:
        print("--min-reuse must be in (0, 1)", file=sys.stderr)
        return 2
    default = QUICK_FRONTIER_TARGETS if args.quick else FRONTIER_TARGETS
    spec = args.frontier_targets or ",".join(str(t) for t in default)
    try:
        targets = sorted({float(t) for t in spec.split(",") if t.strip()})
    except ValueError:
        targets = []
    if not targets or not all(0 < t < 1 for t in targets):
        print("--frontier-targets must be numbers in (0, 1)", file=sys.stderr)
        return 2
    try:
        args.head_floors = tuple(int(k) for k in args.head_floors.split(",") if k.strip())
    except ValueError:
        args.head_floors = (0,)
    if not all(k > 0 for k in args.head_floors):
        print("--head-floors must be positive integers", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sglang_relay.bench.evaluation import default_cache_dir
    from sglang_relay.bench.frontier import resolve_workloads
    from sglang_relay.bench.workload import (
        GenSettings,
        load_relay,
        model_fingerprint,
        prepare_relays,
    )
    from sglang_relay.core.reference import load_model
    from sglang_relay.embedded_model import ensure_model

    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    model_dir = Path(args.model_path) if args.model_path else ensure_model()
    ref = load_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        cases = [c for _, cs in resolve_workloads(args.workload or CALIBRATION) for c in cs]
    except ValueError as exc:
        print(f"--workload: {exc}", file=sys.stderr)
        return 2
    limit = args.n_relays or (8 if args.quick else len(cases))
    bar = tqdm(desc="generate (cached)", unit="seq", disable=args.no_progress, file=sys.stderr)
    usable, skipped = prepare_relays(
        ref,
        tok,
        cases[:limit],
        Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
        model_fingerprint(model_dir, ref.num_layers),
        GenSettings(),
        progress=lambda _s, n: bar.update(n),
    )
    bar.close()
    for case, reason in skipped:
        print(f"skipped {case.id}: {reason}", file=sys.stderr)
    if not usable:
        print("no usable calibration relay", file=sys.stderr)
        return 1
    relays = [load_relay(path, case) for case, path in usable]

    occurrences = [s.length for r in relays for s in r.spans]
    mean_span = statistics.fmean(occurrences)
    if args.add_frontier:
        return add_frontier(args, ref, relays, targets, mean_span, started)

    per_relay, exacts = [], []
    for relay in tqdm(relays, desc="curves", unit="relay", disable=args.no_progress):
        exact = exact_prefill(
            ref, relay.prompt, forced=relay.continuation[:-1], capture_hidden=True
        )
        per_relay.append(relay_curves(ref, relay, exact))
        exact.hidden = None
        exacts.append(exact)
    curves = mean_curves(per_relay)

    bar = tqdm(desc="search", unit="cfg", disable=args.no_progress, file=sys.stderr)
    search = Search(ref, relays, exacts, args.min_reuse, bar)
    chosen = run_search(search, ref.num_layers, args.quick)
    if chosen is None:
        bar.close()
        print(f"no candidate reaches reuse {args.min_reuse}", file=sys.stderr)
        return 1
    config = RelayConfig.from_dict(chosen["config"])
    frontier = run_frontier(
        search, config, ref.num_layers, mean_span, targets, **_search_opts(args)
    )
    bar.close()
    config = consistent_base(config, frontier, ref.num_layers, args.min_reuse)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = {
        "model": model_dir.name,
        "config": config.to_dict(),
        "rule": (
            f"min mean first-token KL over calibration relays subject to reuse >= "
            f"{args.min_reuse} on every relay (max_ratio cap); candidates within "
            f"{KL_TIE:.0%} of the best KL ranked by teacher-forced top-1, then reuse"
        ),
        "min_reuse": args.min_reuse,
        "chosen": chosen,
        "frontier": frontier,
        "context_layers": search.context_layers,
        "calibration": {
            "relays": [r.case.id for r in relays],
            "skipped": [c.id for c, _ in skipped],
            "span_tokens": [r.span_tokens for r in relays],
            "mean_span": round(mean_span, 1),
            "quick": bool(args.quick),
        },
        "curves": curves,
        "search": search.log,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "profile.json").write_text(json.dumps(profile, indent=1))
    plot(curves, search.log, chosen, out / "profile.png")
    m = chosen["metrics"]
    if config.to_dict() != chosen["config"]:  # consistent_base took the frontier's point
        m = next(p["metrics"] for p in frontier if p["config"] == config.to_dict())
        print(f"searched: {describe(RelayConfig.from_dict(chosen['config']))}")
        print("base rule: the operating point below for the reuse constraint")
    print(f"chosen: {describe(config)}")
    print(
        f"calibration ({len(relays)} relays): first-token KL {m['first_token_kl']:.4f}, "
        f"TF top-1 {m['tf_top1']:.3f}, reuse min {m['reuse_min']:.3f} / mean "
        f"{m['reuse_mean']:.3f}; {len(search.log)} candidates in {profile['seconds']:.0f} s"
    )
    print_frontier(frontier)
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
    return 0


def _search_opts(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line options :func:`run_frontier` takes."""
    return {"quick": args.quick, "head_floors": args.head_floors}


def print_frontier(frontier: list[dict[str, Any]]) -> None:
    for p in frontier:
        m = p["metrics"]
        cfg = RelayConfig.from_dict(p["config"])
        print(
            f"  reuse >= {p['target']:.2f}: {p['rule']:13s} {describe(cfg)}"
            f"  KL {m['first_token_kl']:.4f} / {m['first_token_kl_median']:.4f}, reuse min "
            f"{m['reuse_min']:.3f}"
        )


def add_frontier(args, ref, relays, targets, mean_span, started) -> int:
    """``--add-frontier PROFILE``: compute the operating points of an existing profile's
    rule on the calibration relays and write them into it."""
    from tqdm import tqdm

    path = Path(args.add_frontier)
    data = json.loads(path.read_text())
    # the searched deviation rule (the base rule may already be an operating point)
    config = RelayConfig.from_dict((data.get("chosen") or {}).get("config") or data["config"])
    exacts = [
        exact_prefill(ref, r.prompt, forced=r.continuation[:-1])
        for r in tqdm(relays, desc="exact", unit="relay", disable=args.no_progress)
    ]
    bar = tqdm(desc="frontier", unit="cfg", disable=args.no_progress, file=sys.stderr)
    search = Search(ref, relays, exacts, args.min_reuse, bar)
    frontier = run_frontier(
        search, config, ref.num_layers, mean_span, targets, **_search_opts(args)
    )
    bar.close()
    data["config"] = consistent_base(config, frontier, ref.num_layers, args.min_reuse).to_dict()
    data["frontier"] = frontier
    data["context_layers"] = search.context_layers
    calibration = data.setdefault("calibration", {})
    calibration["mean_span"] = round(mean_span, 1)
    calibration["frontier_relays"] = [r.case.id for r in relays]
    data["frontier_seconds"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(data, indent=1))
    print_frontier(frontier)
    print(f"wrote the frontier into {path} ({data['frontier_seconds']:.0f} s)")
    return 0
