"""``sglang-relay bench load``: relay under load and faults against a real server.

Bounded in time; every figure comes from the server's own counters or from the clients:

1. **Load** (a soak with ``--duration 1800``): ``--chains`` concurrent agent chains
   (upstream -> downstream relaying it -> sometimes a third agent relaying both) for
   ``--duration`` seconds, in a KV pool small enough that spans are evicted mid-chain.
   Chains differ in who they are: unsalted, salted (``cache_salt``, 4 tenants), with a
   relay key, with an opted-out upstream (``"standard"``: stores nothing, so its
   downstream must not relay) or an opted-out downstream (``"off"``). Mixed in: clients
   that abort mid-prefill (a read timeout shorter than the prefill, then a closed
   connection), clients that disconnect from a stream after the first chunk, and requests
   with malformed relay options. Downstream agents stream, so the client measures TTFT.
   Reported: requests served, client aborts, errors that were not the client's doing
   (must be 0), fallbacks by reason, relays into the wrong namespace (must be 0), the pool
   balance once idle (leaked slots = total - available - evictable - protected, must
   be 0), and per ``--window`` seconds: requests, relay hit rate (relayed / downstream
   requests that could relay), p50/p99 TTFT of relaying downstream agents, server RSS and
   relay side memory (sampled every few seconds).
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

from sglang_relay.client import healthy
from sglang_relay.demo import chat_prompt

BAD_OPTIONS = [7, {"method": "warp"}, {"config": {"l_start": 10**6}}, {"config": {"tau_dev": -3}}]
COUNTERS = {"finished_requests", "recorded_spans", "spans_matched", "relay_extends",
            "relayed_tokens", "fallbacks"}  # fmt: skip
TOPICS = ["queues", "hash maps", "B-trees", "TCP", "garbage collection", "ray tracing"]


def _body(text: str, n: int, relay: Any, salt: str | None, stream: bool = False) -> dict:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 0, "ignore_eos": n >= 64}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    body: dict[str, Any] = {"text": text, "sampling_params": params, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _post(
    url: str,
    text: str,
    n: int,
    relay: Any = None,
    timeout: float = 300.0,
    salt: str | None = None,
) -> dict:
    resp = requests.post(url + "/generate", json=_body(text, n, relay, salt), timeout=timeout)
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def _post_stream(
    url: str, text: str, n: int, relay: Any = None, salt: str | None = None
) -> tuple[dict, float]:
    """The final streamed response and the time to its first chunk (TTFT, client side)."""
    t0 = time.perf_counter()
    ttft, last = None, None
    body = _body(text, n, relay, salt, stream=True)
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


def _identity(rng: random.Random, k: str) -> tuple[str | None, dict[str, Any], Any, bool]:
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


def _fault(
    url: str, prompt: str, relay: Any, salt: str | None, rng: random.Random, stats: LoadStats
) -> None:
    """One faulty client in place of a downstream agent (the chain's good request is not
    sent), of a kind in :data:`FAULTS`."""
    kind = rng.choice(FAULTS)
    if kind == "client_aborts":  # give up before the prefill can finish
        try:
            _post(url, prompt, 64, relay=relay, timeout=0.05, salt=salt)
            stats.add("abort_too_late")
        except requests.exceptions.Timeout:
            stats.add(kind)
    elif kind in ("client_disconnects", "server_aborts"):
        body = _body(prompt, 200, relay, salt, stream=True)
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
        body = _body(prompt, 16, rng.choice(BAD_OPTIONS), salt)
        resp = requests.post(url + "/generate", json=body, timeout=300)
        if resp.status_code != 400 or "custom_params.relay" not in resp.text:
            stats.add("errors", f"malformed options not refused: HTTP {resp.status_code}")
        else:
            stats.add(kind)


def _chain(
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
    salt, extras, up_relay, could = _identity(rng, k)
    up = _post(
        url,
        chat_prompt(tok, f"Writer {k}.", f"Explain {topic}."),
        rng.randint(96, 200),
        relay=up_relay,
        salt=salt,
    )
    stats.served(up)
    down_relay = dict(extras) if extras else None
    if rng.random() < 0.05:  # the downstream opts out
        down_relay, could = "off", False
    prompt = chat_prompt(tok, f"Editor {k}.", f"Draft:\n\n{up['text']}\n\nImprove the draft.")
    n_down, third_roll = rng.choice([16, 48]), rng.random()
    if fault_rng is not None and fault_rng.random() < fault_share:
        return _fault(url, prompt, down_relay, salt, fault_rng, stats)
    down, ttft = _post_stream(url, prompt, n_down, relay=down_relay, salt=salt)
    stats.down(down, could, ttft)
    outputs = [up["output_ids"], down["output_ids"]]
    if third_roll > 0.7:
        third = chat_prompt(
            tok, f"Reviewer {k}.", f"Draft:\n\n{up['text']}\n\nEdit:\n\n{down['text']}\n\nJudge."
        )
        out = _post(url, third, 16, relay=down_relay, salt=salt)
        stats.served(out)
        outputs.append(out["output_ids"])
    relayed = [bool((down["meta_info"].get("relay") or {}).get("spans_matched"))]
    with stats.lock:
        stats.outputs[k] = {"ids": outputs, "down_relayed": relayed[0]}


def _sample(url: str, pid: int | None, stats: LoadStats) -> None:
    import psutil

    rss = None
    if pid is not None:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            rss = sum(p.memory_info().rss for p in procs if p.is_running())
        except psutil.Error:
            rss = None
    state = relay_state(url)
    row = {
        "t": round(time.monotonic() - stats.start, 1),
        "rss_mb": None if rss is None else round(rss / 2**20, 1),
        "side_mb": round(state.get("side_bytes", 0) / 2**20, 2),
        "spans": state.get("spans"),
        "span_tokens": state.get("span_tokens"),
        "requests_tracked": state.get("requests_tracked"),
    }
    with stats.lock:
        stats.samples.append(row)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def windows(stats: LoadStats, window: float, elapsed: float) -> list[dict[str, Any]]:
    """Per-window figures: hit rate, TTFT percentiles, memory."""
    out = []
    n = max(1, int(elapsed // window + (elapsed % window > 0.5 * window)))
    for w in range(n):
        lo, hi = w * window, (w + 1) * window if w < n - 1 else float("inf")
        rows = [r for r in stats.downstream if lo <= r[0] < hi]
        could = [r for r in rows if r[1]]
        ttfts = [r[3] for r in could if r[2] and r[3] is not None]
        mem = [s for s in stats.samples if lo <= s["t"] < hi]
        rss = [s["rss_mb"] for s in mem if s["rss_mb"] is not None]
        out.append(
            {
                "window": w,
                "from_s": lo,
                "downstream": len(rows),
                "could_relay": len(could),
                "hit_rate": round(sum(r[2] for r in could) / len(could), 3) if could else None,
                "ttft_n": len(ttfts),
                "ttft_p50_s": _pct(ttfts, 0.5),
                "ttft_p90_s": _pct(ttfts, 0.9) if len(ttfts) >= 10 else None,
                # a p99 needs a hundred samples to be more than the maximum
                "ttft_p99_s": _pct(ttfts, 0.99) if len(ttfts) >= 100 else None,
                "ttft_max_s": max(ttfts, default=None),
                "rss_mb_max": max(rss) if rss else None,
                "side_mb_max": max((s["side_mb"] for s in mem), default=None),
                "span_tokens_max": max((s["span_tokens"] or 0 for s in mem), default=None),
            }
        )
    return out


def run_load(
    url: str,
    tok: Any,
    chains: int,
    duration: float,
    seed: int = 0,
    *,
    window: float = 300.0,
    pid: int | None = None,
    sample_every: float = 10.0,
    faults: bool = True,
    fault_share: float = 0.3,
) -> dict[str, Any]:
    """``chains`` clients send agent chains for ``duration`` seconds. Client ``w``'s
    ``j``-th chain is the same in every run of a seed; with ``faults`` a faulty client
    (:data:`FAULTS`) replaces the downstream agent of a ``fault_share`` of them."""
    start = time.monotonic()
    stats = LoadStats(start)
    deadline = start + duration
    done = threading.Event()

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        fault_rng = random.Random(seed * 1000 + w + 500) if faults else None
        j = 0
        while time.monotonic() < deadline:
            k, j = f"{w}.{j}", j + 1
            try:
                _chain(url, tok, rng, stats, k, fault_rng, fault_share)
                stats.add("chains")
            except Exception as exc:  # noqa: BLE001 - every failure is a reported figure
                stats.add("errors", f"{type(exc).__name__}: {exc}"[:300])

    def sampler() -> None:
        while not done.wait(sample_every):
            try:
                _sample(url, pid, stats)
            except Exception as exc:  # noqa: BLE001
                stats.add("errors", f"sampler {type(exc).__name__}: {exc}"[:300])

    before = relay_state(url)
    _sample(url, pid, stats)
    threading.Thread(target=sampler, daemon=True).start()
    with cf.ThreadPoolExecutor(chains) as pool:
        list(pool.map(worker, range(chains)))
    done.set()
    elapsed = time.monotonic() - start
    _sample(url, pid, stats)
    leaked, pool_after = leaked_slots(url)
    after = relay_state(url)
    ok = healthy(url)
    server_counters = {  # deltas over the run, except gauges (spans, span_tokens, ...)
        k: v - before.get(k, 0) if k in COUNTERS else v
        for k, v in after.items()
        if isinstance(v, int) and not isinstance(v, bool)
    }
    per_window = windows(stats, window, elapsed)
    rates = [w["hit_rate"] for w in per_window if w["hit_rate"] is not None]
    return {
        "chains_concurrent": chains,
        "duration_s": round(elapsed, 1),
        "window_s": window,
        "chains_completed": stats.counts["chains"],
        "requests_served": stats.counts["served"],
        "requests_relayed": stats.counts["relayed"],
        "reused_tokens": stats.reused_tokens,
        "faults": {"share": fault_share if faults else 0.0, **{f: stats.counts[f] for f in FAULTS}},
        "client_aborts": stats.counts["client_aborts"],
        "client_disconnects": stats.counts["client_disconnects"],
        "wrong_namespace_relays": stats.counts["wrong_namespace_relays"],
        "errors": len(stats.errors),
        "error_samples": stats.errors[:5],
        "fallbacks": dict(stats.fallbacks),
        "server_counters": server_counters,
        "leaked_slots": leaked,
        "pool_after": pool_after,
        "healthy_after": ok,
        "windows": per_window,
        "hit_rate_first_last": [rates[0], rates[-1]] if rates else None,
        "memory_samples": stats.samples,
        "outputs": stats.outputs,
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
    load, ev, rs = result["load"], result.get("evicted"), result.get("restart")
    rows = [
        ("concurrent chains", load["chains_concurrent"]),
        ("duration (s)", load["duration_s"]),
        ("chains completed", load["chains_completed"]),
        ("requests served", load["requests_served"]),
        ("requests that relayed a span", load["requests_relayed"]),
        ("client aborts mid-prefill", load["client_aborts"]),
        ("client disconnects mid-stream", load["client_disconnects"]),
        ("errors not caused by the client", load["errors"]),
        ("relays into a namespace that stored nothing", load["wrong_namespace_relays"]),
        ("fallbacks by reason", json.dumps(load["fallbacks"], sort_keys=True)),
        (
            "spans recorded / still stored after the load (the rest were evicted)",
            f"{load['server_counters'].get('recorded_spans')} / "
            f"{load['server_counters'].get('spans')}",
        ),
        ("leaked KV slots after the load", load["leaked_slots"]),
        ("server healthy after the load", load["healthy_after"]),
    ]
    if ev is not None:
        rows += [
            ("evicted span relayed: served exactly by standard prefill", ev["served_exactly"]),
            (
                "evicted span relayed: spans matched / fallback",
                f"{ev['spans_matched']} / {ev['fallback']}",
            ),
        ]
    if rs is not None:
        rows += [
            ("restart between agents: same output as standard", rs["same_as_standard"]),
            ("restart between agents: leaked KV slots", rs["leaked_slots"]),
        ]
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += [
        "",
        f"| window ({load['window_s']:.0f} s) | downstream | could relay | hit rate "
        "| TTFT p50 s | TTFT p99 s | server RSS MB (max) | side MB | span tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in load["windows"]:
        lines.append(
            f"| {w['window']} | {w['downstream']} | {w['could_relay']} | {w['hit_rate']} "
            f"| {w['ttft_p50_s']} | {w['ttft_p99_s']} | {w['rss_mb_max']} "
            f"| {w['side_mb_max']} | {w['span_tokens_max']} |"
        )
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> list[str]:
    """What is wrong with a run (empty: nothing)."""
    load, ev, rs = result["load"], result.get("evicted"), result.get("restart")
    bad = []
    if load["errors"]:
        bad.append(f"{load['errors']} errors: {load['error_samples']}")
    if load["leaked_slots"]:
        bad.append(f"{load['leaked_slots']} leaked KV slots")
    if not load["healthy_after"]:
        bad.append("server unhealthy after the load")
    if ev is not None and not ev["served_exactly"]:
        bad.append("an evicted span's relay did not equal standard prefill")
    if rs is not None and not (rs["same_as_standard"] and rs["leaked_slots"] == 0):
        bad.append("the restarted chain differed from standard or leaked slots")
    return bad


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench load", description=__doc__)
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--window", type=float, default=300.0, help="report window (s)")
    parser.add_argument("--pool-tokens", type=int, default=4000, help="KV pool (tokens)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument(
        "--no-faults", action="store_true", help="skip the evicted-span and restart sections"
    )
    parser.add_argument("--fault-share", type=float, default=0.3, help="faulty clients")
    parser.add_argument("--seed", type=int, default=0)
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.launch import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    server_args = load_server_args(model_path, args.pool_tokens, server_flags)
    server = ServerProcess(server_args).start()
    evicted = restart = None
    try:
        print(f"[load] {args.chains} chains for {args.duration:.0f}s ...", flush=True)
        load = run_load(
            server.url,
            tok,
            args.chains,
            args.duration,
            seed=args.seed,
            window=min(args.window, args.duration),
            pid=server.proc.pid,
            fault_share=args.fault_share,
        )
        load.pop("outputs")
        if not args.no_faults:
            print("[load] evicted-span relay ...", flush=True)
            evicted = run_evicted(server.url, tok, args.pool_tokens)
        log = server.log_tail(200)
    finally:
        server.stop()
    if not args.no_faults:
        print("[load] restart between agents ...", flush=True)
        restart = run_restart(server_args, tok)
    result = {
        "load": load,
        "evicted": evicted,
        "restart": restart,
        "server_log_errors": log_errors(log),
        "run": {"machine": platform.platform(), "pool_tokens": args.pool_tokens},
    }
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    bad = verdict(result)
    for line in bad:
        print(f"[load] FAILED: {line}")
    return 1 if bad else 0


def load_server_args(model_path: str, pool_tokens: int, flags: list[str]) -> list[str]:
    """The server the load runs against: a KV pool of ``pool_tokens``, 256-token chunks."""
    return [
        "--model-path", model_path, "--max-total-tokens", str(pool_tokens),
        "--chunked-prefill-size", "256", *flags,
    ]  # fmt: skip


def log_errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "Traceback" in ln or "Error" in ln]
