"""Context mass with the mass carried through earlier output tokens (docs/fidelity.md, "The
demo's Reviewer": a rule variant measured, not adopted).

The context rule ranks a span token by the attention its decode query put on the upstream
prompt (its *direct* context mass ``d``). A late output token attends mostly to earlier
output tokens, whose KV carries the prompt in turn; the carried mass adds that path,
``m_t = d_t + gamma * sum_{s < t} a_{t,s} m_s`` (``a``: the token's attention on earlier
output tokens at the same layer, heads averaged; ``gamma = 1`` is attention rollout over
one layer, ``0`` the direct mass). Solved as one lower-triangular system per upstream
output. Offline, reference executor, the shipped points (0.80 / 0.90 / 0.95):

1. the demo Reviewer (``demo_collapse_study.reviewer_relay``): first-token KL, P(end of
   turn | three backticks), greedy reply;
2. a workload (default: the calibration relays), every user-visible measure per point
   and signal, with the paired bootstrap interval of (carried - direct).

    python research/studies/context_carry_study.py [--gammas 0.5,1] \
        [--workload heldout72_workload.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

MEASURES = ("first_token_kl", "top1", "tf_top1", "greedy_prefix", "collapsed", "rouge_l")


def carried_masses(ref, rec, layer: int, gammas: list[float]) -> dict[str, torch.Tensor]:
    """``{"direct": d, "g<gamma>": m, ...}``, each ``[n]`` over the record's span tokens."""
    from sglang_relay.core.attention import attention_probs
    from sglang_relay.core.reference.relay import record_decode_queries

    q, keys, pos = record_decode_queries(ref, rec, layer)
    p, n, t = len(rec.prompt), q.shape[0], keys.shape[0]
    visible = torch.arange(t)[None, :] <= pos[:, None]
    probs = attention_probs(q.float(), keys.float(), visible, ref.scale).mean(dim=(1, 2))
    direct = probs[:, 1:p].sum(-1).detach()  # position 0 (the sink) excluded, as the rule does
    earlier = torch.tril(probs[:, p:], diagonal=-1).double().detach()
    eye = torch.eye(n, dtype=torch.float64)
    out = {"direct": direct}
    for g in gammas:
        m = torch.linalg.solve_triangular(eye - g * earlier, direct.double()[:, None], upper=False)
        out[f"g{g}"] = m[:, 0].float()
    return out


def use_signal(records, layer: int, masses: dict[int, dict], kind: str) -> None:
    """Put ``kind``'s masses where the reference executor reads context masses."""
    for rec in records:
        rec.context.clear()
        rec.context[layer] = masses[id(rec)][kind]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gammas", default="0.5,1")
    p.add_argument("--workload", default="calibration_workload.jsonl")
    p.add_argument("--limit", type=int, default=None, help="first N usable relays only")
    p.add_argument("--no-demo", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from demo_collapse_study import reviewer_relay
    from sglang_relay.bench.evaluation import (
        default_cache_dir,
        evaluate_relay,
        prepare_usable,
        shipped_profile_path,
    )
    from sglang_relay.bench.intervals import paired_ci
    from sglang_relay.bench.workload import (
        GenSettings,
        load_relay,
        load_workload,
        model_fingerprint,
    )
    from sglang_relay.core.config import load_profile
    from sglang_relay.core.operating import Frontier
    from sglang_relay.core.reference import (
        exact_prefill,
        greedy_continue,
        load_model,
        relay_prefill,
    )
    from sglang_relay.embedded_model import ensure_model

    gammas = [float(g) for g in args.gammas.split(",")]
    kinds = ["direct"] + [f"g{g}" for g in gammas]
    model = ensure_model()
    tok = AutoTokenizer.from_pretrained(model)
    ref = load_model(str(model))
    eos = tok.eos_token_id
    base, data = load_profile(shipped_profile_path(model))
    frontier = Frontier.from_profile(data)
    points = {f"{t}": frontier.point(base, t, ref.num_layers).config for t in (0.8, 0.9, 0.95)}
    layer = points["0.8"].context_layer(ref.num_layers)

    if not args.no_demo:
        prompt, spans, records = reviewer_relay(ref, tok)
        masses = {id(r): carried_masses(ref, r, layer, gammas) for r in records}
        ticks = tok("```", add_special_tokens=False).input_ids
        exact = F.log_softmax(exact_prefill(ref, prompt).logits[-1].double(), -1)
        print("| point | signal | KL first token | P(end | ```) | greedy |\n|---|---|---|---|---|")
        for t, cfg in points.items():
            for kind in kinds:
                use_signal(records, layer, masses, kind)
                free = relay_prefill(ref, prompt, spans, cfg)
                ticked = relay_prefill(ref, prompt, spans, cfg, forced=ticks)
                kl = float(
                    (exact.exp() * (exact - F.log_softmax(free.logits[-1].double(), -1))).sum()
                )
                p_end = float(F.softmax(ticked.logits[-1].double(), -1)[eos])
                reply = tok.decode(greedy_continue(ref, free, 8, [eos]))
                print(f"| {t} | {kind} | {kl:.4f} | {p_end:.3f} | {reply!r} |", flush=True)

    cases = load_workload(None, name=args.workload)
    fingerprint = model_fingerprint(model, ref.num_layers)
    usable, _ = prepare_usable(ref, tok, cases, args.limit, default_cache_dir(), fingerprint,
                               GenSettings(), progress=False)  # fmt: skip
    rows: dict[tuple[str, str], list[dict]] = {}
    started = time.perf_counter()
    for case, path in usable:
        relay = load_relay(path, case)
        records = list({id(s.record): s.record for s in relay.spans}.values())
        masses = {id(r): carried_masses(ref, r, layer, gammas) for r in records}
        for kind in kinds:
            use_signal(records, layer, masses, kind)
            for t, row in evaluate_relay(ref, relay, points, stop_ids=[eos]).items():
                rows.setdefault((t, kind), []).append(row)
    print(f"\n{args.workload}: {len(usable)} relays, {time.perf_counter() - started:.0f} s")
    print("| point | signal | " + " | ".join(MEASURES) + " |\n|---|---|" + "---|" * len(MEASURES))
    for t in points:
        for kind in kinds:
            cells = []
            for name in MEASURES:
                values = [r[name] for r in rows[(t, kind)]]
                cell = f"{statistics.fmean(values):.4f}"
                if kind != "direct":
                    lo, hi = paired_ci(values, [r[name] for r in rows[(t, "direct")]])
                    cell += f" [{lo:+.4f}, {hi:+.4f}]"
                cells.append(cell)
            print(f"| {t} | {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
