"""Does pinning each of two concurrent single-rank test servers to its own core
(``SGLANG_CPU_OMP_THREADS_BIND`` 0 and 1) beat leaving both on both cores (SGLang's
default), as the two pytest workers of `make test` run them? Two servers start together,
then each runs two 150-token greedy decodes and one 1,500-token prefill; four trials
alternating. Answer (2026-11-28, 2-core VM): no (research/log.md, "CI: one core per test
server")."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "e2e"))
from relay_helpers import running_server  # noqa: E402

from sglang_relay.embedded_model import ensure_model  # noqa: E402

DECODE = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
PREFILL = {"max_new_tokens": 4, "temperature": 0}


def work(url: str) -> float:
    t = time.monotonic()
    for i in range(2):
        body = {"text": f"Write a long story about ships number {i}.", "sampling_params": DECODE}
        requests.post(url + "/generate", json=body, timeout=600).raise_for_status()
    body = {"input_ids": list(range(1000, 2500)), "sampling_params": PREFILL}
    requests.post(url + "/generate", json=body, timeout=600).raise_for_status()
    return time.monotonic() - t


def trial(args: list[str], binds: list[str | None]) -> dict:
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        with cf.ThreadPoolExecutor(2) as ex:
            envs = [{"SGLANG_CPU_OMP_THREADS_BIND": b} if b else None for b in binds]
            starts = [ex.submit(stack.enter_context, running_server(args, env=e)) for e in envs]
            servers = [f.result() for f in starts]
        t1 = time.monotonic()
        with cf.ThreadPoolExecutor(2) as ex:
            times = list(ex.map(work, [s.url for s in servers]))
    return {
        "binds": binds,
        "start_s": round(t1 - t0, 1),
        "work_s": [round(x, 1) for x in times],
        "total_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    args = ["--model-path", str(ensure_model(quiet=True)), "--max-total-tokens", "8192"]
    for binds in ([None, None], ["0", "1"], [None, None], ["0", "1"]):
        print(json.dumps(trial(args, binds)), flush=True)


if __name__ == "__main__":
    main()
