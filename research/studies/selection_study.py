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
* ``first 16 + attention-weighted``: the first ``min(16, c)`` tokens, the rest as above;
* ``shipped context rule``: the shipped profile's base rule at the target (one cap per
  request), recomputed as a server would, and its tokens given their exact KV.

    python research/studies/selection_study.py [--n-relays 16] [--targets 0.8,0.9,0.95] [--json OUT]

``--signals`` instead ranks cheap per-token signals against the true deviation on the
*calibration* relays (Spearman, mean over relays): position, the value deviation at layer
4 after a dense layer 3, influence, the context mass at ``--context-layers`` and averaged
over all layers, and the deviation from the span's KV computed with no context.

    python research/studies/selection_study.py --signals [--n-relays 16] [--context-layers 2,12]

``--variants`` runs variants of the context rule on the *calibration* relays at equal
reuse (first-token KL): one cap per request (shipped) vs one per span; recomputing the
chosen tokens from a deeper layer's stored stream, or only up to a layer below the last;
pooling the heads' masses by max, top-4 mean or RMS instead of the mean; weighting the
mass by the attention a token received from the later output tokens; propagating it
through the output's own attention (a token that attended to high-mass output tokens
inherits their mass: ``m' = m + A m'``); and counting the upstream prompt text that the
downstream prompt repeats (shared 4-grams) at half weight.

    python research/studies/selection_study.py --variants [--n-relays 16] [--targets 0.9,0.95]

``--kl-oracle`` estimates how low *any* recompute-or-reuse choice per token can go: on
each evaluation relay it picks the tokens that lower that relay's own first-token KL most
when given their exact KV, greedily in ``--rounds`` steps by the gradient of the KL with
respect to a per-token mix between the reused and the exact KV (all layers), i.e. it
optimises the very number it is scored on, with the exact prefill in hand (greedy, so not
a strict bound). Reported beside the shipped rule and a downstream-aware rule (the context
mass times the attention the last prompt row gives a token in a cheap probe pass) at the
same per-request budget.

    python research/studies/selection_study.py --kl-oracle [--n-relays 16] [--targets 0.9,0.95]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from sglang_relay.bench.evaluation import FRONTIER_WORKLOADS, default_cache_dir, prepare_usable
from sglang_relay.bench.workload import GenSettings, load_relay, load_workload, model_fingerprint
from sglang_relay.core import reference as ref_exec
from sglang_relay.core.attention import attention_probs, positional_causal_attention
from sglang_relay.core.config import RelayConfig, load_profile
from sglang_relay.core.operating import at_target
from sglang_relay.core.selection import probe_layers, probed_mass
from sglang_relay.runtime.config.settings import shipped_profile

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
    out = torch.zeros(num_l, total, ref.num_kv_heads)
    mask = torch.arange(total)[None, :] <= rows[:, None]  # [n, T]
    for lid, layer in enumerate(ref.layers):
        x = layer.input_layernorm(hidden[lid, rows])
        q, _, _ = ref.qkv(layer, x, rows)  # [n, Hq, D]
        probs = attention_probs(q, cache.k[lid], mask, ref.scale)
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


def evaluate(ref, relay, targets, shipped: RelayConfig):
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
        # the shipped rule (one cap per request), and the same tokens given their exact KV
        cfg = at_target(shipped, ref.num_layers, t)
        rec = ref_exec.relay_prefill(ref, relay.prompt, spans, cfg, forced=forced)
        sel = rec.selected_mask
        ora = ref_exec.exact_kv_prefill(ref, relay.prompt, spans, exact, sel, forced=forced)
        for how, res in (("recomputed", rec), ("exact KV", ora)):
            f = ref_exec.fidelity(exact.logits, res.logits, relay.continuation)
            out[f"{t:.2f}|shipped context rule|{how}"] = (
                res.reuse_rate, f["first_token_kl"], f["tf_top1"]
            )  # fmt: skip
    return out


