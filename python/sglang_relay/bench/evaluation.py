"""The evaluation library: what every fidelity figure is computed with.

The relay cases a method runs on (:func:`prepare_usable`, from the generation cache), the
configs the methods run with (:func:`method_configs`), one relay evaluated against exact
prefill on the reference executor (:func:`evaluate_relay`: first-token KL and top-1,
teacher-forced top-1, greedy prefix, and from the free-running output ROUGE-L and
collapses, with and without the early-stop guard), the summary of many relays with
bootstrap intervals (:func:`summarize`, :data:`MEASURES`) and the model a bench loads
(:func:`load_bench_model`). ``bench fidelity``, ``bench frontier``, ``bench chains``, the
profiler and the demo all import it; none of it is a CLI.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch

from sglang_relay.bench.intervals import bootstrap_ci
from sglang_relay.bench.workload import (
    Case,
    GenSettings,
    RelayCase,
    model_fingerprint,
    prepare_relays,
)
from sglang_relay.core.config import (
    RelayConfig,
    load_profile,
)
from sglang_relay.core.operating import at_target
from sglang_relay.core.reference import (
    RefModel,
    exact_prefill,
    fidelity,
    greedy_after_forced,
    relay_prefill,
)
from sglang_relay.runtime.config.settings import DEFAULT_GUARD_TOKENS as GUARD_TOKENS
from sglang_relay.runtime.config.settings import UNPROFILED, UNPROFILED_REUSE

QUICK_RELAYS = 32
QUICK_FRONTIER_RELAYS = 16
FRONTIER_WORKLOADS = (
    "fidelity_workload.jsonl",
    "heldout_workload.jsonl",
    "humaneval_workload.jsonl",
)


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
    :func:`collapsed`) and ``rouge_l`` against the exact one."""
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
    """What a relay server's early-stop guard (runtime/sched/guard.py) makes of a relayed reply
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


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


# --kv-cache-dtype values (SGLang's names) -> the dtype the reference rounds K/V to
KV_CACHE_DTYPES = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def add_cache_and_threads(p: argparse.ArgumentParser) -> None:
    """``--cache-dir`` and ``--threads``, which :func:`load_bench_model` reads."""
    p.add_argument("--cache-dir", default=None, help="generation cache folder")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared CPU, OpenMP threads that wait for "
        "a busy core slow small matmuls down many times)",
    )


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


# ---- similarity and collapse of two outputs ------------------------------------------------
def _lcs(a: Sequence[int], b: Sequence[int]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(a: Sequence[int], b: Sequence[int]) -> float:
    """ROUGE-L F1 of two token sequences (1.0 for two empty ones)."""
    if not a and not b:
        return 1.0
    lcs = _lcs(a, b)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tail_loop(ids: Sequence[int], min_repeats: int = 3, max_period: int = 32) -> int:
    """How many tokens at the end of ``ids`` one block covers, repeated back to back at least
    ``min_repeats`` times (period <= ``max_period``); 0 when the output does not end in a
    loop."""
    best = 0
    for period in range(1, max_period + 1):
        i = len(ids) - 1
        while i - period >= 0 and ids[i] == ids[i - period]:
            i -= 1
        covered = len(ids) - 1 - i + period  # the periodic tail, its first block included
        if covered >= min_repeats * period:
            best = max(best, covered)
    return best


# an output is short when under this share of the reference's length, looping when a
# repeated block covers at least this share of it
COLLAPSE_SHORT = 0.5
COLLAPSE_LOOP = 0.25


def collapsed(out: Sequence[int], reference: Sequence[int]) -> bool:
    """Whether ``out`` collapsed where ``reference`` (standard's output for the same request)
    did not: it ended before half of the reference's length, or it ends in a loop covering a
    quarter of it while the reference does not."""

    def looping(ids: Sequence[int]) -> bool:
        return bool(ids) and tail_loop(ids) >= COLLAPSE_LOOP * len(ids)

    if len(out) < COLLAPSE_SHORT * len(reference):
        return True
    return looping(out) and not looping(reference)
