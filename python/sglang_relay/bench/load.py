"""``sglang-relay bench load``: relay under load and faults against a real server.

Bounded in time; every figure comes from the server's own counters or from the clients:

1. **Load**: ``--chains`` concurrent agent chains (upstream -> downstream relaying it ->
   sometimes a third agent relaying both) for ``--duration`` seconds, in a KV pool small
   enough that spans are evicted mid-chain. Mixed in: clients that abort mid-prefill (a
   read timeout shorter than the prefill, then a closed connection), clients that
   disconnect from a stream after the first chunk, and requests with malformed relay
   options. Reported: requests served, client aborts, errors that were not the client's
   doing (must be 0), fallbacks by reason, and the pool balance once idle (leaked slots =
   total - available - evictable - protected, must be 0).
2. **Evicted spans**: an upstream output is pushed out of the pool by other traffic, then
   relayed: the request must be served by standard prefill (no span or ``span_evicted``)
   and its output must equal the standard one.
3. **Restart between agents**: the server is restarted after the upstream agent; the
   downstream agent on the new server is served normally (no spans) and equals standard.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import platform
import random
import threading
import time
from pathlib import Path
from typing import Any

import requests

from sglang_relay.demo import chat_prompt

BAD_OPTIONS = [7, {"method": "warp"}, {"config": {"l_start": 10**6}}, {"config": {"tau_dev": -3}}]
COUNTERS = {"finished_requests", "recorded_spans", "spans_matched", "relay_extends",
            "relayed_tokens", "fallbacks"}  # fmt: skip
TOPICS = ["queues", "hash maps", "B-trees", "TCP", "garbage collection", "ray tracing"]


def _post(url: str, text: str, n: int, relay: Any = None, timeout: float = 300.0) -> dict:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 0, "ignore_eos": n >= 64}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    resp = requests.post(
        url + "/generate", json={"text": text, "sampling_params": params}, timeout=timeout
    )
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def relay_state(url: str) -> dict[str, Any]:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0]["relay"]


def leaked_slots(url: str, settle_s: float = 30.0) -> tuple[int, dict[str, int]]:
    """Slots neither free, evictable nor protected once the server is idle. Aborted
    requests are noticed by SGLang only every few seconds, so poll until the balance holds
    (or ``settle_s`` passes, and report what is still missing)."""
    deadline = time.monotonic() + settle_s
    while True:
        time.sleep(1.0)
        pool = relay_state(url)["pool"]
        leaked = pool["total"] - pool["available"] - pool["evictable"] - pool["protected"]
        if leaked == 0 or time.monotonic() > deadline:
            return leaked, pool


class LoadStats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.reused_tokens = 0

    def served(self, out: dict[str, Any]) -> None:
        relay = out["meta_info"].get("relay") or {}
        with self.lock:
            self.counts["served"] += 1
            self.reused_tokens += int(relay.get("reused_tokens", 0))
            if relay.get("spans_matched"):
                self.counts["relayed"] += 1
            if relay.get("fallback"):
                self.fallbacks[str(relay["fallback"]).split(":")[0]] += 1

    def add(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error is not None:
                self.errors.append(error)


def _chain(url: str, tok: Any, rng: random.Random, stats: LoadStats, k: int) -> None:
    topic = rng.choice(TOPICS)
    up = _post(url, chat_prompt(tok, f"Writer {k}.", f"Explain {topic}."), rng.randint(96, 200))
    stats.served(up)
    prompt = chat_prompt(tok, f"Editor {k}.", f"Draft:\n\n{up['text']}\n\nImprove the draft.")
    roll = rng.random()
    if roll < 0.1:  # abort mid-prefill: give up before the prefill can finish
        try:
            _post(url, prompt, 64, timeout=0.05)
            stats.add("abort_too_late")
        except requests.exceptions.Timeout:
            stats.add("client_aborts")
        return
    if roll < 0.2:  # disconnect from a stream after the first chunk
        body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 200}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    break
        stats.add("client_disconnects")
        return
    if roll < 0.3:
        out = _post(url, prompt, 16, relay=rng.choice(BAD_OPTIONS))
        if not str(out["meta_info"]["relay"].get("fallback", "")).startswith("bad_options"):
            stats.add("errors", "malformed options were not refused")
        stats.served(out)
        return
    down = _post(url, prompt, rng.choice([16, 48]))
    stats.served(down)
    if roll > 0.7:
        third = chat_prompt(
            tok, f"Reviewer {k}.", f"Draft:\n\n{up['text']}\n\nEdit:\n\n{down['text']}\n\nJudge."
        )
        stats.served(_post(url, third, 16))


def run_load(url: str, tok: Any, chains: int, duration: float, seed: int = 0) -> dict[str, Any]:
    stats = LoadStats()
    deadline = time.monotonic() + duration
    counter = iter(range(10**9))
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        while time.monotonic() < deadline:
            with lock:
                k = next(counter)
            try:
                _chain(url, tok, rng, stats, k)
                stats.add("chains")
            except Exception as exc:  # noqa: BLE001 - every failure is a reported figure
                stats.add("errors", f"{type(exc).__name__}: {exc}"[:300])

    before = relay_state(url)
    start = time.monotonic()
    with cf.ThreadPoolExecutor(chains) as pool:
        list(pool.map(worker, range(chains)))
    elapsed = time.monotonic() - start
    leaked, pool_after = leaked_slots(url)
    after = relay_state(url)
    healthy = requests.get(url + "/health", timeout=30).status_code == 200
    server_counters = {  # deltas over the run, except gauges (spans, span_tokens, ...)
        k: v - before.get(k, 0) if k in COUNTERS else v
        for k, v in after.items()
        if isinstance(v, int) and not isinstance(v, bool)
    }
    return {
        "chains_concurrent": chains,
        "duration_s": round(elapsed, 1),
        "chains_completed": stats.counts["chains"],
        "requests_served": stats.counts["served"],
        "requests_relayed": stats.counts["relayed"],
        "reused_tokens": stats.reused_tokens,
        "client_aborts": stats.counts["client_aborts"],
        "client_disconnects": stats.counts["client_disconnects"],
        "errors": len(stats.errors),
        "error_samples": stats.errors[:5],
        "fallbacks": dict(stats.fallbacks),
        "server_counters": server_counters,
        "leaked_slots": leaked,
        "pool_after": pool_after,
        "healthy_after": healthy,
    }


def run_evicted(url: str, tok: Any, pool_tokens: int) -> dict[str, Any]:
    up = _post(url, chat_prompt(tok, "Writer E.", "Explain heaps."), 160)
    prompt = chat_prompt(tok, "Editor E.", f"Draft:\n\n{up['text']}\n\nImprove it.")
    flood, batch = 0, 0
    with cf.ThreadPoolExecutor(8) as pool:
        while flood < 2 * pool_tokens:  # enough other traffic to cycle the whole pool
            prompts = [
                chat_prompt(tok, f"Filler {batch}-{i}.", "Count to fifty.") for i in range(8)
            ]
            for out in pool.map(lambda p: _post(url, p, 200), prompts):
                flood += out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"]
            batch += 1
    relayed = _post(url, prompt, 32)
    standard = _post(url, prompt, 32, relay="standard")
    relay = relayed["meta_info"]["relay"]
    return {
        "spans_matched": relay["spans_matched"],
        "fallback": relay["fallback"],
        "served_exactly": relayed["output_ids"] == standard["output_ids"]
        and relay["reused_tokens"] == 0,
    }


def run_restart(server_args: list[str], tok: Any) -> dict[str, Any]:
    from sglang_relay.runtime.launch import ServerProcess

    server = ServerProcess(server_args).start()
    try:
        up = _post(server.url, chat_prompt(tok, "Writer R.", "Explain tries."), 160)
    finally:
        server.stop()
    server = ServerProcess(server_args).start()
    try:
        prompt = chat_prompt(tok, "Editor R.", f"Draft:\n\n{up['text']}\n\nImprove it.")
        down = _post(server.url, prompt, 32)
        std = _post(server.url, prompt, 32, relay="standard")
        leaked, _ = leaked_slots(server.url)
    finally:
        server.stop()
    relay = down["meta_info"]["relay"]
    return {
        "spans_matched": relay["spans_matched"],
        "fallback": relay["fallback"],
        "same_as_standard": down["output_ids"] == std["output_ids"],
        "leaked_slots": leaked,
    }


def markdown(result: dict[str, Any]) -> str:
    load, ev, rs = result["load"], result["evicted"], result["restart"]
    rows = [
        ("concurrent chains", load["chains_concurrent"]),
        ("duration (s)", load["duration_s"]),
        ("chains completed", load["chains_completed"]),
        ("requests served", load["requests_served"]),
        ("requests that relayed a span", load["requests_relayed"]),
        ("client aborts mid-prefill", load["client_aborts"]),
        ("client disconnects mid-stream", load["client_disconnects"]),
        ("errors not caused by the client", load["errors"]),
        ("fallbacks by reason", json.dumps(load["fallbacks"], sort_keys=True)),
        (
            "spans recorded / still stored after the load (the rest were evicted)",
            f"{load['server_counters'].get('recorded_spans')} / "
            f"{load['server_counters'].get('spans')}",
        ),
        ("leaked KV slots after the load", load["leaked_slots"]),
        ("server healthy after the load", load["healthy_after"]),
        ("evicted span relayed: served exactly by standard prefill", ev["served_exactly"]),
        (
            "evicted span relayed: spans matched / fallback",
            f"{ev['spans_matched']} / {ev['fallback']}",
        ),
        ("restart between agents: same output as standard", rs["same_as_standard"]),
        ("restart between agents: leaked KV slots", rs["leaked_slots"]),
    ]
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench load", description=__doc__)
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--pool-tokens", type=int, default=4000, help="KV pool (tokens)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.launch import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    server_args = [
        "--model-path",
        model_path,
        "--max-total-tokens",
        str(args.pool_tokens),
        "--chunked-prefill-size",
        "256",
        *server_flags,
    ]
    server = ServerProcess(server_args).start()
    try:
        print(f"[load] {args.chains} chains for {args.duration:.0f}s ...", flush=True)
        load = run_load(server.url, tok, args.chains, args.duration)
        print("[load] evicted-span relay ...", flush=True)
        evicted = run_evicted(server.url, tok, args.pool_tokens)
        log = server.log_tail(200)
    finally:
        server.stop()
    print("[load] restart between agents ...", flush=True)
    restart = run_restart(server_args, tok)
    result = {
        "load": load,
        "evicted": evicted,
        "restart": restart,
        "server_log_errors": [ln for ln in log.splitlines() if "Traceback" in ln or "Error" in ln],
        "run": {"machine": platform.platform(), "pool_tokens": args.pool_tokens},
    }
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = (
        load["errors"] == 0
        and load["leaked_slots"] == 0
        and load["healthy_after"]
        and evicted["served_exactly"]
        and restart["same_as_standard"]
        and restart["leaked_slots"] == 0
    )
    return 0 if ok else 1
