"""What `--relay-lora shared` costs: relaying a span decoded under one LoRA adapter into a
request under another, against relaying it within one adapter (docs/fidelity.md, "LoRA").

Offline, on the reference executor: two random rank-8 adapters on every linear of the
embedded model (``bench.models.random_lora_adapter``), each merged into a copy of the model.
For each task an upstream reply is decoded under adapter a and under adapter b; a
downstream prompt pastes it; the request runs under adapter b. *Within*: b's own reply,
b's decode KV. *Across*: a's reply with a's decode KV (what ``shared`` reuses). Both
against b's exact prefill of the same prompt, under the unprofiled rule at reuse 0.80 (a
deviation rule: no context masses, which the server computes with the base weights).

    python research/studies/lora_shared_cost.py [--threads 2] [--std 0.03]

Random adapters (std 0.03 on A and B) are a stand-in: trained adapters of one base may be
closer to each other or further apart; the figures bound nothing for them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import mean, median

import torch

TASKS = [
    "Summarise why unit tests matter.", "List three uses of a hash map.",
    "Explain recursion to a beginner.", "Describe a good code review.",
    "Give tips for naming variables.", "Explain what a race condition is.",
    "Outline a REST API for a todo app.", "Why is caching hard?",
    "Describe the steps to debug a crash.", "Explain big-O notation briefly.",
    "What makes an error message useful?", "Plan a database migration.",
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--std", type=float, default=0.03, help="adapter strength (A, B entries)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_relay.bench.models import merged_lora_model, random_lora_adapter
    from sglang_relay.bench.workload import chat_ids
    from sglang_relay.core import reference as R
    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.config.settings import settings_from_env

    model = Path(ensure_model())
    tok = AutoTokenizer.from_pretrained(model)
    eos = [tok.eos_token_id]
    root = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    refs = {}
    for name, seed in (("a", 1), ("b", 2)):
        pairs = random_lora_adapter(model, root / name, seed=seed, std=args.std)
        refs[name] = R.load_model(str(merged_lora_model(model, root / f"merged-{name}", pairs)))
    settings = settings_from_env("Unprofiled-Base", {})
    cfg = settings.point(settings.reuse_target, refs["b"].num_layers).config
    rows = {"within": [], "across": []}
    # the downstream chat prompt, the reply pasted into its user turn as token ids
    text = tok.apply_chat_template(
        [{"role": "system", "content": "You are a reviewer."},
         {"role": "user", "content": "Review this answer:\n\nSPAN\n\nOne improvement, briefly."}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    head, tail = (tok(t, add_special_tokens=False).input_ids for t in text.split("SPAN"))
    for task in TASKS:
        up = chat_ids(tok, "You are a helpful engineer.", task)
        recs = {n: R.generate(refs[n], [up], 96, stop_ids=eos)[0] for n in ("a", "b")}
        for kind, source in (("within", "b"), ("across", "a")):
            rec = recs[source]
            span = rec.span_tokens
            prompt = head + span + tail
            occ = R.SpanOccurrence(len(head), rec, 0, len(span))
            exact = R.exact_prefill(refs["b"], prompt).logits[-1].double().log_softmax(-1)
            got = R.relay_prefill(refs["b"], prompt, [occ], cfg)
            lp = got.logits[-1].double().log_softmax(-1)
            kl = float((exact.exp() * (exact - lp)).sum())
            rows[kind].append((kl, int(exact.argmax() == lp.argmax()), got.reuse_rate))
    print(f"{len(TASKS)} relays, adapters std {args.std}, unprofiled rule, reuse 0.80")
    print("kind     KL mean  KL median  top-1  reuse")
    for kind, r in rows.items():
        kls = [x[0] for x in r]
        top1 = mean(x[1] for x in r)
        reuse = mean(x[2] for x in r)
        print(f"{kind:8} {mean(kls):.4f}   {median(kls):.4f}     {top1:.3f}  {reuse:.3f}")


if __name__ == "__main__":
    main()
