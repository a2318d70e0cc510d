"""Fidelity of relaying a reasoning model's answer without its reasoning (issue 28 item 3).

A reasoning model decodes ``<think> R </think> A``; a framework pastes only ``A`` into the
next agent's prompt. The answer's KV was decoded with ``R`` in context, which the downstream
prompt lacks, so more of it may need recomputing than a plain answer's. Offline, on the
reference executor (fp32, embedded model), per question:

* **reasoning**: ``R`` is the model's own greedy step-by-step text for the question (it
  does not reason by itself), placed inside ``<think> ... </think>`` after the question;
  ``A`` is then decoded greedily with ``R`` in context (its decode KV recorded);
* **plain**: the answer decoded for the question alone (what relay relays today).

Each answer is pasted into the same reviewer prompt (token-exact, between a head and a
tail) and relayed with the shipped profile's operating points; measured against exact
prefill of the same prompt: first-token KL (mean / median), first-token top-1 agreement,
teacher-forced top-1 and greedy agreement over 32 tokens, with bootstrap 95 % intervals;
the paired difference reasoning - plain per reuse tells whether reasoning answers need a
lower reuse target. The context rule's masses count everything before the answer (the
question and the reasoning) as context that a paste replaces, as the server does for
spans recorded with a reasoning part.

    python research/studies/reasoning_fidelity.py [--n 32] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

QUESTIONS = [
    "How should a small team choose between a monolith and microservices?",
    "Why does a hash map need a good hash function?",
    "How do you find the median of two sorted arrays?",
    "What is the best way to store passwords in a database?",
    "How can a city reduce traffic congestion downtown?",
    "Why do bridges have expansion joints?",
    "How would you design a rate limiter for an API?",
    "What makes a good unit test?",
    "How do vaccines train the immune system?",
    "How should I plan a three-day trip to Rome?",
    "Why is the sky blue during the day and red at sunset?",
    "How do you detect a cycle in a linked list?",
    "What are the trade-offs of caching database queries?",
    "How can a farmer improve soil health?",
    "How does binary search work and when does it fail?",
    "What should a beginner learn first in Python?",
    "How do you estimate the number of piano tuners in a city?",
    "Why do some programs leak memory?",
    "How should a library organise its books?",
    "What is the difference between a process and a thread?",
    "How can a small shop compete with online retailers?",
    "How do you merge two sorted lists efficiently?",
    "Why do leaves change colour in autumn?",
    "How would you test a calculator application?",
    "What causes inflation in an economy?",
    "How do you reverse the words in a sentence in code?",
    "How should a school schedule its exams?",
    "Why are prime numbers important in cryptography?",
    "How do you choose a database index?",
    "How can a runner prepare for a first marathon?",
    "What is a race condition and how do you avoid it?",
    "How do solar panels turn light into electricity?",
    "How would you summarise a long meeting for your team?",
    "Why does recursion need a base case?",
    "How do you pick a good name for a variable?",
    "How can a hospital reduce waiting times?",
    "What is the purpose of a load balancer?",
    "How do you compute the factorial of a large number?",
    "Why do airplanes fly?",
    "How should you review someone else's code?",
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=32, help="questions (<= 40)")
    p.add_argument("--targets", default="0.6,0.7,0.8,0.9")
    p.add_argument(
        "--caps",
        default="",
        help="also relay with the lowest target's rule at these recompute caps (max_ratio, "
        "comma list): reuse below the profile's range",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sglang_relay.bench.intervals import bootstrap_ci, paired_ci
    from sglang_relay.core import reference as R
    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.config.settings import settings_from_env

    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    model = ensure_model()
    tok = AutoTokenizer.from_pretrained(model)
    ref = R.load_model(str(model))
    settings = settings_from_env(str(model), {})
    targets = [float(t) for t in args.targets.split(",")]
    configs = {t: settings.point(t, ref.num_layers).config for t in targets}
    from dataclasses import replace

    lowest = configs[min(targets)]
    for cap in [float(c) for c in args.caps.split(",") if c]:
        key = round(1.0 - cap, 3)  # keyed by the reuse the cap aims at
        configs[key] = replace(lowest, max_ratio=cap)
        targets.append(key)
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    def chat(system: str, user: str) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return ids(text)

    head = ids("<|im_start|>system\nYou are a careful reviewer.<|im_end|>\n<|im_start|>user\n"
               "Review this answer:\n\n")  # fmt: skip
    tail = ids("\n\nList its mistakes and say how to fix them.<|im_end|>\n<|im_start|>assistant\n")
    rows: dict[str, dict[float, list[dict]]] = {"reasoning": {}, "plain": {}}
    for q in QUESTIONS[: args.n]:
        ask = chat("Think inside <think></think>, then answer.", q)
        think = R.generate(ref, [chat("You think step by step.", q + " Think it through.")], 128,
                           stop_ids=[eos], min_new_tokens=96, capture=False)[0]  # fmt: skip
        reasoning = [t for t in think.output if t != eos]
        with_r = ask + ids("<think>\n") + reasoning + ids("\n</think>\n\n")
        recs = {
            "reasoning": R.generate(ref, [with_r], 97, stop_ids=[eos], min_new_tokens=97)[0],
            "plain": R.generate(ref, [ask], 97, stop_ids=[eos], min_new_tokens=97)[0],
        }
        for kind, rec in recs.items():
            span = rec.span_tokens  # 96 tokens with decode KV
            prompt = head + span + tail
            occ = R.SpanOccurrence(len(head), rec, 0, len(span))
            exact = R.exact_prefill(ref, prompt)
            cont = R.greedy_continue(ref, exact, 32)
            exact_tf = R.teacher_forced(ref, exact, cont)
            for t, cfg in configs.items():
                res = R.relay_prefill(ref, prompt, [occ], cfg)
                m = R.fidelity(exact_tf, R.teacher_forced(ref, res, cont), cont)
                m["reuse"] = res.reuse_rate
                rows[kind].setdefault(t, []).append(m)
    out = {"questions": args.n, "targets": targets, "rows": rows, "table": []}
    print("| answers | target | reuse | KL mean [95 %] | KL median | top-1 | TF top-1 (32) "
          "| greedy (32) |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for t in targets:
        for kind in ("plain", "reasoning"):
            r = rows[kind][t]
            kl = [x["first_token_kl"] for x in r]
            lo, hi = bootstrap_ci(kl)
            line = {
                "kind": kind, "target": t, "reuse": float(np.mean([x["reuse"] for x in r])),
                "kl_mean": float(np.mean(kl)), "kl_ci": [lo, hi], "kl_median": float(np.median(kl)),
                "top1": float(np.mean([x["top1"] for x in r])),
                "tf_top1": float(np.mean([x["tf_top1"] for x in r])),
                "greedy": float(np.mean([x["greedy_prefix"] for x in r])),
            }  # fmt: skip
            out["table"].append(line)
            print(f"| {kind} | {t:.2f} | {line['reuse']:.3f} | {line['kl_mean']:.4f} "
                  f"[{lo:.4f}, {hi:.4f}] | {line['kl_median']:.4f} | {line['top1']:.3f} | "
                  f"{line['tf_top1']:.3f} | {line['greedy']:.3f} |")  # fmt: skip
    print("\npaired reasoning - plain, mean KL [95 %]:")
    for t in targets:
        a = [x["first_token_kl"] for x in rows["reasoning"][t]]
        b = [x["first_token_kl"] for x in rows["plain"][t]]
        lo, hi = paired_ci(a, b)
        print(f"  {t:.2f}: {np.mean(a) - np.mean(b):+.4f} [{lo:+.4f}, {hi:+.4f}]")
    print(f"\n{args.n} questions, {time.perf_counter() - started:.0f} s, {args.threads} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
