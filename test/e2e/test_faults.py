"""Relay's safety nets under injected faults (the test-only plug-in
``fault_plugin/relay_test_faults.py``), on real servers.

* A model forward that skips relay's hook (as an option that replaced SGLang's forward
  would) writes KV relay never stamped: the runtime invariant turns relay off for the rest
  of the server's life; every later request runs standard prefill and says why.
* A scheduler killed outright takes the whole server down (SGLang's watchdog sees it through
  the CPU stand-in's forkserver as through a spawn): no server is left up that answers nothing.
* Under ``--tp-size 2``, a relay extend fails on one rank only, at each point before its
  first collective: planning (rank 1), relay's own memory bound (rank 0: no memory free
  for its buffers), preparing the extend (rank 1: splicing the spans raises). Every rank
  falls back together (no rank left waiting in a collective), the answer equals standard
  prefill, the reason names the failure, and the next relayed prompt relays.
* Recording a finished output fails (its context masses, computed inside SGLang's
  ``cache_finished_req``): the span is dropped and counted, the request's answer is
  unchanged, the server keeps serving (it used to end the scheduler)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from fault_plugin.relay_test_faults import server_env
from relay_helpers import chat, generate, generate_ids, relay_info, running_server

from sglang_relay.client import healthy

pytestmark = pytest.mark.e2e


def test_a_forward_past_the_hook_turns_relay_off(model_dir, tok):
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192"]
    with running_server(args, env=server_env("bypass_forward@200")) as server:
        url = server.url
        up = generate(url, chat(tok, "Writer.", "Describe a harbour in detail."), n=120)
        relayed = generate(url, chat(tok, "Reviewer.", f"Draft:\n\n{up['text']}\n\nJudge it."))
        assert relayed["meta_info"]["relay"]["reused_tokens"] > 0  # on before the fault
        assert relay_info(url)["disabled"] is None
        for i in range(200):  # forwards until the bypassed one
            generate(url, chat(tok, "Helper.", f"Count to {i}."), n=4, relay="standard")
            info = relay_info(url)
            if info["disabled"] is not None:
                break
        assert "without passing relay's hook" in info["disabled"], info["disabled"]
        assert info["relay_disabled"] == 1
        spans = info["recorded_spans"]
        prompt = chat(tok, "Editor.", f"Draft:\n\n{up['text']}\n\nShorten it.")
        out = generate(url, prompt, n=24)
        assert out["meta_info"]["relay"]["fallback"].startswith("relay_disabled")
        assert out["meta_info"]["relay"]["reused_tokens"] == 0
        std = generate(url, prompt, n=24, relay="standard")
        assert out["output_ids"] == std["output_ids"]
        generate(url, chat(tok, "Writer.", "Describe a market in detail."), n=48)
        assert relay_info(url)["recorded_spans"] == spans  # nothing stored any more
        assert healthy(url)
        # a scheduler that dies takes the whole server down (SGLang's watchdog, also when
        # the scheduler was forked by the CPU stand-in's forkserver): no server left up
        # answering nothing
        launcher = psutil.Process(server.proc.pid)
        (scheduler,) = [
            c for c in launcher.children(recursive=True) if c.name() == "sglang::scheduler"
        ]
        scheduler.kill()
        server.proc.wait(timeout=120)
        assert not healthy(url, wait_s=1)


@pytest.fixture(scope="module")
def tp_model(model_dir, tmp_path_factory) -> Path:
    from sglang_relay.bench.models import random_llama

    return random_llama(tmp_path_factory.mktemp("faults") / "RandomLlama-tp", model_dir)


FAULTS = "plan_error@rank1:4001,scratch_full@rank0:4002,prepare_error@rank1:4003"


@pytest.mark.model
def test_a_relay_extend_failing_on_one_tp_rank_falls_back_on_all(tp_model):
    args = ["--model-path", str(tp_model), "--tp", "2", "--max-total-tokens", "8192"]
    with running_server(args, env=server_env(FAULTS)) as server:
        url = server.url
        up = generate_ids(url, list(range(1000, 1040)), 96)
        span = up["output_ids"]
        expected = {
            4001: "tp_mismatch: plans differ across ranks",  # rank 1 planned nothing
            4002: "memory: relay needs",  # rank 0's own bound, before the forward
            4003: "tp_mismatch: error on another TP rank",  # rank 1's splice raised
        }
        for marker, reason in expected.items():
            prompt = [marker, *range(2000, 2030), *span, *range(3000, 3020)]
            out = generate_ids(url, prompt, 16)  # would hang if a rank waited in a collective
            relay = out["meta_info"]["relay"]
            assert relay["reused_tokens"] == 0 and relay["fallback"].startswith(reason), relay
            std = generate_ids(url, prompt, 16, relay="standard")
            assert out["output_ids"] == std["output_ids"]
        info = relay_info(url)
        assert info.get("relay_extends", 0) == 0 and info["disabled"] is None, info
        assert info["fallback_tp_mismatch"] >= 2 and info["fallback_memory"] >= 1, info
        # the ranks' collectives stayed paired: an unmarked prompt relays
        out = generate_ids(url, [*range(2000, 2030), *span, *range(3000, 3020)], 16)
        assert out["meta_info"]["relay"]["reused_tokens"] > 0, out["meta_info"]["relay"]
        assert relay_info(url)["relay_extends"] == 1
        assert healthy(url)


@pytest.mark.model
def test_a_span_recording_failure_drops_the_span_not_the_server(tp_model):
    import json

    from relay_helpers import CONTEXT_RULE_AT_2

    env = {**server_env("record_error"), "SGLANG_RELAY_CONFIG": json.dumps(CONTEXT_RULE_AT_2)}
    args = ["--model-path", str(tp_model), "--max-total-tokens", "8192"]  # no profile
    with running_server(args, env=env) as server:
        url = server.url
        head = list(range(1000, 1040))
        up = generate_ids(url, head, 48)  # its recording fails after the answer is final
        assert up["output_ids"] == generate_ids(url, head, 48, relay="standard")["output_ids"]
        info = relay_info(url)
        assert info.get("span_record_errors", 0) >= 1 and info.get("recorded_spans", 0) == 0
        span = up["output_ids"][:-1]
        down = generate_ids(url, [*range(2000, 2030), *span], 4)  # nothing stored to relay
        assert down["meta_info"]["relay"]["reused_tokens"] == 0
        assert healthy(url)
