"""Which span tokens should a relay recompute at a given reuse? (offline, reference executor)

Every variant here spends the same budget per span: ``c = floor((1 - target) * n)`` tokens
recomputed in every layer (token-layer reuse ``>= target`` on every span), so the
variants differ only in *which* tokens. Each selection is run two ways: recomputed from
the embeddings through every layer (what a server can do without stored hidden state), and
with the exact prefill's KV for the chosen tokens (the ceiling of that choice).

Selections (per span occurrence):

* ``first``: the first ``c`` tokens (EPIC's rule, sized per span);
* ``true deviation``: highest value deviation of the reused KV from the exact KV (cosine,
  mean over layers) - what relay's detector estimates;
* ``attention-weighted``: highest ``sum over layers and KV heads of A * |dV|``, where ``A``
  is the attention mass the measured rows (the last prompt row and the teacher-forced
  continuation) give the token in the exact prefill and ``|dV|`` the norm of its value
  error: the first-order error each token causes in the outputs that are measured;
* ``first 16 + attention-weighted``: the first ``min(16, c)`` tokens, the rest as above.

    python benchmark/selection_study.py [--n-relays 16] [--targets 0.8,0.9,0.95] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from sglang_relay.bench.fidelity import FRONTIER_WORKLOADS, default_cache_dir, prepare_usable
from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, model_fingerprint
from sglang_relay.core import reference as ref_exec
from sglang_relay.core.config import RelayConfig

# recompute the selected tokens from the embeddings in every layer, nothing else
FROM_ZERO = RelayConfig(
    method="relay", l_start=0, l_det=0, l_end=-1, signal="none", first_k=0, l_suf=0
)


def attention_received(
    ref: ref_exec.RefModel, hidden: torch.Tensor, cache: ref_exec.KVCache, rows: torch.Tensor
) -> torch.Tensor:
    """``[L, T, H_kv]``: attention mass each position receives from query ``rows`` per layer
    and KV head (summed over the rows and the query heads of the group), given the streams
    ``hidden [L, T, hidden]`` and final KV ``cache`` of a full prefill."""
    num_l, total = hidden.shape[0], hidden.shape[1]
    hkv = ref.num_kv_heads
    group = ref.num_heads // hkv
    out = torch.zeros(num_l, total, hkv)
    mask = torch.arange(total)[None, :] <= rows[:, None]  # [n, T]
    for lid, layer in enumerate(ref.layers):
        x = layer.input_layernorm(hidden[lid, rows])
        q, _, _ = ref.qkv(layer, x, rows)  # [n, Hq, D]
        qg = q.view(rows.numel(), hkv, group, ref.head_dim)
        scores = torch.einsum("ngrd,tgd->ngrt", qg, cache.k[lid]) * ref.scale
        probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
        out[lid] = probs.sum(dim=(0, 2)).T
    return out


def per_span_top(score: torch.Tensor, counts: list[int], lengths: list[int], head: int = 0):
    """``[S]`` mask: per span, its first ``min(head, c)`` tokens, then the highest ``score``."""
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    lo = 0
    for c, n in zip(counts, lengths, strict=True):
        s = score[lo : lo + n].clone()
        h = min(head, c)
        s[:h] = float("inf")
        mask[lo + s.topk(c).indices] = True
        lo += n
    return mask


def evaluate(ref, relay, targets):
    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced, capture_hidden=True)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    lengths = [s.length for s in spans]
    rows = torch.cat([torch.arange(s.prompt_start, s.prompt_start + s.length) for s in spans])
    total = exact.cache.length
    measured = torch.arange(len(relay.prompt) - 1, total)
    attn = attention_received(ref, exact.hidden, exact.cache, measured)[:, rows]  # [L, S, Hkv]
    _, src_v = ref_exec._upstream_kv(spans)
    dv = (src_v - exact.cache.v[:, rows]).norm(dim=-1)  # [L, S, Hkv]
    weighted = (attn * dv).sum(dim=(0, 2))
    truth = ref_exec.true_value_deviation(ref, spans, exact)
    position = -torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])
    scores = {
        "first": (position, 0),
        "true deviation": (truth, 0),
        "attention-weighted": (weighted, 0),
        "first 16 + attention-weighted": (weighted, 16),
    }
    out = {}
    for t in targets:
        counts = [int((1 - t) * n + 1e-9) for n in lengths]
        for name, (score, head) in scores.items():
            sel = per_span_top(score, counts, lengths, head)
            rec = ref_exec.relay_prefill(
                ref, relay.prompt, spans, FROM_ZERO, forced=forced, selection=sel
            )
            ora = ref_exec.exact_kv_prefill(ref, relay.prompt, spans, exact, sel, forced=forced)
            for how, res in (("recomputed", rec), ("exact KV", ora)):
                f = ref_exec.fidelity(exact.logits, res.logits, relay.continuation)
                out[f"{t:.2f}|{name}|{how}"] = (res.reuse_rate, f["first_token_kl"], f["tf_top1"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-relays", type=int, default=16)
    p.add_argument("--targets", default="0.8,0.9,0.95")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write per-relay rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model

    targets = [float(x) for x in args.targets.split(",")]
    model_dir = ensure_model()
    ref = ref_exec.load_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    fingerprint = model_fingerprint(model_dir, ref.num_layers)
    per: dict[str, dict[str, list]] = {}
    for wl in FRONTIER_WORKLOADS:
        cases = load_workload(None, name=wl)
        usable, _ = prepare_usable(
            ref, tok, cases, args.n_relays, default_cache_dir(), fingerprint, GenSettings()
        )
        rows: dict[str, list] = {}
        with torch.inference_mode():
            for i, (case, path) in enumerate(usable):
                for key, row in evaluate(ref, load_relay(path, case), targets).items():
                    rows.setdefault(key, []).append(row)
                print(f"\r{wl}: {i + 1}/{len(usable)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        per[wl] = rows
        print(f"\n{wl} ({len(usable)} relays)\n")
        print("| target | selection | recomputed: KL mean / median | exact KV: KL mean / median |")
        print("|---|---|---|---|")
        keys = list(dict.fromkeys(k.rsplit("|", 1)[0] for k in rows))
        for key in keys:
            cells = []
            for how in ("recomputed", "exact KV"):
                kls = [r[1] for r in rows[f"{key}|{how}"]]
                cells.append(f"{statistics.mean(kls):.4f} / {statistics.median(kls):.4f}")
            t, name = key.split("|")
            print(f"| {t} | {name} | {cells[0]} | {cells[1]} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(per, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
