"""The scheduling options the allow-list serves (runtime/server_options.toml, "checked
together" group), all set to non-default values on one relay server: chains run
concurrently, and relay with every span token recomputed equals standard prefill."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import requests
from relay_helpers import ALL_SELECTED, chat, generate, running_server

from sglang_relay.runtime import compat, server_options

pytestmark = pytest.mark.e2e

SCHEDULING = [
    "--max-running-requests", "8", "--max-queued-requests", "64",
    "--max-prefill-tokens", "512", "--prefill-max-requests", "2",
    "--schedule-policy", "lpm", "--schedule-conservativeness", "1.5",
    "--prefill-decode-interval", "2", "--scheduler-recv-interval", "2",
    "--stream-interval", "4", "--disable-overlap-schedule",
]  # fmt: skip
TEST = "test/e2e/test_served_options.py"


def test_the_group_is_what_the_table_says_this_file_checks():
    table = server_options.load_table()
    group = {d for d, s in table.served.items() if s.test == TEST}
    typed = vars(compat.parse_server_args(["--model-path", "m", *SCHEDULING]))
    defaults = vars(compat.parse_server_args(["--model-path", "m"]))
    changed = {d for d in typed if typed[d] != defaults[d]} - {"model_path"}
    assert changed == group


@pytest.fixture(scope="module")
def sched_server(model_dir):
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192", *SCHEDULING]
    with running_server(args) as proc:
        yield proc


def _chain(url, tok, k):
    up = generate(url, chat(tok, f"Writer {k}.", f"Describe machine {k} in detail."), n=120)
    prompt = chat(tok, "Editor.", f"Draft:\n\n{up['text']}\n\nShorten it.")
    relayed = generate(url, chat(tok, "Reviewer.", f"Draft:\n\n{up['text']}\n\nList points."))
    exact = generate(url, prompt, relay={"method": "relay", "config": ALL_SELECTED})
    std = generate(url, prompt, relay="standard")
    return relayed, exact, std


def test_relay_is_exact_under_the_scheduling_options(sched_server, tok):
    url = sched_server.url
    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda k: _chain(url, tok, k), range(3)))
    for relayed, exact, std in results:
        assert relayed["meta_info"]["relay"]["reused_tokens"] > 0
        assert exact["meta_info"]["relay"]["spans_matched"] >= 1
        assert exact["output_ids"] == std["output_ids"]
    body = {
        "text": chat(tok, "Helper.", "Count to ten."),
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "stream": True,
    }
    chunks = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                chunks.append(json.loads(line[len(b"data:") :]))
    assert chunks and chunks[-1]["meta_info"]["finish_reason"] is not None
