"""The real SGLang runtime on loopback with the relay plug-in loaded."""

from __future__ import annotations

import pytest
import requests
import torch

from sglang_relay.client import healthy

pytestmark = pytest.mark.e2e

GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "List three colors of the rainbow:\n1.",
]


def test_health(server):
    assert healthy(server.url)


def test_on_the_cpu_the_servers_processes_fork_from_one_preloaded_process(server):
    """CPU stand-in (runtime/standin/cpu.py): the scheduler and detokenizer are forked by
    multiprocessing's forkserver, one child of the launcher that imported their modules
    once, instead of each being spawned and importing SGLang again."""
    import psutil

    from sglang_relay.runtime.platform import cuda_available
    from sglang_relay.runtime.standin import cpu

    if cuda_available():
        pytest.skip("on a GPU SGLang spawns its processes")
    launcher = psutil.Process(server.proc.pid)
    (fork_server,) = [
        c for c in launcher.children() if "multiprocessing.forkserver" in " ".join(c.cmdline())
    ]
    assert all(module in " ".join(fork_server.cmdline()) for module in cpu.FORKSERVER_PRELOAD)
    forked = {c.name() for c in fork_server.children()}
    assert {"sglang::scheduler", "sglang::detokenizer"} <= forked, forked
    assert not [c for c in launcher.children() if c.name().startswith("sglang::")]
    # the forkserver imported them with the collector paused (runtime/import_gc.py): the
    # scheduler runs with it on again, the imported objects frozen
    collector = requests.get(server.url + "/get_server_info", timeout=30).json()
    collector = collector["internal_states"][0]["relay"]["gc"]
    assert collector["enabled"] is True and collector["frozen_objects"] > 100_000, collector


def test_the_launcher_forked_from_the_tests_preloaded_parent(server):
    """The session server's launcher ran on this test process's preloaded parent
    (test/e2e/launcher_zygote.py), not a fresh interpreter, and serves with relay's plug-in
    loaded (its scheduler reports relay's state, the collector on)."""
    import os
    from pathlib import Path

    from launcher_zygote import FORKED, ZYGOTE_ENV

    if os.environ.get(ZYGOTE_ENV) == "0":
        pytest.skip(f"{ZYGOTE_ENV}=0: every launcher spawned")
    assert FORKED in Path(server.log_path).read_text(errors="replace")
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["radix_cache_backend"] == "relay"
    assert info["internal_states"][0]["relay"]["gc"]["enabled"] is True


def test_relay_backend_is_the_schedulers_tree_cache(server):
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["radix_cache_backend"] == "relay"
    relay = info["internal_states"][0]["relay"]
    assert relay["enabled"] is True
    assert relay["backend"] == "RelayRadixCache"
    assert relay["architecture"] == "LlamaForCausalLM"
    assert relay["hicache"] is False  # no host tier unless --enable-hierarchical-cache
    # read from SGLang's published graph config (the CPU server runs without graphs)
    assert relay["cuda_graphs"] == {"decode": False, "prefill": False}
    assert relay["extend_attention"] == "torch"


def test_generate_and_output_spans_are_recorded(server):
    def finished():
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        return info["internal_states"][0]["relay"]["finished_requests"]

    before = finished()
    resp = requests.post(
        server.url + "/generate",
        json={"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 8}},
        timeout=120,
    )
    assert resp.status_code == 200
    body = resp.json()
    assert body["meta_info"]["completion_tokens"] == 8
    assert body["text"]
    assert finished() == before + 1


def test_greedy_tokens_match_transformers(server, model_dir):
    """Same weights, same tokenizer, fp32: SGLang's greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = 24
    for prompt in GREEDY_PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
            )[0, len(ids) :].tolist()
        resp = requests.post(
            server.url + "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            },
            timeout=120,
        ).json()
        assert resp["output_ids"] == ref, prompt


def test_openai_chat_completions(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    assert out.choices[0].message.content
    assert out.usage.completion_tokens <= 12


def test_frontend_fork_gen(server):
    import sglang as sgl

    @sgl.function
    def relay(s, task):
        s += sgl.system("You are helpful.")
        s += sgl.user(task)
        s += sgl.assistant(sgl.gen("plan", max_tokens=16, temperature=0))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.user(f"Variant {i}: improve the plan.")
            f += sgl.assistant(sgl.gen("better", max_tokens=8, temperature=0))
        s["variants"] = [f["better"] for f in forks]

    backend = sgl.RuntimeEndpoint(server.url)
    state = relay.run(task="Plan a picnic.", backend=backend)
    assert state["plan"]
    assert len(state["variants"]) == 2 and all(state["variants"])
