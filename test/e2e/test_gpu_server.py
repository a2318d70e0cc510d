"""The first GPU run's server (``make gpu-check``'s ``server-bf16-graphs`` step, docs/gpu.md):
a relay server on the embedded model on a CUDA GPU, with FlashInfer and decode CUDA graphs
(serve's GPU defaults; gpu-check adds ``--dtype bfloat16`` through
SGLANG_RELAY_TEST_SERVER_ARGS), checked against the reference executor. Skipped without CUDA.

The reference executor computes in fp32. In fp32 the server must match it to 2e-3 in
logprobs, as test_server_vs_reference.py asserts; in bf16 a server differs from it by its
own rounding, so relay's gap to the reference is bounded by SGLang's own gap on the same
prompt (cold standard prefill against the reference's exact prefill), and the all-selected
oracle's gap to standard by SGLang's cold-vs-prefix-hit gap (``bench quantized``'s check).
The measured gaps are recorded (``record_property``: gpu-check's JSON lists them)."""

from __future__ import annotations

import pytest
import requests
import torch
from relay_helpers import generate_ids, relay_info, review_prompt, server_fixture

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)"),
]

gpu_server = server_fixture(kv_tokens=16384)

UPSTREAM_TOKENS = 96  # decoded at batch size 1: every step a graph replay
EXACT_TOL = 2e-3  # fp32 server vs fp32 reference (test_server_vs_reference.py)
ROUNDED_FLOOR = 0.05  # 16-bit server: the least gap allowed, whatever SGLang's own is


def _server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()


def _counter(info: dict, key: str) -> int:
    return int(info.get(key, 0) or 0)


