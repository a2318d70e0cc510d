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
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch

from sglang_relay.bench.chains import collapsed, rouge_l
from sglang_relay.bench.intervals import bootstrap_ci
from sglang_relay.bench.workload import (
    Case,
    GenSettings,
    RelayCase,
    load_relay,
    load_workload,
    model_fingerprint,
    prepare_relays,
)
from sglang_relay.core.config import RelayConfig, load_profile
from sglang_relay.core.operating import at_target
from sglang_relay.core.reference import (
    RefModel,
    exact_prefill,
    fidelity,
    greedy_after_forced,
    relay_prefill,
)
from sglang_relay.runtime.settings import DEFAULT_GUARD_TOKENS as GUARD_TOKENS
from sglang_relay.runtime.settings import UNPROFILED, UNPROFILED_REUSE

METHODS = ("standard", "naive", "cacheblend", "epic", "relay")
QUICK_RELAYS = 32
# --frontier (the sweep itself lives in sglang_relay.bench.frontier)
QUICK_FRONTIER_RELAYS = 16
FRONTIER_WORKLOADS = (
    "fidelity_workload.jsonl",
    "heldout_workload.jsonl",
    "humaneval_workload.jsonl",
)
DEFAULT_TARGETS = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 0.98)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "sglang-relay" / "fidelity"


def shipped_profile_path(model_dir: str | Path) -> Path | None:
    """``sglang_relay/data/profile_<model dir name>.json`` if the package ships one."""
    name = Path(str(model_dir).rstrip("/")).name
    candidate = resources.files("sglang_relay.data").joinpath(f"profile_{name}.json")
    return Path(str(candidate)) if candidate.is_file() else None


def method_configs(
    relay: RelayConfig,
    methods: list[str],
    *,
    cacheblend_top_ratio: float = 0.15,
    epic_first_k: int = 16,
) -> dict[str, RelayConfig | None]:
    """The config each method runs with (``None``: exact prefill). CacheBlend and EPIC use
    their fixed settings (``RelayConfig().for_method``), then the given top ratio / first k;
    relay uses the profile."""
    table: dict[str, RelayConfig | None] = {
        "standard": None,
        "naive": RelayConfig(method="naive"),
        "cacheblend": replace(
            RelayConfig().for_method("cacheblend"), top_ratio=cacheblend_top_ratio
        ),
        "epic": replace(RelayConfig().for_method("epic"), first_k=epic_first_k),
        "relay": replace(relay, method="relay"),
    }
    return {m: table[m] for m in methods}


def prepare_usable(
    ref: RefModel,
    tok: Any,
    cases: list[Case],
    limit: int | None,
    cache_dir: Path,
    fingerprint: str,
    gen: GenSettings,
    *,
    progress: bool = True,
) -> tuple[list[tuple[Case, Path]], list[tuple[Case, str]]]:
    """Cases in order until ``limit`` usable ones (a skipped case is replaced by the next),
    generated or taken from the cache (:func:`prepare_relays`)."""
    from tqdm import tqdm

    usable: list[tuple[Case, Path]] = []
    skipped: list[tuple[Case, str]] = []
    pending = list(cases)
    bar = tqdm(desc="generate (cached)", unit="seq", disable=not progress, file=sys.stderr)
    while pending and (limit is None or len(usable) < limit):
        want = len(pending) if limit is None else limit - len(usable)
        take, pending = pending[:want], pending[want:]
        ok, bad = prepare_relays(
            ref, tok, take, cache_dir, fingerprint, gen, progress=lambda _s, n: bar.update(n)
        )
        usable += ok
        skipped += bad
    bar.close()
    return usable, skipped