def mixed_first_logits(ref, ids, span_rows, base, exact, m):
    """Last-row logits of prompt ``ids`` whose span rows hold ``base + m (exact - base)`` as
    KV in every layer (``base``/``exact``: ``(K, V)`` ``[L, S, H_kv, D]``; ``m`` ``[S]``), the
    other rows computed from their embeddings; out of place, so differentiable in ``m``."""
    total = len(ids)
    dev = ref.device
    normal = torch.ones(total, dtype=torch.bool, device=dev)
    normal[span_rows] = False
    rows = torch.arange(total, device=dev)[normal]
    if int(rows[-1]) != total - 1:
        raise ValueError("the prompt must end outside the spans")
    h = ref.embed(torch.tensor(ids, dtype=torch.long, device=dev)[rows])
    w = m[:, None, None]
    for lid, layer in enumerate(ref.layers):
        q, k, v = ref.qkv(layer, layer.input_layernorm(h), rows)
        full = []
        for mine, b, e in ((k, base[0][lid], exact[0][lid]), (v, base[1][lid], exact[1][lid])):
            z = mine.new_zeros(total, *mine.shape[1:])
            full.append(z.index_put((span_rows,), b + w * (e - b)).index_put((rows,), mine))
        o = positional_causal_attention(q, full[0], full[1], rows, ref.scale)
        h = h + layer.self_attn.o_proj(o.reshape(rows.numel(), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return ref.logits(h[-1:])[0]


def kl_oracle_selection(ref, prompt, spans, exact, count: int, rounds: int) -> torch.Tensor:
    """``[S]`` mask of ``count`` span tokens chosen greedily (``rounds`` steps) by the
    gradient of the first-token KL w.r.t. giving each token its exact KV."""
    span_rows = ref_exec._span_rows(spans, ref.device)
    cache = ref_exec.KVCache.empty(ref, len(prompt))
    ref_exec._splice(ref, cache, spans, span_rows)
    with torch.inference_mode(False), torch.enable_grad():  # the callers run in inference mode
        chosen = torch.zeros(span_rows.numel(), dtype=torch.bool, device=ref.device)
        base = (cache.k[:, span_rows].clone(), cache.v[:, span_rows].clone())
        target = (exact.cache.k[:, span_rows].clone(), exact.cache.v[:, span_rows].clone())
        p = torch.log_softmax(exact.logits[0].double(), -1).clone()
        rows = span_rows.clone()
        for r in range(rounds):
            take = (count * (r + 1)) // rounds - int(chosen.sum())
            if take <= 0:
                continue
            m = chosen.float().requires_grad_(True)
            logits = mixed_first_logits(ref, list(prompt), rows, base, target, m)
            q = torch.log_softmax(logits.double(), -1)
            (grad,) = torch.autograd.grad((p.exp() * (p - q)).sum(), m)
            gain = -grad
            gain[chosen] = float("-inf")
            chosen[gain.topk(take).indices] = True
    return chosen.clone()


# the powers of the last-row probe's attention tried on the calibration relays (0.25 had
# the lower KL there; the reference's ``cfg.probe`` rule)
PROBE_POWERS = (0.5, 0.25)


def kl_oracle(ref, relay, targets, shipped: RelayConfig, rounds: int) -> dict[str, tuple]:
    """Per target: the shipped rule (recomputed, exact KV), the KL oracle's tokens, and the
    context mass times a power of the last prompt row's attention in a probe of
    1 row (``ref_exec.last_row_probe``, mean over the upper half of the layers; the probe's
    row charged to the budget): all at the shipped rule's own count of recomputed tokens."""
    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    num_l = ref.num_layers
    mass = ref_exec.span_context_mass(ref, spans, shipped.l_ctx)
    # the last prompt row's attention in a 1-row probe, mean over the upper half of the layers
    att = ref_exec.last_row_probe(ref, relay.prompt, spans)[list(probe_layers(num_l))].mean(0)
    out = {}

    def row(res):
        f = ref_exec.fidelity(exact.logits, res.logits, relay.continuation)
        return (res.reuse_rate, f["first_token_kl"], f["tf_top1"])

    for t in targets:
        cfg = at_target(shipped, ref.num_layers, t)
        rec = ref_exec.relay_prefill(ref, relay.prompt, spans, cfg, forced=forced)
        sel = rec.selected_mask
        out[f"{t:.2f}|shipped context rule|recomputed"] = row(rec)
        out[f"{t:.2f}|shipped context rule|exact KV"] = row(
            ref_exec.exact_kv_prefill(ref, relay.prompt, spans, exact, sel, forced=forced)
        )
        best = kl_oracle_selection(ref, relay.prompt, spans, exact, int(sel.sum()), rounds)
        out[f"{t:.2f}|KL oracle|exact KV"] = row(
            ref_exec.exact_kv_prefill(ref, relay.prompt, spans, exact, best, forced=forced)
        )
        out[f"{t:.2f}|KL oracle|recomputed"] = row(
            ref_exec.relay_prefill(
                ref, relay.prompt, spans, FROM_ZERO, forced=forced, selection=best
            )
        )
        for power in PROBE_POWERS:
            name = f"context mass x last-row attention^{power}"
            count = max(int(sel.sum()) - 1, 0)  # the probe's row is charged
            probe = per_span_top(probed_mass(mass, att, power), [count], [mass.numel()])
            out[f"{t:.2f}|{name}|recomputed"] = row(
                ref_exec.relay_prefill(
                    ref, relay.prompt, spans, FROM_ZERO, forced=forced, selection=probe
                )
            )
            out[f"{t:.2f}|{name}|exact KV"] = row(
                ref_exec.exact_kv_prefill(ref, relay.prompt, spans, exact, probe, forced=forced)
            )
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (x.float().argsort().argsort().float() for x in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def signals(ref, relay, context_layers: list[int]) -> dict[str, float]:
    """Spearman of each signal with the true value deviation over one relay's span tokens."""
    from sglang_relay.core.selection import kv_deviation

    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    truth = ref_exec.true_value_deviation(ref, spans, exact)
    num_l = ref.num_layers

    def per_span(fn) -> torch.Tensor:  # fn(record) -> [n_record] scores, sliced per span
        return torch.cat([fn(s.record)[s.span_start : s.span_start + s.length] for s in spans])

    def no_context(rec) -> torch.Tensor:  # the span's KV behind only the first prompt token
        v = ref_exec.exact_prefill(ref, rec.prompt[:1] + rec.span_tokens).cache.v[:, 1:]
        return torch.stack([kv_deviation(v[i], rec.v[i]) for i in range(num_l)]).mean(0)

    detector = RelayConfig(l_start=3, l_det=4, l_end=-1, first_k=0, l_suf=0)
    found = {
        "position (earlier first)": -torch.cat([torch.arange(s.length) for s in spans]).float(),
        "value deviation at 4 after dense 3": ref_exec.relay_prefill(
            ref, relay.prompt, spans, detector, forced=forced
        ).deviation,
        "influence (mean over layers)": per_span(lambda r: r.influence.mean(1)),
        "context mass, mean over layers": per_span(
            lambda r: torch.stack(
                [ref_exec.record_context_mass(ref, r, i) for i in range(num_l)]
            ).mean(0)
        ),
        "deviation with no context (a second prefill)": per_span(no_context),
    }
    for layer in context_layers:
        found[f"context mass at {layer}"] = per_span(
            lambda r, layer=layer: ref_exec.record_context_mass(ref, r, layer)
        )
    return {name: spearman(score, truth) for name, score in found.items()}


def head_scores(ref, rec, layer: int, shared: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[n]`` alternatives to the context mass of ``rec``'s output tokens at ``layer``
    (the same decode queries and keys as :func:`~sglang_relay.core.reference.
    record_context_mass`, pooled otherwise over the query heads). ``shared``: ``[P]`` bool,
    the upstream prompt positions whose text the downstream prompt also holds."""
    q, keys, pos = ref_exec.record_decode_queries(ref, rec, layer)
    p, n = len(rec.prompt), q.shape[0]
    visible = torch.arange(p + n)[None, :] <= pos[:, None]
    probs = attention_probs(q.float(), keys.float(), visible, ref.scale)
    probs = probs.reshape(n, -1, p + n)  # [n, H_q, T]
    per_head = probs[..., 1:p].sum(-1)
    mean = probs.mean(1)  # [n, T]
    received = mean[:, p:].sum(0)  # from every later output query
    # mass reached through earlier output tokens too: m' = m + A m' (A: the head-mean
    # attention among output tokens, strictly causal), a rollout of the context mass
    inner = mean[:, p:].tril(-1)
    rollout = torch.linalg.solve_triangular(
        torch.eye(n) - inner, mean[:, 1:p].sum(-1, keepdim=True), upper=False
    ).squeeze(1)
    weight = torch.where(shared, 0.5, 1.0)  # text the new prompt repeats counts half
    weight[0] = 0.0
    return {
        "heads pooled by max": per_head.max(1).values,
        "heads pooled by top-4 mean": per_head.topk(min(4, per_head.shape[1]), 1).values.mean(1),
        "heads pooled by RMS": per_head.pow(2).mean(1).sqrt(),
        "mass x received^0.5": per_head.mean(1) * received.clamp_min(1e-9).sqrt(),
        "mass propagated through the output (rollout)": rollout,
        "repeated prompt text counted half": (mean[:, :p] * weight).sum(-1),
    }


def repeated_text(upstream: list[int], downstream: list[int], skip: torch.Tensor, g: int = 4):
    """``[len(upstream)]`` bool: upstream prompt positions inside a ``g``-gram that also
    occurs in ``downstream`` outside the rows ``skip`` (the relayed spans)."""
    skipped = set(skip.tolist())
    grams = {
        tuple(downstream[i : i + g])
        for i in range(len(downstream) - g + 1)
        if not skipped.intersection(range(i, i + g))
    }
    out = torch.zeros(len(upstream), dtype=torch.bool)
    for i in range(len(upstream) - g + 1):
        if tuple(upstream[i : i + g]) in grams:
            out[i : i + g] = True
    return out


def context_variants(ref, relay, targets, layer: int) -> dict[str, float]:
    """First-token KL of context-rule variants on one relay, at every target."""
    from dataclasses import replace

    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    total = sum(s.length for s in spans)
    num_l = ref.num_layers
    base = RelayConfig(l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=layer,
                       tau_dev=0.0, l_suf=0, first_k=0, budget="request")  # fmt: skip
    rules = {
        "one cap per request (shipped)": base,
        "one cap per span": replace(base, budget="span"),
        f"recomputed from layer {layer} (stored stream)": replace(base, l_start=layer, l_det=layer),
        "recomputed from layer 6 (stored stream)": replace(base, l_start=6, l_det=6),
        f"recomputed up to layer {num_l - 5}": replace(base, l_end=num_l - 5),
        f"recomputed up to layer {num_l - 10}": replace(base, l_end=num_l - 10),
    }  # fmt: skip
    scores: dict[str, list[torch.Tensor]] = {}
    span_rows = ref_exec._span_rows(spans, "cpu")
    for s in spans:
        shared = repeated_text(s.record.prompt, list(relay.prompt), span_rows)
        for name, score in head_scores(ref, s.record, layer, shared).items():
            scores.setdefault(name, []).append(score[s.span_start : s.span_start + s.length])

    def kl(res) -> float:
        return ref_exec.fidelity(exact.logits, res.logits, relay.continuation)["first_token_kl"]

    out = {}
    for t in targets:
        for name, cfg in rules.items():
            cfg = at_target(cfg, num_l, t)
            out[f"{t:.2f}|{name}"] = kl(
                ref_exec.relay_prefill(ref, relay.prompt, spans, cfg, forced=forced)
            )
        count = int(at_target(base, num_l, t).max_ratio * total)
        for name, parts in scores.items():
            sel = per_span_top(torch.cat(parts), [count], [total])
            out[f"{t:.2f}|{name}"] = kl(
                ref_exec.relay_prefill(
                    ref, relay.prompt, spans, FROM_ZERO, forced=forced, selection=sel
                )
            )
    return out


def probe_variants(ref, relay, targets, shipped: RelayConfig) -> dict[str, float]:
    """First-token KL of last-row-probe score variants on one relay, per target, all at the
    shipped probe rule's count (the cap minus the probe's row), recomputed from the
    embeddings as a server does."""
    forced = relay.continuation[:-1]
    exact = ref_exec.exact_prefill(ref, relay.prompt, forced=forced)
    spans = sorted(relay.spans, key=lambda s: s.prompt_start)
    lengths = [s.length for s in spans]
    total = sum(lengths)
    num_l = ref.num_layers
    mass = ref_exec.span_context_mass(ref, spans, shipped.l_ctx)
    att = ref_exec.last_row_probe(ref, relay.prompt, spans, heads=True)  # [L, Hq, S]
    _, src_v = ref_exec._upstream_kv(spans)  # [L, S, Hkv, D]
    group = att.shape[1] // src_v.shape[2]
    vnorm = src_v.float().norm(dim=-1).repeat_interleave(group, dim=2).transpose(1, 2)
    upper = list(probe_layers(num_l))
    top = list(range(3 * num_l // 4, num_l))
    plain = att[upper].mean((0, 1))
    first = torch.zeros(total, dtype=torch.bool)
    lo = 0
    for n in lengths:
        first[lo] = True
        lo += n

    def rank(x: torch.Tensor) -> torch.Tensor:
        return x.argsort().argsort().float() / max(x.numel() - 1, 1)

    scores = {
        "probe^0.25 (shipped)": probed_mass(mass, plain, 0.25),
        "probe^0.5": probed_mass(mass, plain, 0.5),
        "probe^1": probed_mass(mass, plain, 1.0),
        "probe^0.25, all layers": probed_mass(mass, att.mean((0, 1)), 0.25),
        "probe^0.25, top quarter layers": probed_mass(mass, att[top].mean((0, 1)), 0.25),
        "probe^0.25, value-weighted": probed_mass(mass, (att * vnorm)[upper].mean((0, 1)), 0.25),
        "probe^0.5, value-weighted": probed_mass(mass, (att * vnorm)[upper].mean((0, 1)), 0.5),
        "probe^0.25, head max": probed_mass(mass, att[upper].amax(1).mean(0), 0.25),
        "probe^0.25, layer max": probed_mass(mass, att[upper].mean(1).amax(0), 0.25),
        "rank(mass) + rank(probe)": rank(mass) + rank(plain),
        "probe^0.25 + span's first token": probed_mass(mass, plain, 0.25) + first * 1e9,
    }

    def kl(sel) -> float:
        res = ref_exec.relay_prefill(
            ref, relay.prompt, spans, FROM_ZERO, forced=forced, selection=sel
        )
        return ref_exec.fidelity(exact.logits, res.logits, relay.continuation)["first_token_kl"]

    out = {}
    for t in targets:
        count = max(int(at_target(shipped, num_l, t).max_ratio * total) - 1, 0)
        for name, score in scores.items():
            out[f"{t:.2f}|{name}"] = kl(per_span_top(score, [count], [total]))
    return out


def print_kl_table(ref, tok, fingerprint, args, workload: str, per_relay, title: str, col: str):
    """Run ``per_relay(relay) -> {"target|name": KL}`` on ``workload``'s first usable relays
    and print one markdown row per key: mean / median first-token KL."""
    cases = load_workload(None, name=workload)
    usable, _ = prepare_usable(
        ref, tok, cases, args.n_relays, default_cache_dir(), fingerprint, GenSettings()
    )
    rows: dict[str, list[float]] = {}
    with torch.inference_mode():
        for case, path in usable:
            for key, value in per_relay(load_relay(path, case)).items():
                rows.setdefault(key, []).append(value)
    print(f"\n{workload} ({len(usable)} relays){title}\n")
    print(f"| target | {col} | first-token KL mean / median |")
    print("|---|---|---|")
    for key, vals in rows.items():
        t, name = key.split("|")
        mean, med = statistics.mean(vals), statistics.median(vals)
        print(f"| {t} | {name} | {mean:.4f} / {med:.4f} |", flush=True)


def main_probe_variants(ref, tok, fingerprint, args) -> int:
    from sglang_relay.embedded_model import ensure_model

    shipped, _ = load_profile(shipped_profile(str(ensure_model())))
    targets = [float(x) for x in args.targets.split(",")]
    for wl in args.workloads.split(","):
        print_kl_table(
            ref, tok, fingerprint, args, wl,
            lambda relay: probe_variants(ref, relay, targets, shipped), "", "probe score",
        )  # fmt: skip
    return 0


def main_variants(ref, tok, fingerprint, args) -> int:
    targets = [float(x) for x in args.targets.split(",")]
    layer = int(args.context_layers.split(",")[-1])
    print_kl_table(
        ref, tok, fingerprint, args, "calibration_workload.jsonl",
        lambda relay: context_variants(ref, relay, targets, layer),
        f", context mass at {layer}", "variant",
    )  # fmt: skip
    return 0


def main_signals(ref, tok, fingerprint, args) -> int:
    cases = load_workload(None, name="calibration_workload.jsonl")
    usable, _ = prepare_usable(
        ref, tok, cases, args.n_relays, default_cache_dir(), fingerprint, GenSettings()
    )
    layers = [int(x) for x in args.context_layers.split(",")]
    rows: dict[str, list[float]] = {}
    with torch.inference_mode():
        for case, path in usable:
            for name, rho in signals(ref, load_relay(path, case), layers).items():
                rows.setdefault(name, []).append(rho)
    print(f"\ncalibration_workload.jsonl ({len(usable)} relays)\n")
    print("| signal | Spearman with the true deviation (mean / median over relays) |")
    print("|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.mean(vals):.3f} / {statistics.median(vals):.3f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-relays", type=int, default=16)
    p.add_argument("--targets", default="0.8,0.9,0.95")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write per-relay rows here")
    p.add_argument("--signals", action="store_true", help="rank signals on calibration relays")
    p.add_argument("--context-layers", default="2,12")
    p.add_argument(
        "--variants", action="store_true", help="context-rule variants on calibration relays"
    )
    p.add_argument(
        "--kl-oracle", action="store_true", help="greedy KL-gradient oracle on evaluation relays"
    )
    p.add_argument("--rounds", type=int, default=5, help="--kl-oracle: greedy steps")
    p.add_argument("--probe-variants", action="store_true", help="last-row probe score variants")
    p.add_argument("--workloads", default="calibration_workload.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model

    targets = [float(x) for x in args.targets.split(",")]
    model_dir = ensure_model()
    ref = ref_exec.load_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    fingerprint = model_fingerprint(model_dir, ref.num_layers)
    if args.signals:
        return main_signals(ref, tok, fingerprint, args)
    if args.variants:
        return main_variants(ref, tok, fingerprint, args)
    if args.probe_variants:
        return main_probe_variants(ref, tok, fingerprint, args)
    shipped, _ = load_profile(shipped_profile(str(model_dir)))
    per: dict[str, dict[str, list]] = {}
    for wl in FRONTIER_WORKLOADS:
        cases = load_workload(None, name=wl)
        usable, _ = prepare_usable(
            ref, tok, cases, args.n_relays, default_cache_dir(), fingerprint, GenSettings()
        )
        rows: dict[str, list] = {}
        with torch.inference_mode():
            for i, (case, path) in enumerate(usable):
                relay = load_relay(path, case)
                rows_of = (
                    kl_oracle(ref, relay, targets, shipped, args.rounds)
                    if args.kl_oracle
                    else evaluate(ref, relay, targets, shipped)
                )
                for key, row in rows_of.items():
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
