"""What an FP8 KV cache costs by itself, next to what relay adds on it (docs/fidelity.md
"FP8 KV cache"). On the relays ``sglang-relay bench fidelity --kv-cache-dtype KV`` ran
(its generation cache: upstream outputs decoded over the FP8 cache), per relay:

* ``cache``: KL(standard, full-precision KV || standard, FP8 KV) of the first token: the
  cost of the FP8 cache alone, what any FP8 server pays;
* ``M/same``, for M in relay, EPIC, CacheBlend: KL(standard, FP8 || M, FP8): the method's
  own error on that server (the bench's figure);
* ``M/full``: KL(standard, full precision || M, FP8): what a user of an FP8 server with M
  sees against a full-precision server without it; beside it, with a paired interval, how
  much that exceeds the cache alone.

    python research/studies/fp8_kv_cost.py --kv-cache-dtype fp8_e4m3 [--threads 1] [--json F]
    python research/studies/fp8_kv_cost.py --compare AUTO.json BF16.json E4M3.json E5M2.json

``--compare``: each method's same-cache KL over the first file's (``auto``: the model's
dtype), a ratio with a 95 % interval from resampling both files' relays.

``--splice-study``: is relay's added error the splice's second rounding of the keys (a
stored FP8 key re-rotated and rounded again)? Upstream KV from the full-precision
generation cache, so the unrounded keys are known; per relay, KL(standard, FP8 || relay,
FP8) with the span keys spliced from what the pool would hold (``twice``: rounded at
decode, re-rotated, rounded again: the server), from the unrounded keys (``once``: a
full-precision shadow of the span keys) and from the FP8 keys plus a 4-bit code of their
rounding residual (``refined``); values rounded to FP8 in all three, paired intervals
against ``twice``.

``--detect-study``: is it the selection? Relay's detector ranks span tokens by
``1 - cos(fresh V, stored V)`` at ``l_det``; on an FP8 cache the stored V carries FP8's
rounding error, a floor of about ``eps^2 / 2`` that may swamp the context's real change.
Same upstream KV as ``--splice-study``; per relay the server's splice (``server``) beside
the same splice with layer ``l_det``'s stored V kept unrounded (``detect-hp``: a
higher-precision copy of one layer's span values, which only the detector reads: the
detection layer overwrites those rows with fresh K/V) and, as the bound, every span
K/V unrounded (``all-hp``; values and keys spliced at full precision).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from sglang_relay.core.rope import to_kv_dtype

METHODS = ("relay", "epic", "cacheblend")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3",
                   choices=["auto", "bf16", "fp8_e4m3", "fp8_e5m2"])  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the per-relay KLs here (for --compare)")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="ratio of each method's same-cache KL to the first file's")  # fmt: skip
    p.add_argument("--splice-study", action="store_true", help="the second rounding's share")
    p.add_argument("--detect-study", action="store_true", help="the detector's rounding floor")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    from sglang_relay.bench.evaluation import load_bench_model, method_configs
    from sglang_relay.bench.fidelity import build_parser
    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, prepare_relays
    from sglang_relay.core import reference as R

    bench_args = build_parser().parse_args(
        ["--kv-cache-dtype", args.kv_cache_dtype, "--threads", str(args.threads)]
    )
    bm = load_bench_model(bench_args)
    if args.splice_study:
        return splice_study(bm, args.kv_cache_dtype)
    if args.detect_study:
        return detect_study(bm, args.kv_cache_dtype)
    cached, full = bm.ref, R.RefModel(bm.ref.model)
    configs = method_configs(bm.relay_cfg, list(METHODS))
    usable, _ = prepare_relays(cached, bm.tok, load_workload(None), bm.cache_dir, bm.fingerprint,
                               GenSettings())  # fmt: skip
    # cache: the cache alone (standard, full precision || standard, this cache); per method
    # same: KL(standard, this cache || method, this cache); full: KL(standard, full
    # precision || method, this cache)
    cols: dict[str, list[float]] = {"cache": []}
    cols.update({f"{m}/{k}": [] for m in METHODS for k in ("same", "full")})
    for case, path in usable:
        relay = load_relay(path, case)
        std_c = R.exact_prefill(cached, relay.prompt).logits[-1]
        std = R.exact_prefill(full, relay.prompt).logits[-1]
        cols["cache"].append(R.first_token_kl(std, std_c))
        for m, cfg in configs.items():
            out = R.relay_prefill(cached, relay.prompt, relay.spans, cfg).logits[-1]
            cols[f"{m}/same"].append(R.first_token_kl(std_c, out))
            cols[f"{m}/full"].append(R.first_token_kl(std, out))
    print(f"{len(usable)} relays, KV cache {args.kv_cache_dtype}, relay {bm.relay_cfg.to_dict()}")
    print("| first-token KL | mean [95 %] | median | full minus cache alone [paired 95 %] |")
    print("|---|---|---|---|")
    for name, v in cols.items():
        lo, hi = bootstrap_ci(v)
        extra = ""
        if name.endswith("/full"):
            dlo, dhi = paired_ci(v, cols["cache"])
            d = float(np.mean(v) - np.mean(cols["cache"]))
            extra = f"{d:+.4f} [{dlo:+.4f}, {dhi:+.4f}]"
        print(f"| {name} | {np.mean(v):.4f} [{lo:.4f}, {hi:.4f}] | {np.median(v):.4f} | {extra} |")
    if args.json:
        import json

        out = {"kv_cache_dtype": args.kv_cache_dtype, "relays": [c.id for c, _ in usable]}
        out["relay_config"] = bm.relay_cfg.to_dict()
        out["kl"] = cols
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def compare(paths: list[str]) -> int:
    """Each method's mean KL in each file over its mean same-cache KL in the first file
    (``auto``: the model's dtype), with a 95 % interval from resampling the two files'
    relays independently (their upstream outputs were decoded over different caches, so
    relays do not pair): ``same`` (against standard on the same cache) and ``added``
    (against full-precision standard, minus what the cache alone costs on the same relay)."""
    import json

    from sglang_relay.bench.intervals import RESAMPLES

    runs = [json.load(open(p)) for p in paths]
    base = runs[0]
    rng = np.random.default_rng(0)

    def boot(x: np.ndarray) -> np.ndarray:
        return x[rng.integers(0, x.size, (RESAMPLES, x.size))].mean(1)

    for measure in ("same", "added"):
        name = base["kv_cache_dtype"]
        print(f"\n{measure}: KL mean, and its ratio to the {name} same-cache KL [95 %]")
        print("| KV cache | relays | " + " | ".join(METHODS) + " |")
        print("|---|---|" + "---|" * len(METHODS))
        for run in runs:
            cells = []
            for m in METHODS:
                if measure == "same":
                    a = np.asarray(run["kl"][f"{m}/same"])
                else:
                    a = np.asarray(run["kl"][f"{m}/full"]) - np.asarray(run["kl"]["cache"])
                b = np.asarray(base["kl"][f"{m}/same"])
                lo, hi = np.percentile(boot(a) / boot(b), [2.5, 97.5])
                cells.append(f"{a.mean():.4f} ({a.mean() / b.mean():.2f}x [{lo:.2f}, {hi:.2f}])")
            row = f"| {run['kv_cache_dtype']} | {len(run['relays'])} | " + " | ".join(cells)
            print(row + " |")
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
    print_against(cols, "twice", "span keys")
    return 0


def detect_study(bm, kv_name: str) -> int:
    """Relay on an FP8 cache with the detection layer's stored V at full precision
    (module docstring)."""
    from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, prepare_relays
    from sglang_relay.core import reference as R

    full = R.RefModel(bm.ref.model)
    fingerprint = bm.fingerprint.rsplit(f"-kv-{kv_name}", 1)[0]  # full-precision upstream
    usable, _ = prepare_relays(full, bm.tok, load_workload(None), bm.cache_dir, fingerprint,
                               GenSettings())  # fmt: skip
    l_det = bm.relay_cfg.schedule(bm.ref.num_layers).l_det
    rnd = bm.ref.stored

    def server(rec):
        rec.k, rec.v = rnd(rec.k), rnd(rec.v)

    def detect_hp(rec):
        v = rnd(rec.v)
        v[l_det] = rec.v[l_det]
        rec.k, rec.v = rnd(rec.k), v

    variants = {"server": server, "detect-hp": detect_hp, "all-hp": lambda rec: None}
    cols: dict[str, list[float]] = {name: [] for name in variants}
    same = []
    for case, path in usable:
        std = R.exact_prefill(bm.ref, load_relay(path, case).prompt).logits[-1]
        masks = {}
        for name, prep in variants.items():
            relay = load_relay(path, case)
            for rec in relay.records:
                prep(rec)
            res = R.relay_prefill(bm.ref, relay.prompt, relay.spans, bm.relay_cfg)
            cols[name].append(R.first_token_kl(std, res.logits[-1]))
            masks[name] = res.selected_mask
        a, b = masks["server"], masks["detect-hp"]
        same.append(float((a & b).sum()) / max(1, int(b.sum())))
    print(
        f"{len(usable)} relays, KV cache {kv_name}, l_det {l_det}, relay {bm.relay_cfg.to_dict()}"
    )
    print(f"selected tokens the server's detector shares with detect-hp: {np.mean(same):.3f}")
    print_against(cols, "server", "span K/V")
    return 0


def print_against(cols: dict[str, list[float]], base: str, label: str) -> None:
    """Each column's KL mean [95 %] and median, and its paired difference from ``base``."""
    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci

    print(f"| {label} | KL mean [95 %] | median | minus {base} [paired 95 %] |\n|---|---|---|---|")
    for name, v in cols.items():
        lo, hi = bootstrap_ci(v)
        d = np.asarray(v) - np.asarray(cols[base])
        dlo, dhi = paired_ci(v, cols[base])
        print(f"| {name} | {np.mean(v):.4f} [{lo:.4f}, {hi:.4f}] | {np.median(v):.4f} | "
              f"{d.mean():+.4f} [{dlo:+.4f}, {dhi:+.4f}] |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
