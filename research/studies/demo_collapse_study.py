"""Why the demo's Reviewer collapses under relay (docs/fidelity.md, "The demo's Reviewer").

Offline, on the reference executor: the relay pipeline's Architect and Developer texts
(``data/demo_relay_chain.json``, captured from a relay server) are teacher-forced so their
decode KV is exact; then the Reviewer prompt is relayed with chosen span tokens recomputed
(oracle selections) and under the shipped operating points and rule variants. Reported:
the probability of the end of turn after the reply's first token three backticks, the
first-token KL and the greedy output; which layers of the spans' tails carry that end of
turn (tail tokens recomputed in a band of layers only); then the same with the
Developer's decode KV as a relay server's chain leaves it (its own prompt relayed at the
same point).

    python research/studies/demo_collapse_study.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

DATA = Path(__file__).resolve().parents[2] / "benchmark" / "data" / "demo_relay_chain.json"


def reviewer_relay(ref, tok, chain_cfg=None) -> tuple[list[int], list, list]:
    """``(prompt, span occurrences, upstream records)`` of the relay pipeline's Reviewer:
    the captured Architect and Developer texts teacher-forced (their decode KV exact), the
    Reviewer prompt holding both, its spans found as the server finds them. ``chain_cfg``
    (a RelayConfig): the Developer's prompt is relayed with it (the Architect's text in it
    reused), so the Developer's decode KV is what a relay server's chain leaves, not exact."""
    from sglang_relay.bench.workload import chat_ids, find_spans
    from sglang_relay.core.reference import generate
    from sglang_relay.demo import load_chain

    chain = load_chain(None)
    outs = json.loads(DATA.read_text())["outs"]
    eos = tok.eos_token_id
    texts, records = {"task": chain["task"]}, []
    for agent in chain["agents"][:2]:
        prompt = chat_ids(tok, agent["system"], agent["template"].format(**texts))
        want = tok(outs[agent["name"]], add_special_tokens=False).input_ids + [eos]
        spans = find_spans(prompt, records, 32) if chain_cfg is not None else []
        relayed = [(spans, chain_cfg)] if spans else None
        rec = generate(ref, [prompt], len(want), stop_ids=[eos], force=[want], relayed=relayed)
        records.append(rec[0])
        texts[agent["name"]] = outs[agent["name"]]
    agent = chain["agents"][2]
    prompt = chat_ids(tok, agent["system"], agent["template"].format(**texts))
    return prompt, find_spans(prompt, records, 32), records


def logp(row: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of a logits row, in float64."""
    return F.log_softmax(row.double(), -1)