@pytest.fixture(scope="module")
def run(gpu_server, model_dir, tok) -> dict:
    """One upstream decoded by the server (bs 1, under graphs), the relay counters around
    it, and the reference executor's teacher-forced record of the same tokens."""
    url = gpu_server.url
    before = relay_info(url)
    up_ids = tok.apply_chat_template(
        [{"role": "user", "content": "Explain how a hash map handles collisions, step by step."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    up_ids = list(getattr(up_ids, "input_ids", up_ids))
    up = generate_ids(url, up_ids, UPSTREAM_TOKENS, return_logprob=True)
    after = relay_info(url)
    out = up["output_ids"]
    ref = R.load_model(str(model_dir))  # fp32, on the GPU
    record = R.generate(ref, [up_ids], len(out), force=[out])[0]  # the server's tokens
    exact = _server_info(url).get("dtype") in ("float32", "float")
    return {
        "url": url, "before": before, "after": after, "up_ids": up_ids, "up": up,
        "ref": ref, "record": record, "exact": exact,
    }  # fmt: skip


def test_the_decode_capture_runs_inside_the_cuda_graphs(run, record_property):
    before, after = run["before"], run["after"]
    assert before["cuda_graphs"]["decode"] is True, before["cuda_graphs"]
    assert before["cuda_graphs"]["prefill"] is False  # serve: relay extends run eager
    # installed before SGLang captured, and its ledger covers the pool as finally sized
    assert before["capture_in_graph"] is True
    assert before["kernels"] == "triton"  # compiled: the step removes TRITON_INTERPRET
    served = _server_info(run["url"])
    if served.get("attention_backend") == "flashinfer":
        assert before["extend_attention"] == "flashinfer"
    graphs = _counter(after, "graph_forwards_decode") - _counter(before, "graph_forwards_decode")
    eager = _counter(after, "forwards_decode") - _counter(before, "forwards_decode")
    record_property("graph_forwards_decode", graphs)
    record_property("dtype", served.get("dtype"))
    record_property("kv_budget", before.get("kv_budget"))
    assert graphs >= UPSTREAM_TOKENS - 1, (graphs, eager)
    assert eager == 0


def test_a_graph_decoded_upstream_follows_the_reference(run, record_property):
    """The server's tokens, teacher-forced through the reference: its greedy choice agrees
    (fp32: everywhere and to 2e-3 in logprobs; bf16: at 90 % of the steps at least)."""
    out = run["up"]["output_ids"]
    logits = R.teacher_forced(run["ref"], R.exact_prefill(run["ref"], run["up_ids"]), out)
    ref_lp = logits.double().log_softmax(-1)
    agree = float((logits.argmax(-1).cpu() == torch.tensor(out)).double().mean())
    served = [float(x[0]) for x in run["up"]["meta_info"]["output_token_logprobs"]]
    pairs = enumerate(zip(served, out, strict=True))
    gaps = [abs(lp - float(ref_lp[i, t])) for i, (lp, t) in pairs]
    record_property("upstream_argmax_agreement", round(agree, 4))
    record_property("upstream_max_logprob_gap", round(max(gaps), 5))
    record_property("upstream_mean_logprob_gap", round(sum(gaps) / len(gaps), 5))
    if run["exact"]:
        assert agree == 1.0 and max(gaps) <= EXACT_TOL, (agree, max(gaps))
    else:
        assert agree >= 0.9, agree


def _top_gap(served: dict, ref_logits: torch.Tensor) -> float:
    """The largest gap between the served first token's top-5 logprobs and the reference's."""
    ref_lp = ref_logits.double().log_softmax(-1)
    top = served["meta_info"]["output_top_logprobs"][0]
    return max(abs(lp - float(ref_lp[tid])) for lp, tid, _ in top)


def test_relay_of_a_graph_decoded_span_equals_the_reference(run, model_dir, tok, record_property):
    url, ref, record = run["url"], run["ref"], run["record"]
    cfg = settings_from_env(str(model_dir), {}).config  # the shipped profile, as the server
    span = record.span_tokens
    prompt, start = review_prompt(tok, span)
    top = {"return_logprob": True, "top_logprobs_num": 5}

    relayed = generate_ids(url, prompt, 4, **top)
    info = relayed["meta_info"]["relay"]
    assert info["fallback"] is None and info["spans_matched"] == 1, info
    assert info["reused_tokens"] == len(span)
    cold = generate_ids(url, prompt, 4, "standard", cache_salt="gpu-check-cold", **top)
    assert cold["meta_info"].get("cached_tokens", 0) == 0

    occ = R.SpanOccurrence(prompt_start=start, record=record, span_start=0, length=len(span))
    result = R.relay_prefill(ref, prompt, [occ], cfg)
    assert sum(result.selected) == pytest.approx(info["selected_tokens"], abs=1)
    assert result.reuse_rate == pytest.approx(info["reuse_rate"], abs=0.01)

    relay_gap = _top_gap(relayed, result.logits[-1])
    sglang_gap = _top_gap(cold, R.exact_prefill(ref, prompt).logits[-1])
    record_property("relay_vs_reference_gap", round(relay_gap, 5))
    record_property("sglang_vs_reference_gap", round(sglang_gap, 5))
    tol = EXACT_TOL if run["exact"] else max(ROUNDED_FLOOR, 2 * sglang_gap)
    assert relay_gap <= tol, (relay_gap, sglang_gap)
    ref_lp = result.logits[-1].double().log_softmax(-1)
    first = relayed["output_ids"][0]  # the reference's choice, or within tol of it
    assert float(ref_lp[first]) >= float(ref_lp.max()) - tol
    if run["exact"]:
        assert R.greedy_continue(ref, result, 4) == relayed["output_ids"]


def test_all_selected_relay_equals_standard_within_sglangs_own_gap(run, record_property):
    """``bench quantized``'s check on this server: every paste relays; the all-selected
    oracle's tokens equal cold standard's wherever SGLang's own prefix hit's do; its
    largest logprob gap is within SGLang's cold-vs-prefix-hit gap (or 1e-4)."""
    from sglang_relay.bench.quantized import check_prompt, verdict

    rows = [check_prompt(run["url"], k) for k in range(2)]
    record_property("oracle_gap", max(r["oracle_gap"] for r in rows))
    record_property("sglang_prefix_hit_gap", max(r["sglang_gap"] for r in rows))
    assert verdict(relay_info(run["url"]), rows) == [], rows


def test_graphs_served_every_decode_and_nothing_fell_back(run, record_property):
    info = relay_info(run["url"])
    eager = _counter(info, "forwards_decode") - _counter(run["before"], "forwards_decode")
    record_property("relay_extends", info.get("relay_extends"))
    assert eager == 0  # every decode above ran at a captured batch size
    assert info.get("fallbacks", 0) == 0 and info.get("fallback_error", 0) == 0
    assert info["relay_extends"] >= 4
    pool = info["pool"]  # no leaked slots: SGLang's conservation law when idle
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"]
