"""Real agent frameworks as clients (examples/): AutoGen AgentChat and LangGraph, unchanged,
against the session's relay server, and LangGraph with a chain key through sglang-router.

Each run reports the share of its prompt tokens the server relayed (``relayed_tokens`` of
``/get_server_info`` over SGLang's ``sglang:prompt_tokens_total``, deltas across the run).
The same group chat with relay off per request (standard prefill, outputs still stored as
spans; ``custom_params.relay`` through the framework's extra body) relays nothing: the
share is relay's doing. (That option reaching the server's request body from both
frameworks, and the chain key's header, are checked on a stand-in server.)
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from relay_helpers import relay_info

pytestmark = [pytest.mark.e2e, pytest.mark.model]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import autogen_group_chat  # noqa: E402
import langgraph_pipeline  # noqa: E402

# Generated tokens per agent: a reply must reach min_span (32 tokens) to be relayable; the
# share grows with it (SmolLM2-135M at 64: 0.55 for the group chat, 0.4-0.55 for the
# pipeline, whose planner may stop early).
MAX_TOKENS = 64
MIN_SHARE = 0.3
# relay off for these requests (standard prefill), their outputs still stored as spans
RELAY_OFF = {"custom_params": {"relay": {"method": "standard", "store": True}}}


def _spans_recorded(url: str) -> int:
    return relay_info(url)["recorded_spans"]


def _report(name: str, res) -> None:
    c = res.counters
    print(
        f"\n{name}: relayed {c.relayed_tokens} of {c.prompt_tokens} prompt tokens "
        f"(share {c.share:.2f}) in {res.seconds:.1f} s"
    )


def _check_group_chat(res) -> None:
    messages, stop_reason = res.value
    names = [name for name, _ in autogen_group_chat.AGENTS]
    assert [source for source, _ in messages] == ["user", *names], messages
    assert all(content.strip() for _, content in messages), messages
    assert stop_reason and "Maximum number of messages" in stop_reason, stop_reason


def test_autogen_group_chat_is_relayed_with_no_client_change(server):
    res = autogen_group_chat.run(
        server.url + "/v1",
        "Design a Python function that merges overlapping intervals.",
        max_tokens=MAX_TOKENS,
    )
    _report("autogen group chat", res)
    _check_group_chat(res)
    assert res.counters.prompt_tokens > 0
    assert res.relay_share >= MIN_SHARE, res.counters


def test_autogen_group_chat_with_relay_off_relays_nothing(server):
    spans = _spans_recorded(server.url)
    res = autogen_group_chat.run(
        server.url + "/v1",
        "Design a Python function that parses ISO dates.",
        max_tokens=MAX_TOKENS,
        extra_body=RELAY_OFF,
    )
    _report("autogen group chat, relay off", res)
    _check_group_chat(res)
    # the replies were stored, relayable (>= 32 tokens), yet nothing was relayed
    assert _spans_recorded(server.url) - spans >= 2
    assert res.counters.prompt_tokens > 0 and res.counters.relayed_tokens == 0, res.counters


def _check_pipeline(res) -> None:
    messages = langgraph_pipeline.messages(res.value)
    assert [node for node, _ in messages] == ["plan", "draft", "critique"], res.value
    assert all(text.strip() for _, text in messages), res.value


@pytest.fixture(scope="module")
def router(server):
    """sglang-router, manual policy (sticky per X-SMG-Routing-Key), in front of the server."""
    from sglang_relay.process import RouterProcess

    args = ["--policy", "manual", "--worker-startup-check-interval", "1"]
    args += ["--shutdown-grace-period-secs", "1", "--log-level", "warn"]
    with RouterProcess(args, workers=[server.url]) as proc:
        yield proc


def test_langgraph_pipeline_with_a_chain_key_through_sglang_router(server, router):
    res = langgraph_pipeline.run(
        router.url + "/v1",
        "Write a short post on why unit tests make refactoring safer.",
        chain_key="chain-langgraph-1",
        max_tokens=MAX_TOKENS,
        counter_urls=[server.url],
    )
    _report("langgraph pipeline via sglang-router", res)
    _check_pipeline(res)
    assert res.counters.prompt_tokens > 0
    assert res.relay_share >= MIN_SHARE, res.counters


class _Recorder(BaseHTTPRequestHandler):
    """A stand-in OpenAI server: records each request's headers and body, answers "ok"."""

    seen: list[tuple[dict[str, str], dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
        reply = {
            "id": "r",
            "object": "chat.completion",
            "created": 0,
            "model": "default",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def recorder():
    _Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", _Recorder.seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_chain_key_is_one_header_on_every_request(recorder):
    """What a chain key costs across servers: one header (the one sglang-router's manual
    policy routes by), set once on the framework's client and sent on every request of the
    chain; the per-request relay option reaches the body through the extra body."""
    url, seen = recorder
    client = autogen_group_chat.make_client(url, chain_key="chat-7", extra_body=RELAY_OFF)
    asyncio.run(autogen_group_chat.run_chat("task", client, rounds=1))
    llm = langgraph_pipeline.make_llm(url, chain_key="pipe-7", extra_body=RELAY_OFF)
    langgraph_pipeline.build_graph(llm).invoke({"task": "task"})
    keys = [headers.get("x-smg-routing-key") for headers, _ in seen]
    assert keys == ["chat-7"] * 3 + ["pipe-7"] * 3
    assert all(body["custom_params"] == RELAY_OFF["custom_params"] for _, body in seen)
    assert all(body["temperature"] == 0 for _, body in seen)

    seen.clear()  # no key: no header, nothing else to set
    asyncio.run(autogen_group_chat.run_chat("task", autogen_group_chat.make_client(url), rounds=1))
    langgraph_pipeline.build_graph(langgraph_pipeline.make_llm(url)).invoke({"task": "task"})
    assert len(seen) == 6 and not any("x-smg-routing-key" in h for h, _ in seen)
    assert not any("custom_params" in body for _, body in seen)
