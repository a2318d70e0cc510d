"""The tail band on the demo's Reviewer: measured, not adopted (docs/fidelity.md).

A *tail band* recomputes each span's last ``tail_tokens`` tokens in layers
``[0, tail_layers)`` on top of the rule's selection, paid out of the same cap (at most half
of a run's capped token-layers; the selection gets the rest, so the reuse target holds).
The band is not in the package: it lost first-token KL on the calibration relays at every
point. To re-run the measurement, apply the reference-executor patch it was measured with
(``RelayConfig.tail_tokens`` / ``tail_layers``, ``selection.tail_band``, the band rows in
``relay_prefill``'s layer loop) in a scratch checkout::

    git apply research/studies/data/tail_band_reference.patch
    python research/studies/tail_band_study.py            # the demo's Reviewer, ~3 min at 2 threads
    # the calibration relays: profiles with the band added to every operating point
    python research/studies/tail_band_study.py --write-profiles /tmp/tail
    sglang-relay bench fidelity --frontier --workload calibration_workload.jsonl \\
        --reuse-targets 0.80,0.90,0.95 --methods relay --threads 1 \\
        --profile /tmp/tail/profile_t16x6.json

Printed per point and band: reuse, selected tokens, first-token KL against exact prefill,
the probability of the end of turn after the reply's first token three backticks (exact
prefill: 0.161), and the greedy reply; on exact upstream KV and on the chain as a relay
server runs it (the Developer decoded over its relayed prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

BANDS = [(0, 0), (16, 6), (16, 8), (16, 10), (24, 6), (32, 6)]
PROFILE_BANDS = [(16, 6), (16, 10), (8, 10)]


def write_profiles(out: Path) -> None:
    """The shipped profile with each of :data:`PROFILE_BANDS` added to every point."""
    from sglang_relay.bench.evaluation import shipped_profile_path
    from sglang_relay.embedded_model import ensure_model

    data = json.loads(shipped_profile_path(ensure_model()).read_text())
    out.mkdir(parents=True, exist_ok=True)
    for tokens, layers in PROFILE_BANDS:
        band = json.loads(json.dumps(data))
        for cfg in [band["config"], *(p["config"] for p in band["frontier"])]:
            cfg.update(tail_tokens=tokens, tail_layers=layers)
        path = out / f"profile_t{tokens}x{layers}.json"
        path.write_text(json.dumps(band, indent=1))
        print(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-profiles", type=Path, help="write the band profiles here and stop")
    args = p.parse_args()
    if args.write_profiles:
        write_profiles(args.write_profiles)
        return
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_collapse_study import embedded, logp, reviewer_relay
    from sglang_relay.bench.evaluation import shipped_profile_path
    from sglang_relay.core.config import RelayConfig, load_profile
    from sglang_relay.core.operating import Frontier
    from sglang_relay.core.reference import exact_prefill, greedy_continue, relay_prefill

    if "tail_tokens" not in RelayConfig.__dataclass_fields__:
        sys.exit("apply research/studies/data/tail_band_reference.patch first (see the docstring)")
    model, tok, ref = embedded()
    eos = tok.eos_token_id
    prompt, spans, _ = reviewer_relay(ref, tok)
    ticks = tok("```", add_special_tokens=False).input_ids

    exact = exact_prefill(ref, prompt, forced=ticks)
    exact0 = exact_prefill(ref, prompt)
    print(f"exact: P(end | ```) {float(logp(exact.logits[-1]).exp()[eos]):.3f}")
    base, data = load_profile(shipped_profile_path(model))
    frontier = Frontier.from_profile(data)
    print("| upstream KV | point | band | reuse | selected | KL | P(end | ```) | greedy |")
    print("|---|---|---|---|---|---|---|---|")
    for chained in (False, True):
        for target in (0.8, 0.9, 0.95):
            point = frontier.point(base, target, ref.num_layers).config
            run = reviewer_relay(ref, tok, point)[1] if chained else spans
            for tokens, layers in BANDS:
                cfg = replace(point, tail_tokens=tokens, tail_layers=layers)
                res = relay_prefill(ref, prompt, run, cfg, forced=ticks)
                free = relay_prefill(ref, prompt, run, cfg)
                p0, q0 = logp(exact0.logits[-1]), logp(free.logits[-1])
                kl = float((p0.exp() * (p0 - q0)).sum())
                greedy = tok.decode(greedy_continue(ref, free, 8, [eos]))
                band = f"{tokens} x {layers}" if tokens else "none"
                print(f"| {'chain' if chained else 'exact'} | {target:.2f} | {band} | "
                      f"{res.reuse_rate:.3f} | {sum(res.selected)} | {kl:.4f} | "
                      f"{float(logp(res.logits[-1]).exp()[eos]):.3f} | {greedy!r} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
