"""``sglang-relay bench fidelity``: how close each method's output is to exact prefill.

Offline, on the Hugging Face reference executor (:mod:`sglang_relay.core.reference`,
fp32), which implements the runtime's relay semantics. For every relay case of the
workload (:mod:`sglang_relay.bench.workload`), the shared work runs once and is cached:
upstream generations (decode-phase KV and streams), the downstream prompt, its spans and
its exact greedy continuation (64 tokens). Then per relay: one exact prefill with the
continuation teacher-forced, and one relay prefill per method with the same forced tokens.

Metrics per method (pooled or averaged over relays):

* ``reuse_rate``: METHOD.md's token-layer reuse, pooled over all relayed span tokens;
  ``recomputed_fraction`` = 1 - reuse; ``selected_fraction``: share of span tokens
  selected for rectification.
* ``first_token_kl``: mean KL(exact || method) of the first generated token (nats);
  ``top1_agreement``: share of relays whose first token's argmax matches.
* ``tf_top1_agreement_64``: share of the 64 teacher-forced steps (exact continuation fed)
  whose argmax matches the exact one.
* ``greedy_prefix_64``: share of the 64 free-running greedy tokens before the first
  divergence from the exact continuation; ``first_divergence``: median position (64 if
  none). Greedy decoding from the method's KV repeats the exact tokens until its first
  mismatching argmax, so both come from the teacher-forced pass.

``--frontier`` sweeps each method's budget knob instead of running one point per method
(:mod:`sglang_relay.bench.frontier`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sglang_relay.bench.evaluation import (
    FRONTIER_WORKLOADS,
    KV_CACHE_DTYPES,
    QUICK_FRONTIER_RELAYS,
    QUICK_RELAYS,
    add_cache_and_threads,
    evaluate_relay,
    load_bench_model,
    machine_info,
    method_configs,
    prepare_usable,
    summarize,
)
from sglang_relay.bench.workload import GenSettings, load_relay, load_workload
from sglang_relay.core.config import METHODS

DEFAULT_TARGETS = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 0.98)  # --frontier --reuse-targets


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | reuse | recomputed | KL first token (mean / median) | top-1 | "
        "TF top-1 (64) | greedy prefix (64) | first divergence (median) | relays |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['reuse_rate']:.3f} | {r['recomputed_fraction']:.3f} | "
            f"{r['first_token_kl']:.4f} / {r['first_token_kl_median']:.4f} | "
            f"{r['top1_agreement']:.3f} | {r['tf_top1_agreement_64']:.3f} | "
            f"{r['greedy_prefix_64']:.3f} | {r['first_divergence']:g} | {r['n_relays']} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-relay bench fidelity",
        description="Fidelity of relay methods vs exact prefill on the HF reference (fp32).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"first {QUICK_RELAYS} relays only (--frontier: {QUICK_FRONTIER_RELAYS} per workload)",
    )
    p.add_argument(
        "--workload",
        default=None,
        help="relay cases (JSONL; default: packaged); with --frontier a comma list of files "
        f"or packaged names (default: {','.join(FRONTIER_WORKLOADS)})",
    )
    p.add_argument(
        "--frontier",
        action="store_true",
        help="sweep each method's budget knob over --reuse-targets and report the "
        "fidelity-reuse frontier per workload (Markdown, JSON, PNG plot)",
    )
    p.add_argument(
        "--reuse-targets",
        default=",".join(f"{t:.2f}" for t in DEFAULT_TARGETS),
        help="--frontier: reuse levels the knobs are set for (comma list in (0, 1))",
    )
    p.add_argument("--plot", default=None, help="--frontier: write the KL-vs-reuse PNG here")
    p.add_argument("--markdown", default=None, help="--frontier: write the tables here")
    p.add_argument("--json", default=None, help="write the rows (with per-relay data) here")
    p.add_argument("--model-path", default=None, help="HF model dir (default: embedded)")
    p.add_argument(
        "--profile",
        default=None,
        help="relay profile JSON (default: shipped); 'none': the unprofiled rule a server "
        "runs for a model without a profile",
    )
    p.add_argument("--n-relays", type=int, default=None, help="number of relays to run")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}"
    )
    p.add_argument(
        "--cacheblend-top-ratio", type=float, default=0.15, help="CacheBlend's selected share"
    )
    p.add_argument("--epic-first-k", type=int, default=16, help="EPIC's first tokens per span")
    add_cache_and_threads(p)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_CACHE_DTYPES),
        help="the serving engine's KV cache dtype: K/V rounded to it where the engine writes "
        "its pool (upstream decode, standard prefill and relay alike); default: the model's",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.frontier:
        from sglang_relay.bench.frontier import run_frontier

        return run_frontier(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(f"unknown methods: {unknown}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    started = time.perf_counter()
    model_dir, profile_path, relay_cfg, ref, tok, fingerprint, cache_dir = load_bench_model(args)
    cases = load_workload(args.workload)
    limit = args.n_relays or (QUICK_RELAYS if args.quick else None)
    try:
        configs = method_configs(
            relay_cfg,
            methods,
            cacheblend_top_ratio=args.cacheblend_top_ratio,
            epic_first_k=args.epic_first_k,
        )
    except ValueError as exc:
        print(f"bad method settings: {exc}", file=sys.stderr)
        return 2
    for cfg in configs.values():
        if cfg is not None:
            cfg.schedule(ref.num_layers)  # fail early on a layer range this model lacks

    gen = GenSettings()
    usable, skipped = prepare_usable(
        ref, tok, cases, limit, cache_dir, fingerprint, gen, progress=not args.no_progress
    )
    gen_s = time.perf_counter() - started
    for case, reason in skipped:
        print(f"skipped {case.id}: {reason}", file=sys.stderr)
    if not usable:
        print("no usable relay case", file=sys.stderr)
        return 1

    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for case, path in tqdm(usable, desc="relays", unit="relay", disable=args.no_progress):
        relay = load_relay(path, case)
        for name, row in evaluate_relay(ref, relay, configs, [tok.eos_token_id]).items():
            per_method[name].append(row)
        del relay
    rows = [summarize(m, per_method[m], ref.num_layers) for m in methods]
    total_s = time.perf_counter() - started
    print(markdown_table(rows))
    print(
        f"\n{len(usable)} relays ({len(skipped)} skipped), model {model_dir.name} "
        f"({ref.num_layers} layers, fp32, KV cache {args.kv_cache_dtype}), relay config "
        f"{relay_cfg.to_dict()}; "
        f"{total_s:.0f} s total ({gen_s:.0f} s loading/generation), "
        f"{torch.get_num_threads()} threads"
    )
    if args.json:
        meta = {
            "model": str(model_dir),
            "kv_cache_dtype": args.kv_cache_dtype,
            "profile": str(profile_path) if profile_path else None,
            "workload": args.workload or "packaged:fidelity_workload.jsonl",
            "quick": bool(args.quick),
            "machine": machine_info(),
            "generation": asdict(gen),
            "seconds_total": total_s,
            "seconds_generation": gen_s,
            "skipped": [c.id for c, _ in skipped],
        }
        out = []
        for row, m in zip(rows, methods, strict=True):
            cfg = configs[m]
            out.append(
                {
                    **row,
                    "config": cfg.to_dict() if cfg is not None else None,
                    "run": meta,
                    "per_relay": per_method[m],
                }
            )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