def embedded():
    """``(model dir, tokenizer, reference model)`` of the embedded model."""
    from transformers import AutoTokenizer

    from sglang_relay.core.reference import load_model
    from sglang_relay.embedded_model import ensure_model

    model = ensure_model()
    return model, AutoTokenizer.from_pretrained(model), load_model(str(model))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from sglang_relay.bench.evaluation import shipped_profile_path
    from sglang_relay.core.config import RelayConfig, load_profile
    from sglang_relay.core.operating import Frontier
    from sglang_relay.core.reference import exact_prefill, greedy_continue, relay_prefill

    model, tok, ref = embedded()
    eos = tok.eos_token_id
    prompt, spans, records = reviewer_relay(ref, tok)
    ticks = tok("```", add_special_tokens=False).input_ids

    def p_end(res) -> float:
        return float(logp(res.logits[-1]).exp()[eos])

    exact = exact_prefill(ref, prompt, forced=ticks)
    exact0 = exact_prefill(ref, prompt)
    print(f"spans {[(s.prompt_start, s.length) for s in spans]}, prompt {len(prompt)} tokens")
    greedy0 = tok.decode(greedy_continue(ref, exact0, 12, [eos]))
    print(f"exact: P(end | ```) {p_end(exact):.3f}, greedy {greedy0!r}")

    lengths = [s.length for s in spans]

    def pick(fn) -> torch.Tensor:
        return torch.cat([torch.tensor([i in set(fn(n)) for i in range(n)]) for n in lengths])

    every = RelayConfig(l_start=0, l_det=0, l_end=-1, top_ratio=1.0, max_ratio=None, l_suf=0)
    oracles = {
        "none (naive)": lambda n: [],
        "first 16 per span": lambda n: range(16),
        "first 32 per span": lambda n: range(32),
        "first 16 + last 16": lambda n: [*range(16), *range(n - 16, n)],
        "last 4 per span": lambda n: range(n - 4, n),
        "last 16 per span": lambda n: range(n - 16, n),
        "tokens 16..n-16": lambda n: range(16, n - 16),
        "all": lambda n: range(n),
    }
    print("\n| recomputed (all layers) | tokens | P(end | ```) |\n|---|---|---|")
    for name, fn in oracles.items():
        sel = pick(fn)
        res = relay_prefill(ref, prompt, spans, every, forced=ticks, selection=sel)
        print(f"| {name} | {int(sel.sum())} | {p_end(res):.3f} |")
    # Which layers of the tail carry the end-of-turn cue: each span's last 8 / 16 tokens
    # recomputed in layers [lo, hi] only (lo > 0: from the upstream's stored hidden state at
    # lo, as relay's l_start does), every other span token and layer reused.
    print("\n| span tail recomputed | layers | token-layers | P(end | ```) |\n|---|---|---|---|")
    for k in (8, 16):
        sel = pick(lambda n, k=k: range(n - k, n))
        for lo, hi in ((0, 3), (0, 5), (0, 7), (0, 9), (0, 15), (2, 7), (4, 7), (8, 29)):
            band = replace(every, l_start=lo, l_det=lo, l_end=hi)
            res = relay_prefill(ref, prompt, spans, band, forced=ticks, selection=sel)
            cost = int(sel.sum()) * (hi - lo + 1)
            print(f"| last {k} of each span | {lo}..{hi} | {cost} | {p_end(res):.3f} |")

    base, data = load_profile(shipped_profile_path(model))
    frontier = Frontier.from_profile(data)
    print("\n| point | variant | reuse | selected | KL first token | P(end | ```) | greedy |")
    print("|---|---|---|---|---|---|---|")
    variants = {"shipped": {}, "l_suf 8": {"l_suf": 8}, "l_suf 16": {"l_suf": 16},
                "l_ctx 2": {"l_ctx": 2}, "l_ctx 20": {"l_ctx": 20}}  # fmt: skip

    def row(target: float, name: str, spans: list, cfg: RelayConfig) -> None:
        res = relay_prefill(ref, prompt, spans, cfg, forced=ticks)
        free = relay_prefill(ref, prompt, spans, cfg)
        p0, q0 = logp(exact0.logits[-1]), logp(free.logits[-1])
        kl = float((p0.exp() * (p0 - q0)).sum())
        greedy = tok.decode(greedy_continue(ref, free, 8, [eos]))
        print(f"| {target:.2f} | {name} | {res.reuse_rate:.3f} | {sum(res.selected)} | "
              f"{kl:.4f} | {p_end(res):.3f} | {greedy!r} |")  # fmt: skip

    points = {t: frontier.point(base, t, ref.num_layers).config for t in (0.8, 0.9, 0.95)}
    for target, point in points.items():
        for name, change in variants.items():
            row(target, name, spans, replace(point, **change))
    # The chain as a relay server runs it: the Developer's prompt (holding the Architect's
    # text) relayed at the same point, so the Developer span's decode KV carries that error.
    print("\n| point | upstream KV | reuse | selected | KL first token | P(end | ```) | greedy |")
    print("|---|---|---|---|---|---|---|")
    for target, point in points.items():
        row(target, "exact decode (above)", spans, point)
        chained, chain_spans, _ = reviewer_relay(ref, tok, point)
        assert chained == prompt  # the same texts: only the Developer span's KV differs
        row(target, "Developer decoded over its relayed prompt", chain_spans, point)


if __name__ == "__main__":
    main()
