"""The GPU kernels inside the real server: the relay extend with Triton's splice, row
gather/scatter and positional attention (run by Triton's interpreter on a CPU) serves
what the pure-torch path serves."""

from __future__ import annotations

import pytest
from relay_helpers import (
    ALL_SELECTED,
    chat,
    first_logprobs,
    generate,
    relay_info,
    server_fixture,
)

# Triton under its CPU interpreter (minutes): kernels/tests checks the kernels in CI
pytestmark = [pytest.mark.e2e, pytest.mark.full]


triton_server = server_fixture(
    kv_tokens=4096, env={"SGLANG_RELAY_KERNELS": "triton", "TRITON_INTERPRET": "1"}, needs="triton"
)


def _chain(url, tok, **relay):
    up = generate(
        url,
        chat(tok, "You are a planner.", "List four steps to rename a Python module safely."),
        n=64,  # a span of 64 under the interpreter: the oracle below runs it through every layer
    )
    prompt = chat(tok, "You are a reviewer.", f"Plan:\n\n{up['text']}\n\nOne risk, briefly.")
    return up, generate(url, prompt, n=3, logprobs=True, **relay), prompt


def test_triton_relay_extend_serves_what_torch_serves(server, triton_server, tok):
    info = relay_info(triton_server.url)
    assert info["kernels"] == "triton" and info["extend_attention"] == "triton"
    assert relay_info(server.url)["kernels"] == "torch"

    up_t, down_t, prompt = _chain(triton_server.url, tok)
    up_c, down_c, _ = _chain(server.url, tok)
    assert up_t["output_ids"] == up_c["output_ids"]  # decode: the same torch loop on both
    rt, rc = down_t["meta_info"]["relay"], down_c["meta_info"]["relay"]
    assert rt["fallback"] is None and rt["spans_matched"] >= 1
    for key in ("reused_tokens", "selected_tokens", "recomputed_token_layers"):
        assert rt[key] == rc[key], key
    a, b = first_logprobs(down_t), first_logprobs(down_c)
    assert a.keys() == b.keys()
    for tid in a:
        assert a[tid] == pytest.approx(b[tid], abs=1e-4)
    assert down_t["output_ids"] == down_c["output_ids"]

    # METHOD.md's oracle through the kernels: everything recomputed equals standard prefill
    every = {"method": "relay", "config": ALL_SELECTED}
    full = generate(triton_server.url, prompt, n=3, logprobs=True, relay=every)
    std = generate(triton_server.url, prompt, n=3, logprobs=True, relay="standard")
    assert full["meta_info"]["relay"]["spans_matched"] >= 1
    assert full["meta_info"]["relay"]["reuse_rate"] == 0.0
    a, b = first_logprobs(full), first_logprobs(std)
    for tid in a:
        assert a[tid] == pytest.approx(b[tid], abs=2e-4)
    assert full["output_ids"] == std["output_ids"]
    info = relay_info(triton_server.url)
    assert info["relay_extends"] >= 2 and info.get("fallback_error", 0) == 0
