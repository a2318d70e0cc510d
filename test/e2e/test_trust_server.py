"""The trust boundary on a real relay server: no request a client can send ends the server
or reaches relay's internal transport (runtime/sched/trust.py).

A seeded generator sends hundreds of requests (3,000 in the full tier) (random and adversarial
``custom_params``, private relay keys, ``n``, logprobs, constrained decoding, streams closed
mid-way, aborts, empty, oversized and out-of-vocabulary prompts) with eight clients at once;
the server must answer each with 200 or a 4xx that carries a message, stay up, keep its
counters and metric labels bounded, and afterwards still relay a chain exactly.

The server runs with every scheduling option the allow-list serves as "checked together"
(runtime/config/server_options.toml) set to a non-default value: concurrent chains there must
relay, and relay with every span token recomputed must equal standard prefill."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time
import uuid

import psutil
import pytest
import requests
from relay_helpers import ALL_SELECTED, chat, generate, relay_info, server_fixture

from sglang_relay.client import healthy
from sglang_relay.runtime.config import server_options
from sglang_relay.runtime.metrics import MAX_EVENTS
from sglang_relay.runtime.sglang.scheduling import DP_ROUTE_KEY, GUARD_KEY
from sglang_relay.runtime.sglang.server import parse_server_args

pytestmark = pytest.mark.e2e

# the CI tier sends 600 (about 100 s on an idle 2-core VM); `make test-full` 3000
FUZZ_REQUESTS = {False: 600, True: 3000}
VOCAB = 49152
KILLER = {"__sglang_relay_guard": {"reused_tokens": "x"}}  # it used to end the server


SCHEDULING = [
    "--max-running-requests", "8", "--max-queued-requests", "64",
    "--max-prefill-tokens", "512", "--prefill-max-requests", "2",
    "--schedule-policy", "lpm", "--schedule-conservativeness", "1.5",
    "--prefill-decode-interval", "2", "--scheduler-recv-interval", "2",
    "--stream-interval", "4", "--disable-overlap-schedule",
]  # fmt: skip
TEST = "test/e2e/test_trust_server.py"


def test_the_group_is_what_the_table_says_this_file_checks():
    table = server_options.load_table()
    group = {d for d, s in table.served.items() if s.test == TEST}
    typed = vars(parse_server_args(["--model-path", "m", *SCHEDULING]))
    defaults = vars(parse_server_args(["--model-path", "m"]))
    changed = {d for d in typed if typed[d] != defaults[d]} - {"model_path"}
    assert changed == group


fuzz_server = server_fixture("--enable-metrics", *SCHEDULING)


def _post(url, body, timeout=120):
    return requests.post(url + "/generate", json=body, timeout=timeout)


def _assert_answer(resp, body):
    """200, or a 4xx whose body says why: never a 5xx, never a silent 4xx."""
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (
        resp.status_code,
        resp.text[:300],
        json.dumps(body)[:300],
    )
    if resp.status_code != 200:
        assert len(resp.text.strip()) > 10, (resp.status_code, resp.text, body)


def test_the_server_killing_request_and_its_relatives(fuzz_server):
    url = fuzz_server.url
    relatives = [
        KILLER,
        {GUARD_KEY: {"of": 3, "reused_tokens": 10**30}},
        {GUARD_KEY: "x"},
        {DP_ROUTE_KEY: "attacker-label"},
        {DP_ROUTE_KEY: {"x": 1}},
        {"__sglang_relay_anything_new": [1, 2]},
    ]
    before = relay_info(url)
    for params in relatives:
        body = {
            "text": "Hello there",
            "sampling_params": {"max_new_tokens": 4, "custom_params": params},
        }
        resp = _post(url, body)
        assert resp.status_code == 200, resp.text[:300]  # ignored: the keys never arrive
        assert healthy(url)
    after = relay_info(url)
    assert after.get("guard_reprefills", 0) == before.get("guard_reprefills", 0)
    assert not any("attacker" in k for k in after)


def _junk(rng, depth=0):
    leaves = [None, True, -1, 0, 10**9, 1e308, -0.5, 2**70, "", "relay", "κ", "x" * 300]
    kind = rng.randrange(6 if depth < 2 else 1)
    if kind == 0:
        return rng.choice(leaves)
    if kind in (1, 2):
        keys = ["relay", "method", "config", "reuse", "key", "store", "force", "zzz",
                GUARD_KEY, DP_ROUTE_KEY, "__sglang_relay_x", "l_start"]  # fmt: skip
        return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == 3:
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 4:
        return rng.choice(["relay", "epic", "cacheblend", "naive", "standard", "off", "warp"])
    return {"reuse": rng.choice([0.7, 0.9, "speed", "fidelity", 1.5, "x"]), "key": "k"}


def _body(rng, prompts):
    """One generated request: (body, how to send it)."""
    sp = {"max_new_tokens": rng.choice([1, 1, 2, 4]), "temperature": rng.choice([0, 0.8])}
    body = {"text": rng.choice(prompts), "sampling_params": sp}
    roll = rng.random()
    if roll < 0.35:
        sp["custom_params"] = _junk(rng)
    elif roll < 0.5:
        sp["custom_params"] = {"relay": _junk(rng)}
    elif roll < 0.55:
        sp["custom_params"] = dict(KILLER)
    elif roll < 0.62:
        sp["n"] = rng.choice([2, 3])
        sp["temperature"] = 0.8
    elif roll < 0.68:
        body["return_logprob"] = True
        body["top_logprobs_num"] = rng.choice([0, 1, 5, 50])
        body["logprob_start_len"] = rng.choice([-1, 0, 2, 10**6])
    elif roll < 0.71:
        sp["regex"] = rng.choice(["(yes|no)", "[0-9]{1,3}"])
    elif roll < 0.74:
        body.pop("text")
        body["input_ids"] = rng.choice([[VOCAB], [-1, 5], [1, 2, 10**12], [], [[1], [VOCAB + 7]]])
    elif roll < 0.76:
        body["text"] = rng.choice(["", "word " * 9000])
    elif roll < 0.8:
        sp["max_new_tokens"] = rng.choice([-1, 0, "x", 1.5, [4]])
    elif roll < 0.86:
        return body, "stream_close"
    elif roll < 0.9:
        return body, "abort"
    elif roll < 0.93:
        body["text"] = [rng.choice(prompts), rng.choice(prompts)]
        sp["custom_params"] = _junk(rng)
    if rng.random() < 0.2:
        sp["custom_params"] = {"relay": rng.choice(["relay", "epic", {"reuse": "speed"}])}
    return body, "post"


def _send(url, body, how):
    if how == "post":
        resp = _post(url, body)
        _assert_answer(resp, body)
        return resp.status_code
    if how == "stream_close":
        body = {**body, "stream": True}
        body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 16}
        with requests.post(url + "/generate", json=body, stream=True, timeout=120) as resp:
            _assert_answer(resp, body)
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    break  # closed mid-way
        return resp.status_code
    rid = uuid.uuid4().hex  # abort while it runs
    body = {**body, "rid": rid, "stream": True}
    body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 16}
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as resp:
        _assert_answer(resp, body)
        requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
        for _ in resp.iter_lines():
            pass
    return resp.status_code


def _rss_mb(pid):
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def _event_labels(url):
    text = requests.get(url + "/metrics", timeout=30).text
    return {line.split("{", 1)[1].split("}", 1)[0] for line in text.splitlines()
            if line.startswith("sglang_relay:events_total{")}  # fmt: skip


def test_fuzzed_requests_never_break_the_server(fuzz_server, tok, request):
    url = fuzz_server.url
    count = FUZZ_REQUESTS[bool(request.config.getoption("--full"))]
    rng = random.Random(44)
    prompts = [chat(tok, f"Agent {i}.", f"Say something about topic {i}.") for i in range(12)]
    prompts += ["Hi", "1 2 3", "\u0000\ufffd\U0001f600"]
    work = [_body(rng, prompts) for _ in range(count)]
    third = len(work) // 3
    t0 = time.monotonic()
    statuses: dict[int, int] = {}
    rss = []
    with cf.ThreadPoolExecutor(8) as pool:
        for i, part in enumerate((work[:third], work[third:])):
            for code in pool.map(lambda w: _send(url, *w), part):
                statuses[code] = statuses.get(code, 0) + 1
            assert healthy(url)
            rss.append(_rss_mb(fuzz_server.proc.pid))
            if i == 0:
                keys_after_first = len(relay_info(url))
    elapsed = time.monotonic() - t0
    print(f"fuzz: {len(work)} requests in {elapsed:.0f} s, statuses {statuses}, RSS {rss} MB")
    assert statuses.get(200, 0) > len(work) // 3  # most generated requests are good ones
    info = relay_info(url)
    assert len(info) <= MAX_EVENTS
    assert len(info) <= keys_after_first + 16, set(info)  # no label per fuzzed value
    assert len(_event_labels(url)) <= MAX_EVENTS
    assert rss[1] - rss[0] < 256, rss  # 2/3 of the requests after the first third


def _chain(url, tok, k):
    up = generate(url, chat(tok, f"Writer {k}.", f"Describe machine {k} in detail."), n=120)
    relayed = generate(url, chat(tok, "Reviewer.", f"Draft:\n\n{up['text']}\n\nList points."))
    prompt = chat(tok, "Editor.", f"Draft:\n\n{up['text']}\n\nShorten it.")
    exact = generate(url, prompt, relay={"method": "relay", "config": ALL_SELECTED})
    std = generate(url, prompt, relay="standard")
    return relayed, exact, std


def test_chains_still_relay_after_the_fuzz(fuzz_server, tok):
    url = fuzz_server.url
    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda k: _chain(url, tok, k), range(3)))
    for relayed, exact, std in results:
        assert relayed["meta_info"]["relay"]["reused_tokens"] > 0
        assert exact["meta_info"]["relay"]["spans_matched"] >= 1
        assert exact["output_ids"] == std["output_ids"]
