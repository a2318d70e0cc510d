"""The traffic of ``bench load`` and ``bench chaos``: agent chains of several identities
(salted tenants, chain keys, opted-out agents), the faulty clients that replace some
downstream agents, and the server state they read (relay counters, the KV pool balance)."""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from typing import Any

import requests

from sglang_relay.prompts import chat_prompt

BAD_OPTIONS = [7, {"method": "warp"}, {"config": {"l_start": 10**6}}, {"config": {"tau_dev": -3}}]
COUNTERS = {"finished_requests", "recorded_spans", "spans_matched", "relay_extends",
            "relayed_tokens", "fallbacks"}  # fmt: skip
TOPICS = ["queues", "hash maps", "B-trees", "TCP", "garbage collection", "ray tracing"]


def request_body(
    text: str, n: int, relay: Any, salt: str | None, stream: bool = False, top2: bool = False
) -> dict:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 0, "ignore_eos": n >= 64}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    body: dict[str, Any] = {"text": text, "sampling_params": params, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    if top2:  # the two likeliest tokens at every step: how near a greedy choice was a tie
        body.update(return_logprob=True, top_logprobs_num=2)
    return body


def margins(out: dict[str, Any]) -> list[float] | None:
    """Per output token, the logprob gap between the two likeliest tokens (a request sent
    with ``top2``); None where the response does not hold one pair per output token."""
    top = out["meta_info"].get("output_top_logprobs")
    if not top or len(top) != len(out["output_ids"]):
        return None
    gaps = []
    for step in top:
        if len(step) < 2 or step[0][0] is None or step[1][0] is None:
            return None
        gaps.append(round(float(step[0][0]) - float(step[1][0]), 6))
    return gaps


def post(
    url: str,
    text: str,
    n: int,
    relay: Any = None,
    timeout: float = 300.0,
    salt: str | None = None,
    top2: bool = False,
) -> dict:
    resp = requests.post(
        url + "/generate", json=request_body(text, n, relay, salt, top2=top2), timeout=timeout
    )
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def post_stream(
    url: str, text: str, n: int, relay: Any = None, salt: str | None = None, top2: bool = False
) -> tuple[dict, float]:
    """The final streamed response and the time to its first chunk (TTFT, client side)."""
    t0 = time.perf_counter()
    ttft, last = None, None
    body = request_body(text, n, relay, salt, stream=True, top2=top2)
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        for line in resp.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[len(b"data:") :])
    if last is None or ttft is None:
        raise RuntimeError("stream ended without a chunk")
    return last, ttft


def relay_state(url: str) -> dict[str, Any]:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0]["relay"]


# server counters (get_server_info) reported as deltas over a run
SERVER_COUNTERS = ("recorded_spans", "spans_matched", "relay_extends", "relayed_tokens",
                   "fallbacks", "owned_spans_released_for_room",
                   "owned_tokens_released_for_room", "batches_split")  # fmt: skip
# and, where they moved, the fallbacks by reason (``fallback_span_evicted``: a pasted output
# whose span was dropped for room), the spans demoted off the device and the ``host_``
# counters of a HiCache server (relay's host tier: backups, restores, misses, evictions by
# why; SGLang's load-backs): what an operator sizes the tier and its TTL from
COUNTER_PREFIXES = ("fallback_", "host_", "demoted_")
HOST_GAUGES = ("host_spans", "host_tokens", "host_capacity_tokens", "host_side_bytes")


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The server's relay counters over a run: :data:`SERVER_COUNTERS` always, the
    :data:`COUNTER_PREFIXES` families where they changed (not the tier's gauges)."""
    out = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in SERVER_COUNTERS}
    for k, v in after.items():
        counter = isinstance(v, int) and not isinstance(v, bool) and k not in HOST_GAUGES
        if counter and k.startswith(COUNTER_PREFIXES) and v != before.get(k, 0):
            out[k] = v - int(before.get(k, 0))
    return out


