"""Where relay's remaining error is: selection or recomputation (offline, reference executor).

For each relay of the fidelity workload, beside relay with the shipped profile's deviation
rule (its ``chosen`` search result; layers 3, 4, 29 on the embedded model):

* ``relay, true-worst selection``: the same layers recomputed, but for the tokens whose
  reused values truly deviate most from the exact prefill's (mean over layers), as many
  per span as relay selected: the best any detector could pick;
* ``relay, exact detector at l_det``: the same, ranked by the true deviation at ``l_det``
  only: the best a detector looking at that one layer could pick;
* ``relay's selection, exact KV``: relay's tokens, but with the exact prefill's KV in every
  layer instead of recomputed KV: the best any recomputation of those tokens could give;
* ``true worst, exact KV``: both (METHOD.md's "exact KV for the true worst" oracle).

    python research/studies/fidelity_headroom.py [--n-relays 32] [--json OUT]

Prints mean / median first-token KL, teacher-forced top-1 (64) and, for the selections,
the share of the true-worst tokens they pick, per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from sglang_relay.bench.evaluation import default_cache_dir, shipped_profile_path
from sglang_relay.bench.workload import (
    GenSettings,
    load_relay,
    load_workload,
    model_fingerprint,
    prepare_relays,
)
from sglang_relay.core import reference as ref_exec
from sglang_relay.core.config import RelayConfig, load_profile

sys.path.insert(0, str(Path(__file__).parent))
from selection_study import per_span_top  # noqa: E402  (the sibling script)

VARIANTS = (
    "relay (deviation rule)",
    "relay, true-worst selection",
    "relay, exact detector at l_det",
    "relay's selection, exact KV",
    "true worst, exact KV",
)


def evaluate(ref, relay, cfg) -> dict[str, tuple[float, float, float, float]]:
    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    base = ref_exec.relay_prefill(ref, relay.prompt, spans, cfg, forced=forced)
    lengths = base.span_lengths
    truth = ref_exec.true_value_deviation(ref, spans, exact)
    worst = per_span_top(truth, base.selected, lengths)
    l_det = cfg.schedule(ref.num_layers).l_det
    at_det_truth = ref_exec.true_value_deviation(ref, spans, exact, layers=[l_det])
    at_det = per_span_top(at_det_truth, base.selected, lengths)
    picked = {  # share of the true-worst tokens each selection picks
        VARIANTS[0]: base.selected_mask,
        VARIANTS[1]: worst,
        VARIANTS[2]: at_det,
        VARIANTS[3]: base.selected_mask,
        VARIANTS[4]: worst,
    }
    results = {
        VARIANTS[0]: base,
        VARIANTS[1]: ref_exec.relay_prefill(
            ref, relay.prompt, spans, cfg, forced=forced, selection=worst
        ),
        VARIANTS[2]: ref_exec.relay_prefill(
            ref, relay.prompt, spans, cfg, forced=forced, selection=at_det
        ),
        VARIANTS[3]: ref_exec.exact_kv_prefill(
            ref, relay.prompt, spans, exact, base.selected_mask, forced=forced
        ),
        VARIANTS[4]: ref_exec.exact_kv_prefill(
            ref, relay.prompt, spans, exact, worst, forced=forced
        ),
    }
    out = {}
    for name, res in results.items():
        f = ref_exec.fidelity(exact.logits, res.logits, relay.continuation)
        hit = float((picked[name] & worst).sum() / worst.sum())
        out[name] = (res.reuse_rate, f["first_token_kl"], f["tf_top1"], hit)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-relays", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write per-relay rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model

    model_dir = ensure_model()
    # the deviation rule the profiler searched (``chosen``): the shipped base rule is the
    # context rule since session 10, which has no detector to take apart
    base, data = load_profile(shipped_profile_path(model_dir))
    cfg = RelayConfig.from_dict(data.get("chosen", {}).get("config") or base.to_dict())
    ref = ref_exec.load_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = load_workload(None)[: args.n_relays]
    fingerprint = model_fingerprint(model_dir, ref.num_layers)
    usable, _ = prepare_relays(ref, tok, cases, default_cache_dir(), fingerprint, GenSettings())
    per: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in VARIANTS}
    with torch.inference_mode():
        for i, (case, path) in enumerate(usable):
            for name, row in evaluate(ref, load_relay(path, case), cfg).items():
                per[name].append(row)
            print(f"\r{i + 1}/{len(usable)} relays", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(
        "| variant | reuse | KL first token (mean / median) | TF top-1 (64) | true worst picked |"
    )
    print("|---|---|---|---|---|")
    for name, rows in per.items():
        kls = [r[1] for r in rows]
        print(
            f"| {name} | {statistics.mean(r[0] for r in rows):.3f} | "
            f"{statistics.mean(kls):.4f} / {statistics.median(kls):.4f} | "
            f"{statistics.mean(r[2] for r in rows):.3f} | "
            f"{statistics.mean(r[3] for r in rows):.2f} |"
        )
    print(f"\n{len(usable)} relays, profile {cfg.to_dict()}")
    if args.json:
        Path(args.json).write_text(json.dumps(per, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