def evaluate_relay(
    ref: RefModel,
    relay: RelayCase,
    configs: dict[str, RelayConfig | None],
    stop_ids: Sequence[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per-method metrics of one relay (one exact pass shared by all methods). With
    ``stop_ids`` also each method's free-running greedy output, as long as the exact
    continuation may be (:func:`greedy_after_forced`): ``collapsed`` (it stops before half
    of the exact one's length or ends in a loop the exact one does not,
    :func:`~sglang_relay.bench.chains.collapsed`) and ``rouge_l`` against the exact one."""
    cont = relay.continuation
    forced = cont[:-1]
    t0 = time.perf_counter()
    exact = exact_prefill(ref, relay.prompt, forced=forced)
    exact_s = time.perf_counter() - t0
    out: dict[str, dict[str, Any]] = {}
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        if cfg is None:
            res, seconds = exact, exact_s
        else:
            res = relay_prefill(ref, relay.prompt, relay.spans, cfg, forced=forced)
            seconds = time.perf_counter() - t0
        row = fidelity(exact.logits, res.logits, cont)
        if stop_ids is not None:
            free = greedy_after_forced(ref, res, cont, len(cont), stop_ids)
            row.update(collapsed=int(collapsed(free, cont)), rouge_l=rouge_l(free, cont))
            redo, kept = guard_outcome(free, cont, stop_ids) if cfg is not None else (False, free)
            row.update(
                guard_redo=int(redo),
                collapsed_guarded=int(collapsed(kept, cont)),
                rouge_l_guarded=rouge_l(kept, cont),
            )
        row.update(
            id=relay.case.id,
            span_tokens=relay.span_tokens,
            spans=len(relay.spans),
            prompt_tokens=len(relay.prompt),
            selected=sum(res.selected),
            reuse_rate=res.reuse_rate,
            seconds=seconds,
        )
        out[name] = row
    return out


def guard_outcome(
    free: Sequence[int], exact: Sequence[int], stop_ids: Sequence[int], limit: int = GUARD_TOKENS
) -> tuple[bool, Sequence[int]]:
    """What a relay server's early-stop guard (runtime/guard.py) makes of a relayed reply
    ``free`` (greedy, with its stop token): whether it redoes it (the reply ended by a stop
    within ``limit`` tokens) and the reply the user gets (then ``exact``, standard's)."""
    redo = bool(free) and len(free) <= limit and free[-1] in stop_ids
    return redo, (exact if redo else free)


def summarize(name: str, rows: list[dict[str, Any]], num_layers: int) -> dict[str, Any]:
    """One table row from per-relay rows."""
    span = sum(r["span_tokens"] for r in rows)
    recomputed = sum((1.0 - r["reuse_rate"]) * r["span_tokens"] for r in rows)
    divs = [
        r["tf_tokens"] if r["first_divergence"] is None else r["first_divergence"] for r in rows
    ]
    kls = [r["first_token_kl"] for r in rows]
    return {
        "method": name,
        "n_relays": len(rows),
        "reuse_rate": 1.0 - recomputed / span if span else 0.0,
        "reuse_rate_min": min(r["reuse_rate"] for r in rows),
        "recomputed_fraction": recomputed / span if span else 0.0,
        "selected_fraction": sum(r["selected"] for r in rows) / span if span else 0.0,
        "first_token_kl": statistics.fmean(kls),
        "first_token_kl_median": statistics.median(kls),
        "first_token_kl_max": max(kls),
        "top1_agreement": statistics.fmean(r["top1"] for r in rows),
        "tf_top1_agreement_64": statistics.fmean(r["tf_top1"] for r in rows),
        "greedy_prefix_64": statistics.fmean(r["greedy_prefix"] for r in rows),
        "first_divergence": statistics.median(divs),
        "seconds_per_relay": statistics.fmean(r["seconds"] for r in rows),
        "span_tokens_mean": span / len(rows),
        "num_layers": num_layers,
        **free_running_summary(rows),
        "ci": intervals(rows),
    }


def free_running_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``collapse_rate`` and mean ``rouge_l_64`` when the rows carry free-running outputs."""
    if not rows or "collapsed" not in rows[0]:
        return {}
    out = {
        "collapse_rate": statistics.fmean(r["collapsed"] for r in rows),
        "rouge_l_64": statistics.fmean(r["rouge_l"] for r in rows),
    }
    if "guard_redo" in rows[0]:
        out.update(
            guard_rate=statistics.fmean(r["guard_redo"] for r in rows),
            collapse_rate_guarded=statistics.fmean(r["collapsed_guarded"] for r in rows),
            rouge_l_64_guarded=statistics.fmean(r["rouge_l_guarded"] for r in rows),
        )
    return out


# summary measure -> (per-relay field, statistic, lower is better)
MEASURES = {
    "first_token_kl": ("first_token_kl", "mean", True),
    "first_token_kl_median": ("first_token_kl", "median", True),
    "top1_agreement": ("top1", "mean", False),
    "tf_top1_agreement_64": ("tf_top1", "mean", False),
    "greedy_prefix_64": ("greedy_prefix", "mean", False),
    "collapse_rate": ("collapsed", "mean", True),
    "rouge_l_64": ("rouge_l", "mean", False),
    "collapse_rate_guarded": ("collapsed_guarded", "mean", True),
    "rouge_l_64_guarded": ("rouge_l_guarded", "mean", False),
}


def intervals(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Bootstrap 95 % interval of every summary measure the rows carry."""
    out = {}
    for name, (field_name, stat, _) in MEASURES.items():
        if rows and field_name in rows[0]:
            out[name] = list(bootstrap_ci([r[field_name] for r in rows], stat))
    return out


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


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


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
    p.add_argument("--cache-dir", default=None, help="generation cache folder")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared CPU, OpenMP threads that wait for "
        "a busy core slow small matmuls down many times)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_CACHE_DTYPES),
        help="the serving engine's KV cache dtype: K/V rounded to it where the engine writes "
        "its pool (upstream decode, standard prefill and relay alike); default: the model's",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# --kv-cache-dtype values (SGLang's names) -> the dtype the reference rounds K/V to
KV_CACHE_DTYPES = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class BenchModel(NamedTuple):
    model_dir: Path
    profile_path: Path | None
    relay_cfg: RelayConfig
    ref: RefModel
    tok: object
    fingerprint: str
    cache_dir: Path


def load_bench_model(args: argparse.Namespace) -> BenchModel:
    """The model, tokenizer, relay profile and generation cache both fidelity benches use
    (``--model-path``, ``--profile``, ``--threads``, ``--cache-dir``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sglang_relay.core.reference import load_model
    from sglang_relay.embedded_model import ensure_model

    hf_logging.set_verbosity_error()
    model_dir = Path(args.model_path) if args.model_path else ensure_model()
    if args.profile == "none":
        profile_path = None
    else:
        profile_path = Path(args.profile) if args.profile else shipped_profile_path(model_dir)
    kv_name = getattr(args, "kv_cache_dtype", "auto")
    ref = load_model(str(model_dir), kv_dtype=KV_CACHE_DTYPES[kv_name])
    # without a profile: what a server runs for such a model (the unprofiled rule at 0.80)
    relay_cfg = (
        load_profile(profile_path)[0]
        if profile_path
        else at_target(UNPROFILED, ref.num_layers, UNPROFILED_REUSE)
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    fingerprint = model_fingerprint(model_dir, ref.num_layers)
    if ref.kv_dtype is not None:  # upstream outputs decoded over another KV cache
        fingerprint = f"{fingerprint}-kv-{kv_name}"
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    return BenchModel(model_dir, profile_path, relay_cfg, ref, tok, fingerprint, cache_dir)


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
