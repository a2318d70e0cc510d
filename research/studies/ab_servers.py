"""Interleaved A/B of two servers on one machine state: both up at once, each request goes
to A then B (B then A on odd rounds), one active at a time, so machine drift (this VM's
speed moves by 10-60 % between runs) hits both alike.

    # this checkout against an older one (its python/ and kernels/ on PYTHONPATH)
    OMP_WAIT_POLICY=PASSIVE python research/studies/ab_servers.py --before /path/to/old/checkout
    # a --no-relay server against a relay server, plain requests only
    OMP_WAIT_POLICY=PASSIVE python research/studies/ab_servers.py --plain
    # the table of a saved run
    python research/studies/ab_servers.py --summary run.json

Both servers get the same OpenMP wait policy (``OMP_WAIT_POLICY`` from the environment,
else PASSIVE, set explicitly for both: an older checkout may not set it for one rank, and
with spinning threads an idle server steals cycles from the other one). Relay mode
measures per round the client latency of a 1-token reply to a prompt quoting a 512-token
upstream output (``naive``, ``relay``, ``relay`` at reuse 0.95, ``standard``) and decode
tokens/s (48 tokens, prefill included: the prompt is short); plain mode the 1-token latency of a
~560-token plain prompt and decode tokens/s. Prints medians and the median (min, max) of
the per-round B/A ratios; ``--json`` keeps every sample with the commits, policy and args.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import time

from transformers import AutoTokenizer

from sglang_relay.bench.intervals import bootstrap_ci
from sglang_relay.client import generate
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess
from sglang_relay.prompts import chat_prompt


def report(samples: dict[tuple[str, str], list[float]]) -> None:
    """Per measure: A's and B's medians, the median of the per-round B / A ratios with its
    95 % bootstrap interval over rounds (``bench.intervals``), its min and max, and the
    rounds where B was faster (decode is tokens/s: higher is faster; the rest seconds)."""
    print("| measure | A median | B median | B / A per round: median [95 %] (min, max) "
          "| B faster |\n|---|---|---|---|---|")  # fmt: skip
    for method in dict.fromkeys(m for m, _ in samples):
        a, b = samples[(method, "A")], samples[(method, "B")]
        r = [y / x for x, y in zip(a, b, strict=True)]
        lo, hi = bootstrap_ci(r, "median")
        faster = sum((x > 1) if method == "decode" else (x < 1) for x in r)
        print(f"| {method} | {statistics.median(a):.4f} | {statistics.median(b):.4f} | "
              f"{statistics.median(r):.3f} [{lo:.3f}, {hi:.3f}] ({min(r):.3f}, {max(r):.3f}) "
              f"| {faster} / {len(r)} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--before", help="an older checkout (A); B is this one")
    mode.add_argument("--plain", action="store_true", help="A: --no-relay, B: relay server")
    mode.add_argument("--summary", help="print the table of a saved --json file; run nothing")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args()
    if args.summary:
        with open(args.summary) as f:
            saved = json.load(f)["samples"]
        report({tuple(key.rsplit(" ", 1)): v for key, v in saved.items()})
        return
    model = str(ensure_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model)

    def chat(system: str, user: str) -> str:
        return chat_prompt(tok, system, user)

    def gen(url: str, text: str, n: int, relay=None):
        """(the generation, its client latency): one non-streamed request, EOS ignored."""
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        if relay is not None:
            params["custom_params"] = {"relay": relay}
        out = generate(url, text, params, stream=False)
        return out, out.latency_s

    policy = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if args.plain:
        specs = {"A": (policy, ["--no-relay"]), "B": (policy, [])}
        methods = [("plain_prefill", None, 1), ("decode", None, 48)]
    else:
        old = f"{args.before}/python:{args.before}/kernels"
        specs = {"A": ({**policy, "PYTHONPATH": old}, []), "B": (policy, [])}
        methods = [("naive", "naive", 1), ("relay", "relay", 1),
                   ("relay@0.95", {"method": "relay", "reuse": 0.95}, 1),
                   ("standard", "standard", 1), ("decode", "standard", 48)]  # fmt: skip
    servers = {
        k: ServerProcess(["--model-path", model, *flags], env=env).start(timeout=900)
        for k, (env, flags) in specs.items()
    }
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        ups = {}
        if not args.plain:
            for k, s in servers.items():
                ask = chat("You are a planner.", "Describe how to build a compiler in detail.")
                ups[k] = gen(s.url, ask, 512)[0].text
                gen(s.url, chat("Warm.", f"Plan:\n{ups[k]}\nShort."), 2, "naive")
            assert ups["A"] == ups["B"], "the two servers decode differently"
        for rd in range(args.rounds):
            order = ["A", "B"] if rd % 2 == 0 else ["B", "A"]
            for label, relay, n in methods:
                # one fresh prompt per round and measure, the same for A and B (the measures
                # of a round must not be radix prefix hits of each other)
                salt = f"{label} {rd} {time.time()}"
                for k in order:
                    url = servers[k].url
                    if label == "decode":
                        _, dt = gen(url, chat(f"Writer {salt}.", "Tell a long story."), n, relay)
                        value = n / dt
                    elif label == "plain_prefill":
                        text = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 50
                        _, value = gen(url, chat(f"Reader {salt}.", text), n)
                    else:
                        prompt = chat(f"Reviewer {salt}.", f"Plan:\n{ups[k]}\nOne risk.")
                        out, value = gen(url, prompt, n, relay)
                        info = out.relay or {}
                        assert label == "standard" or info.get("fallback") is None, info
                    samples.setdefault((label, k), []).append(value)
    finally:
        for s in servers.values():
            s.stop()
    report(samples)
    if args.json:

        def commit(path: str | None) -> str:
            """HEAD, with ``+dirty <sha of the diff>`` when tracked files differ from it (a
            change measured before it is committed)."""
            where = ["-C", path] if path else []
            run = lambda *a: subprocess.run(["git", *where, *a], capture_output=True)  # noqa: E731
            head = run("rev-parse", "HEAD").stdout.decode().strip()
            diff = run("diff", "HEAD").stdout
            return f"{head}+dirty {hashlib.sha256(diff).hexdigest()[:12]}" if diff else head

        a_is = "--no-relay server" if args.plain else f"{args.before} @ {commit(args.before)}"
        meta = {"A": a_is, "B": f"this checkout @ {commit(None)}", "env": policy,
                "args": vars(args)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "samples": {f"{m} {k}": v for (m, k), v in samples.items()}},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
