"""What an FP8 KV cache costs by itself, next to what relay adds on it (docs/fidelity.md
"FP8 KV cache"). On the relays ``sglang-relay bench fidelity --kv-cache-dtype KV`` ran
(its generation cache: upstream outputs decoded over the FP8 cache), per relay:

* ``fp8``: KL(standard, full-precision KV || standard, FP8 KV) of the first token: the
  cost of the FP8 cache alone, what any FP8 server pays;
* ``relay``: KL(standard, FP8 || relay, FP8): relay's own error on that server (the
  bench's figure);
* ``both``: KL(standard, full precision || relay, FP8): what a user of an FP8 relay server
  sees against a full-precision server without relay.

    python benchmark/fp8_kv_cost.py --kv-cache-dtype fp8_e4m3 [--threads 1]
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["bf16", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from sglang_relay.bench.fidelity import build_parser, load_bench_model
    from sglang_relay.bench.intervals import bootstrap_ci
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, prepare_relays
    from sglang_relay.core import reference as R

    bench_args = build_parser().parse_args(
        ["--kv-cache-dtype", args.kv_cache_dtype, "--threads", str(args.threads)]
    )
    bm = load_bench_model(bench_args)
    fp8, full = bm.ref, R.RefModel(bm.ref.model)
    usable, _ = prepare_relays(fp8, bm.tok, load_workload(None), bm.cache_dir, bm.fingerprint,
                               GenSettings())  # fmt: skip
    cols: dict[str, list[float]] = {"fp8": [], "relay": [], "both": []}
    for case, path in usable:
        relay = load_relay(path, case)
        std8 = R.exact_prefill(fp8, relay.prompt).logits[-1]
        std = R.exact_prefill(full, relay.prompt).logits[-1]
        rel8 = R.relay_prefill(fp8, relay.prompt, relay.spans, bm.relay_cfg).logits[-1]
        cols["fp8"].append(R.first_token_kl(std, std8))
        cols["relay"].append(R.first_token_kl(std8, rel8))
        cols["both"].append(R.first_token_kl(std, rel8))
    print(f"{len(usable)} relays, KV cache {args.kv_cache_dtype}, relay {bm.relay_cfg.to_dict()}")
    print("| first-token KL | mean [95 %] | median |\n|---|---|---|")
    for name, v in cols.items():
        lo, hi = bootstrap_ci(v)
        print(f"| {name} | {np.mean(v):.4f} [{lo:.4f}, {hi:.4f}] | {np.median(v):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
