"""The all-selected oracle vs standard prefill on a bitsandbytes 8-bit checkpoint, with a
cached standard run and two cache-salted (cold) ones beside it.

    python research/studies/bnb8_oracle_diag.py CHECKPOINT

Build a checkpoint with ``sglang_relay.bench.models.bnb_8bit_checkpoint`` (e.g. of
``random_model("qwen2", ...)`` with ``threshold=0.0``). Findings: research/log.md."""

import sys

sys.path.insert(0, "test/e2e")
from relay_helpers import ALL_SELECTED, generate_ids, running_server  # noqa: E402

RUNS = [
    ("oracle", {"method": "relay", "config": ALL_SELECTED}, {}),
    ("standard", "standard", {}),
    ("standard, salt x", "standard", {"cache_salt": "x"}),
    ("standard, salt y", "standard", {"cache_salt": "y"}),
]

args = ["--model-path", sys.argv[1], "--load-format", "bitsandbytes"]
with running_server([*args, "--max-total-tokens", "8192"]) as s:
    span = generate_ids(s.url, list(range(1048, 1088)), 64)["output_ids"][:-1]
    prompt = list(range(4000, 4017)) + span + list(range(3000, 3011))
    for name, relay, extra in RUNS:
        out = generate_ids(s.url, prompt, 6, relay, return_logprob=True, **extra)
        meta = out["meta_info"]
        logprobs = [round(x[0], 5) for x in meta["output_token_logprobs"]]
        print(f"{name}: tokens {out['output_ids']} logprobs {logprobs}", end=" ")
        print(f"cached {meta['cached_tokens']}")