def phase_times(state: dict[str, Any]) -> dict[str, float]:
    """Relay's phase timers in a :func:`relay_state` (a server run with
    ``SGLANG_RELAY_PHASE_TIMES=1``): ``{"<phase>_ms": total ms, "<phase>_n": count}``."""
    return {k[6:]: float(v) for k, v in state.items() if k.startswith("phase_")}


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
    def __init__(self, start: float) -> None:
        self.start = start
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.reused_tokens = 0
        # one row per downstream request: (seconds since start, could relay, relayed, ttft)
        self.downstream: list[tuple[float, bool, bool, float | None]] = []
        self.samples: list[dict[str, Any]] = []  # server RSS / side memory over time
        self.outputs: dict[str, dict[str, Any]] = {}  # per good chain: its output ids

    def served(self, out: dict[str, Any]) -> dict[str, Any]:
        relay = out["meta_info"].get("relay") or {}
        with self.lock:
            self.counts["served"] += 1
            self.reused_tokens += int(relay.get("reused_tokens", 0))
            if relay.get("spans_matched"):
                self.counts["relayed"] += 1
            if relay.get("fallback"):
                self.fallbacks[str(relay["fallback"]).split(":")[0]] += 1
        return relay

    def down(self, out: dict[str, Any], could: bool, ttft: float | None) -> None:
        relay = self.served(out)
        relayed = bool(relay.get("spans_matched"))
        with self.lock:
            self.downstream.append((time.monotonic() - self.start, could, relayed, ttft))
            if relayed and not could:
                self.counts["wrong_namespace_relays"] += 1
                self.errors.append(f"relayed a span it may not see: {relay}")

    def add(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error is not None:
                self.errors.append(error)


def identity(rng: random.Random, k: str) -> tuple[str | None, dict[str, Any], Any, bool]:
    """Who a chain is: (cache_salt, relay option extras, upstream relay option, whether
    its downstream may relay the upstream's output)."""
    roll = rng.random()
    if roll < 0.3:  # a tenant with a cache_salt: spans shared among that tenant only
        return f"tenant-{rng.randrange(4)}", {}, None, True
    if roll < 0.4:  # a chain key
        return None, {"key": f"chain-{k}"}, {"key": f"chain-{k}"}, True
    if roll < 0.5:  # the upstream opted out, in a namespace of its own: it stores nothing,
        # so its downstream has nothing to relay (a relay there would be a leak)
        key = f"solo-{k}"
        return None, {"key": key}, {"method": "standard", "key": key}, False
    return None, {}, None, True


FAULTS = ("client_aborts", "client_disconnects", "server_aborts", "bad_requests_refused")


def fault_client(
    url: str, prompt: str, relay: Any, salt: str | None, rng: random.Random, stats: LoadStats
) -> None:
    """One faulty client in place of a downstream agent (the chain's good request is not
    sent), of a kind in :data:`FAULTS`."""
    kind = rng.choice(FAULTS)
    if kind == "client_aborts":  # give up before the prefill can finish
        try:
            post(url, prompt, 64, relay=relay, timeout=0.05, salt=salt)
            stats.add("abort_too_late")
        except requests.exceptions.Timeout:
            stats.add(kind)
    elif kind in ("client_disconnects", "server_aborts"):
        body = request_body(prompt, 200, relay, salt, stream=True)
        body["rid"] = rid = f"load-abort-{rng.getrandbits(64):016x}"
        with requests.post(url + "/generate", json=body, stream=True, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    if kind == "server_aborts":  # SGLang's abort, mid-decode (and any redo)
                        requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
                        continue  # read the stream to its end: it must end, not hang
                    break  # disconnect mid-generation
        stats.add(kind)
    else:
        body = request_body(prompt, 16, rng.choice(BAD_OPTIONS), salt)
        resp = requests.post(url + "/generate", json=body, timeout=300)
        if resp.status_code != 400 or "custom_params.relay" not in resp.text:
            stats.add("errors", f"malformed options not refused: HTTP {resp.status_code}")
        else:
            stats.add(kind)


def agent_chain(
    url: str,
    tok: Any,
    rng: random.Random,
    stats: LoadStats,
    k: str,
    fault_rng: random.Random | None = None,
    fault_share: float = 0.3,
) -> None:
    """One agent chain. ``rng`` draws everything the good requests are, so a run with
    faults (``fault_rng``: a faulty client replaces the downstream agent of a
    ``fault_share`` of the chains) sends the same good requests as one without."""
    topic = rng.choice(TOPICS)
    salt, extras, up_relay, could = identity(rng, k)
    up = post(
        url,
        chat_prompt(tok, f"Writer {k}.", f"Explain {topic}."),
        rng.randint(96, 200),
        relay=up_relay,
        salt=salt,
        top2=True,
    )
    stats.served(up)
    down_relay = dict(extras) if extras else None
    if rng.random() < 0.05:  # the downstream opts out
        down_relay, could = "off", False
    prompt = chat_prompt(tok, f"Editor {k}.", f"Draft:\n\n{up['text']}\n\nImprove the draft.")
    n_down, third_roll = rng.choice([16, 48]), rng.random()
    if fault_rng is not None and fault_rng.random() < fault_share:
        return fault_client(url, prompt, down_relay, salt, fault_rng, stats)
    down, ttft = post_stream(url, prompt, n_down, relay=down_relay, salt=salt, top2=True)
    stats.down(down, could, ttft)
    outputs = [up, down]
    if third_roll > 0.7:
        third = chat_prompt(
            tok, f"Reviewer {k}.", f"Draft:\n\n{up['text']}\n\nEdit:\n\n{down['text']}\n\nJudge."
        )
        out = post(url, third, 16, relay=down_relay, salt=salt, top2=True)
        stats.served(out)
        outputs.append(out)
    relayed = [bool((down["meta_info"].get("relay") or {}).get("spans_matched"))]
    with stats.lock:
        stats.outputs[k] = {
            "ids": [o["output_ids"] for o in outputs],
            "margins": [margins(o) for o in outputs],
            "down_relayed": relayed[0],
        }
