"""What an FP8 KV cache costs by itself, next to what relay adds on it (docs/fidelity.md
"FP8 KV cache"). On the relays ``sglang-relay bench fidelity --kv-cache-dtype KV`` ran
(its generation cache: upstream outputs decoded over the FP8 cache), per relay:

* ``fp8``: KL(standard, full-precision KV || standard, FP8 KV) of the first token: the
  cost of the FP8 cache alone, what any FP8 server pays;
* ``relay``: KL(standard, FP8 || relay, FP8): relay's own error on that server (the
  bench's figure);
* ``both``: KL(standard, full precision || relay, FP8): what a user of an FP8 relay server
  sees against a full-precision server without relay.

    python research/studies/fp8_kv_cost.py --kv-cache-dtype fp8_e4m3 [--threads 1]

``--splice-study``: is relay's added error the splice's second rounding of the keys (a
stored FP8 key re-rotated and rounded again)? Upstream KV from the full-precision
generation cache, so the unrounded keys are known; per relay, KL(standard, FP8 || relay,
FP8) with the span keys spliced from what the pool would hold (``twice``: rounded at
decode, re-rotated, rounded again: the server), from the unrounded keys (``once``: a
full-precision shadow of the span keys) and from the FP8 keys plus a 4-bit code of their
rounding residual (``refined``); values rounded to FP8 in all three, paired intervals
against ``twice``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from sglang_relay.core.rope import to_kv_dtype


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["bf16", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--splice-study", action="store_true", help="the second rounding's share")
    args = p.parse_args()
    from sglang_relay.bench.evaluation import load_bench_model
    from sglang_relay.bench.fidelity import build_parser
    from sglang_relay.bench.intervals import bootstrap_ci
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, prepare_relays
    from sglang_relay.core import reference as R

    bench_args = build_parser().parse_args(
        ["--kv-cache-dtype", args.kv_cache_dtype, "--threads", str(args.threads)]
    )
    bm = load_bench_model(bench_args)
    if args.splice_study:
        return splice_study(bm, args.kv_cache_dtype)
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


def refine(k: torch.Tensor, dtype: torch.dtype, bits: int = 4) -> torch.Tensor:
    """``k`` as its FP8 value plus ``bits`` of its rounding residual, coded in units of the
    FP8 value's spacing (what a refinement buffer beside an FP8 pool would hold)."""
    hi = to_kv_dtype(k, dtype).to(k.dtype)
    fi = torch.finfo(dtype)
    emin, mbits = math.log2(fi.smallest_normal), -math.log2(fi.eps)
    spacing = torch.exp2(torch.floor(torch.log2(hi.abs().clamp_min(2.0**emin))) - mbits)
    half = 2 ** (bits - 1)
    code = torch.round((k - hi) / spacing * 2 * half).clamp(-half, half - 1)
    return hi + code * spacing / (2 * half)


def splice_study(bm, kv_name: str) -> int:
    """Relay on an FP8 cache with the span keys spliced three ways (module docstring)."""
    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, prepare_relays
    from sglang_relay.core import reference as R

    fp8 = bm.ref.kv_dtype
    full = R.RefModel(bm.ref.model)
    fingerprint = bm.fingerprint.rsplit(f"-kv-{kv_name}", 1)[0]  # full-precision upstream
    usable, _ = prepare_relays(full, bm.tok, load_workload(None), bm.cache_dir, fingerprint,
                               GenSettings())  # fmt: skip
    keys = {
        "twice": lambda k: bm.ref.stored(k),
        "once": lambda k: k,
        "refined": lambda k: refine(k, fp8),
    }
    cols: dict[str, list[float]] = {name: [] for name in keys}
    for case, path in usable:
        std = R.exact_prefill(bm.ref, load_relay(path, case).prompt).logits[-1]
        for name, key in keys.items():
            relay = load_relay(path, case)
            for rec in relay.records:
                rec.k, rec.v = key(rec.k), bm.ref.stored(rec.v)
            out = R.relay_prefill(bm.ref, relay.prompt, relay.spans, bm.relay_cfg).logits[-1]
            cols[name].append(R.first_token_kl(std, out))
    print(f"{len(usable)} relays, KV cache {kv_name}, span keys spliced three ways")
    print("| span keys | KL mean [95 %] | median | minus twice [paired 95 %] |\n|---|---|---|---|")
    for name, v in cols.items():
        lo, hi = bootstrap_ci(v)
        d = np.asarray(v) - np.asarray(cols["twice"])
        dlo, dhi = paired_ci(v, cols["twice"])
        print(f"| {name} | {np.mean(v):.4f} [{lo:.4f}, {hi:.4f}] | {np.median(v):.4f} | "
              f"{d.mean():+.4f} [{dlo:+.4f}, {dhi:+.4f}] |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
