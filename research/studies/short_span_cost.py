"""Where relay's time goes at short spans (issue 68 item 2): what a layer's matrix products
cost per row as the row count grows, and where the scheduler's samples fall inside relay's
layer loop and its probe.

    python research/studies/short_span_cost.py --json OUT [--pyspy RAW]

``--pyspy RAW``: a ``py-spy record -f raw`` file of the scheduler process while
``bench ttft --phases`` ran relay requests; its samples under ``LayerDriver.run`` are
split by the pass (``run_probe`` or the relay extend) and by what they were doing (the
innermost recognized frame). The matrix-product timing uses the embedded model's four
linear shapes per layer (q/k/v, o, gate/up, down) with random weights.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

# innermost frame name -> category (first match from the leaf up)
CATEGORIES = (
    ("UnquantizedLinearMethod.apply", "linear"),
    ("positional_causal_attention", "attention"),
    ("TorchAttention.run", "attention"),
    ("ProbePlan.attend", "attention"),
    ("attention_probs", "attention"),
    ("softmax_with_sinks", "attention"),
    ("einsum", "attention"),
    ("_set_kv_buffer_impl", "kv write"),
    ("scatter_rows_ref", "row gather/scatter"),
    ("gather_rows_ref", "row gather/scatter"),
    ("RMSNorm", "norms"),
    ("Rotary", "rotary"),
    ("apply_rotary_emb", "rotary"),
    ("silu", "activation"),
    ("SiluAndMul", "activation"),
)


def classify(frames: list[str]) -> str:
    for frame in reversed(frames):
        for key, cat in CATEGORIES:
            if key in frame:
                return cat
    return "other (Python, dispatch)"


def pyspy_shares(path: str) -> dict[str, dict[str, float]]:
    """Per pass (probe, extend): samples and the share of each category."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if "LayerDriver.run" not in stack:
            continue
        frames = stack.split(";")
        inner = frames[next(i for i, f in enumerate(frames) if "LayerDriver.run" in f) :]
        which = "probe" if "run_probe" in stack else "extend"
        counts[which][classify(inner)] += int(n)
    out = {}
    for which, c in counts.items():
        total = sum(c.values())
        out[which] = {"samples": total, **{k: round(v / total, 4) for k, v in c.most_common()}}
    return out


def linear_rows(reps: int = 20) -> list[dict[str, float]]:
    """Time of one layer's four products (SmolLM2-135M shapes) per row count."""
    hidden, inter, q, kv, d = 576, 1536, 9, 3, 64
    shapes = {"qkv": (hidden, (q + 2 * kv) * d), "o": (q * d, hidden),
              "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}  # fmt: skip
    torch.manual_seed(0)
    weights = {k: torch.randn(n, kin) for k, (kin, n) in shapes.items()}
    out = []
    for m in (1, 16, 53, 128, 258, 512, 1077):
        row: dict[str, float] = {"rows": m}
        total = 0.0
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1])
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            t = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(x, w)
            dt = (time.perf_counter() - t) / reps
            row[f"{name}_ms"] = round(1e3 * dt, 4)
            total += dt
        row["layer_ms"] = round(1e3 * total, 4)
        row["us_per_row"] = round(1e6 * total / m, 2)
        row["stack_ms_30_layers"] = round(30e3 * total, 2)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", required=True)
    p.add_argument("--pyspy", help="py-spy raw samples of the scheduler")
    args = p.parse_args()
    result = {"threads": torch.get_num_threads(), "linear_rows": linear_rows()}
    if args.pyspy:
        result["pyspy"] = pyspy_shares(args.pyspy)
    print(json.dumps(result, indent=1))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
