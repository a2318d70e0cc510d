"""Decode at the batch sizes a saturated capacity run reaches (issue 68 item 5): time per
output token of a batch of concurrent requests, on a relay server and a ``--no-relay``
server up side by side, rounds interleaved (A then B, B then A), and optionally where a
relay server's scheduler spends a batch's steps (py-spy).

    OMP_WAIT_POLICY=PASSIVE python research/studies/decode_batch.py --json OUT \
        [--batches 1,4,12] [--prompt-words 600] [--tokens 32] [--rounds 3] [--pyspy RAW]

Each request is streamed: its time per output token is (last chunk - first chunk) /
(tokens - 1), so its own prefill and the queue before it are left out, while the other
requests' prefills that SGLang interleaves with the batch's decode steps stay in (as in
a capacity run). Every request has a prompt of its own (no radix hit between requests,
rounds or servers) of about ``--prompt-words`` words, and decodes ``--tokens`` tokens with
EOS ignored. ``--pyspy RAW``: after the rounds, one more batch of the largest size on the
relay server while ``py-spy record --nonblocking -f raw`` samples its scheduler; the
samples are split by the innermost recognized frame (:data:`CATEGORIES`).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import signal
import statistics
import subprocess
import threading
import time

from sglang_relay.bench.intervals import bootstrap_ci
from sglang_relay.client import generate
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess

# innermost frame name -> category (first match from the leaf up)
CATEGORIES = (
    ("UnquantizedLinearMethod.apply", "linear"),
    ("LogitsProcessor", "logits"),
    ("TorchNativeAttnBackend", "attention (SGLang torch_native)"),
    ("scaled_dot_product_attention", "attention (SGLang torch_native)"),
    ("RMSNorm", "norms"),
    ("Rotary", "rotary"),
    ("SiluAndMul", "activation"),
    ("set_kv_buffer", "kv write"),
    # relay's own work in a plain forward (RelayRuntime.forward wraps every forward: not a
    # category, or every unrecognized SGLang leaf would count as relay's)
    ("DecodeCapture", "relay decode capture"),
    ("SlotLedger", "relay slot ledger"),
    ("InfluenceHook", "relay influence"),
    ("span_context", "relay span record"),
    ("Sampler", "sampling"),
)
WORDS = (
    "the system reads each report and then writes a short plan for the next agent which checks "
    "every claim against the data before it answers with a list of open risks and their owners"
).split()
PASSES = (("_execute_decode", "decode"), ("_execute_extend", "prefill"))


def classify(frames: list[str]) -> str:
    """``pass: category``: the forward the sample is in (decode, the prefill of arriving
    requests, or neither: scheduling, relay's work outside forwards) and its innermost
    recognized frame."""
    stack = ";".join(frames)
    where = next((name for key, name in PASSES if key in stack), "outside forwards")
    for frame in reversed(frames):
        for key, cat in CATEGORIES:
            if key in frame:
                return f"{where}: {cat}"
    return f"{where}: other"


def batch(url: str, size: int, words: int, tokens: int, salt: str) -> list[float]:
    """Per request of one concurrent batch: seconds per output token after its first."""
    out: list[float] = [0.0] * size
    errors: list[BaseException] = []

    def one(i: int) -> None:
        # a prefix of its own first (no radix hit), then common words: about a token each
        body = " ".join(WORDS[(i + j * 7) % len(WORDS)] for j in range(words))
        text = f"Request {salt} {i}. {body}"
        try:
            g = generate(url, text + "\nSummarize.", {"max_new_tokens": tokens,
                         "temperature": 0, "ignore_eos": True})  # fmt: skip
            out[i] = (g.latency_s - g.ttft_s) / (tokens - 1)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def pyspy_shares(raw: str) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for line in gzip.open(raw, "rt") if raw.endswith(".gz") else open(raw):
        stack, _, n = line.rstrip().rpartition(" ")
        if "event_loop" not in stack:  # the scheduler's loop only
            continue
        counts[classify(stack.split(";"))] += int(n)
    return dict(counts.most_common())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", help="write the rows here (required unless --shares)")
    p.add_argument("--batches", default="1,4,12")
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pyspy")
    p.add_argument("--shares", help="only print the shares of a saved py-spy raw file")
    args = p.parse_args()
    if args.shares:
        for cat, n in pyspy_shares(args.shares).items():
            print(f"{cat}: {n}")
        return
    if not args.json or args.tokens < 2:
        p.error("--json is required and --tokens must be at least 2")
    sizes = [int(x) for x in args.batches.split(",")]
    model = str(ensure_model(quiet=True))
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    flags = {"relay": [], "no-relay": ["--no-relay"]}
    servers = {k: ServerProcess(["--model-path", model, *f], env=env).start(timeout=900)
               for k, f in flags.items()}  # fmt: skip
    samples: dict[str, list[float]] = {}
    shares = None
    try:
        for k, server in servers.items():  # warm-up, not measured
            batch(server.url, 2, args.prompt_words, args.tokens, f"warm{k}")
        for rd in range(args.rounds):
            for n, size in enumerate(sizes):  # who goes first alternates by round and size
                order = list(servers) if (rd + n) % 2 == 0 else list(reversed(servers))
                for k in order:
                    salt = f"{rd}{size}{k[0]}{time.time_ns() % 10**6}"
                    tpot = batch(servers[k].url, size, args.prompt_words, args.tokens, salt)
                    samples.setdefault(f"{k} {size}", []).append(statistics.median(tpot))
                    print(f"round {rd} batch {size} {k}: {statistics.median(tpot):.3f} s/token")
        if args.pyspy:
            spy = subprocess.Popen(
                ["py-spy", "record", "--nonblocking", "--subprocesses", "-r", "100", "-f", "raw",
                 "-o", args.pyspy, "--pid", str(servers["relay"].proc.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(2)
            batch(servers["relay"].url, max(sizes), args.prompt_words, args.tokens, "spy")
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                spy.wait(timeout=120)
            except subprocess.TimeoutExpired:
                spy.kill()
                raise
            shares = pyspy_shares(args.pyspy)
    finally:
        for s in servers.values():
            s.stop()
    rows = []
    for size in sizes:
        a, b = samples[f"no-relay {size}"], samples[f"relay {size}"]
        ratio = [y / x for x, y in zip(a, b, strict=True)]
        lo, hi = bootstrap_ci(ratio, "median") if len(ratio) > 1 else (ratio[0], ratio[0])
        rows.append({"batch": size, "no_relay_tpot_s": a, "relay_tpot_s": b,
                     "relay_over_no_relay": [statistics.median(ratio), lo, hi]})  # fmt: skip
        print(f"batch {size}: no-relay {statistics.median(a):.3f} s/token, relay "
              f"{statistics.median(b):.3f}, relay / no-relay {statistics.median(ratio):.3f} "
              f"[{lo:.3f}, {hi:.3f}]")  # fmt: skip
    if shares:
        total = sum(shares.values())
        for cat, n in shares.items():
            print(f"  {cat}: {100 * n / total:.0f} % of {total} samples")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "pyspy_shares": shares}, f, indent=1)


if __name__ == "__main__":
    main()
