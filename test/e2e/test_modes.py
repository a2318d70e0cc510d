"""The mode matrix (docs/limitations.md) on the real runtime: every refused option is
refused with one message naming it, by ``sglang-relay serve`` and by the scheduler under
SGLang's own launcher; supported modes serve relay correctly."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from relay_helpers import ALL_SELECTED, chat, generate, relay_info, running_server

from sglang_relay.client import healthy
from sglang_relay.errors import RelayError

pytestmark = pytest.mark.e2e

# one row per refused option of docs/limitations.md: (flags, words the message must name)
REFUSED = [
    (["--pp-size", "2"], "--pp-size 2"),
    (["--attn-dp-size", "2"], "--attn-dp-size"),
    (["--kv-cache-dtype", "nvfp4"], "--kv-cache-dtype nvfp4"),
    (["--quantization", "mxfp4"], "--quantization mxfp4"),
    (["--load-format", "gguf"], "GGUF"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm EAGLE3"),
    (["--enable-lora"], "--enable-lora"),
    (["--lora-paths", "a=/nonexistent"], "--lora-paths"),
    (
        ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
        "--hicache-write-policy write_back",
    ),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
    (["--enable-deterministic-inference"], "--enable-deterministic-inference"),
    (["--disable-radix-cache"], "--disable-radix-cache"),
    (["--dllm-algorithm", "LowConfidence"], "--dllm-algorithm"),
    (["--enable-hisparse"], "--enable-hisparse"),
    (["--enable-pdmux"], "--enable-pdmux"),
    (["--attn-cp-size", "2"], "--attn-cp-size 2"),
    (["--enable-prefill-cp"], "--enable-prefill-cp"),
    (["--dcp-size", "2"], "--dcp-size 2"),
    (["--enable-attn-tp-input-scattered"], "--enable-attn-tp-input-scattered"),
    (["--enable-layernorm-sp"], "--enable-layernorm-sp"),
    (["--prefill-only-disable-kv-cache"], "--prefill-only-disable-kv-cache"),
]


def test_the_matrix_in_the_docs_lists_every_refusal():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "limitations.md").read_text()
    for _, needle in REFUSED:
        assert needle.split()[0] in doc, needle


@pytest.mark.parametrize("flags, needle", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_serve_refuses_with_one_message_naming_the_option(model_dir, flags, needle):
    from sglang_relay.launch import prepare

    with pytest.raises(RelayError) as info:
        prepare(["--model-path", str(model_dir), *flags])
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert "serve without relay" in message  # the way out


def test_serve_refusal_is_one_error_line_and_exit_code_1(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_relay.cli", "serve", "--model-path", str(model_dir),
         "--pp-size", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "sglang-relay: error" in line]
    assert len(lines) == 1 and "--pp-size 2" in lines[0], proc.stderr[-2000:]


def test_sglangs_own_launcher_is_refused_before_any_child_starts(model_dir, tmp_path):
    """``python -m sglang.launch_server --radix-cache-backend relay`` never passes through
    ``sglang-relay serve``: the plug-in, loaded by SGLang's launcher, refuses before the
    launcher starts a scheduler (which would refuse too, with the same message, once its
    imports are done: test/unit/test_modes_resolved.py builds the cache with it)."""
    from sglang_relay import cpu_setup as cpu
    from sglang_relay.process import free_port

    env = dict(os.environ)
    if cpu.activate():
        env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.environ["PYTHONPATH"])
        env[cpu.CPU_STANDIN_ENV] = "1"
    args = ["--model-path", str(model_dir), "--radix-cache-backend", "relay"]
    args += ["--enable-attn-tp-input-scattered", "--port", str(free_port()), "--host", "127.0.0.1"]
    if not cpu.cuda_available():
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32"]
        args += ["--disable-cuda-graph", "--max-total-tokens", "4096"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0
    assert "sglang-relay cannot serve --enable-attn-tp-input-scattered" in text, text[-3000:]
    assert "_set_envs_and_config" in text and "Scheduler" not in text, text[-3000:]


# ---- supported modes, end to end --------------------------------------------------------


def _long_upstream(url, tok, k, n=520):
    return generate(url, chat(tok, f"Historian {k}.", "Write a long history of bridges."), n=n)


@pytest.mark.full  # mixed chunks: test_pages.py's CI case runs --enable-mixed-chunk; make test-full
def test_mixed_chunk_keeps_decoded_spans_usable(model_dir, tok):
    """With --enable-mixed-chunk SGLang appends running decodes to prefill batches and runs
    them as extends: those decode rows still store their hidden states, so a span decoded
    while other prompts prefilled relays without trimming; relays inside mixed batches are
    exact when everything is recomputed."""
    import concurrent.futures as cf

    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192"]
    args += ["--enable-mixed-chunk", "--chunked-prefill-size", "64"]
    with running_server(args) as server:
        with cf.ThreadPoolExecutor(4) as pool:
            up = pool.submit(_long_upstream, server.url, tok, "mixed", 200)
            time.sleep(2.0)  # A decodes while these prefill: mixed batches
            others = [
                pool.submit(generate, server.url, chat(tok, f"Helper {i}.", "Tell a story " * 40))
                for i in range(3)
            ]
            a = up.result()
            [f.result() for f in others]
        assert relay_info(server.url).get("mixed_batches", 0) > 0  # mixing really happened
        prompt = chat(tok, "Critic.", f"History:\n\n{a['text']}\n\nCritique it.")
        info = generate(server.url, prompt, relay="relay")["meta_info"]["relay"]
        assert info["reused_tokens"] >= 150 and info["trimmed_tokens"] == 0, info
        assert info["fallback"] is None, info
        # the oracle relays while a long decode runs: its prefill is mixed with it (and it
        # goes before standard, whose exact KV would otherwise be a full prefix hit)
        prompt = chat(tok, "Second critic.", f"History:\n\n{a['text']}\n\nCritique it.")
        with cf.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(_long_upstream, server.url, tok, "busy", 120)
            time.sleep(2.0)
            oracle = generate(server.url, prompt, relay={"method": "relay", "config": ALL_SELECTED})
            busy.result()
        assert oracle["meta_info"]["relay"]["reused_tokens"] >= 150
        assert oracle["output_ids"] == generate(server.url, prompt, relay="standard")["output_ids"]
        assert healthy(server.url)
