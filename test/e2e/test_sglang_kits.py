"""SGLang's own server test kits (``sglang/test/kits``, shipped inside the package) as a
conformance suite: each kit runs against a relay server and a ``--no-relay`` server of the
same settings on the embedded model, and every one of its tests must end the same way on
both (passed, failed, errored or skipped; a kit written for a larger model may fail some
tests on SmolLM2-135M, and must then fail them without relay too: here the decode kit's
math and colour prompts, one matched-stop string, the stress kit's concurrent and long
prompts, the branching kit and the abort kit end that way on both). ``make test`` runs the
API contract and decode-correctness kits; the full tier adds the matched-stop, scheduler
stress, prefix-branching and abort kits, and three kits run as functions, scaled to this
CPU: the radix-cache server kit (a random tree of 48 prompts instead of 400), the
multi-turn cache-hit kit (4 clients, 3 rounds; every round's ``cached_tokens`` must be the
same on both servers, not only the kit's lower bound), and the KL kit (decode logprobs vs
a fresh prefill of the same tokens; its LongBench prompts replaced by local ones, as its
in-memory cache takes them). Those kits paste nothing, so relay serves them as SGLang does.

Then the KL kit's measure with an upstream output pasted mid-prompt, so that relay
relays: each downstream prompt's reply is decoded on relayed KV and compared, by the
kit's own ``compare_kl_divergence``, with a fresh standard prefill of the same tokens.
Relay's value must stay under the bound below and under what the same flow gives with
nothing recomputed (``naive``), the baseline relay exists to beat."""

from __future__ import annotations

import importlib
import json
import unittest
from pathlib import Path

import numpy as np
import pytest
import requests
from relay_helpers import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.model]

CI_KITS = (  # ~25 s a server here
    "basic_api_contract_kit.BasicAPIContractMixin",
    "basic_decode_correctness_kit.BasicDecodeCorrectnessMixin",
)
FULL_KITS = (  # ~230 s a server here (matched stop decodes 1,000 tokens, stress 128 s)
    "matched_stop_kit.MatchedStopMixin",
    "basic_scheduler_stress_kit.BasicSchedulerStressMixin",
    "prefix_cache_branching_kit.PrefixCacheBranchingMixin",
    "abort_timeout_kit.AbortAllMixin",
)
CHUNK = 512  # --chunked-prefill-size of both servers (the branching kit's chunk)
FUNCTION_KITS = ("radix_cache_server", "cache_hit", "kl_divergence")  # full tier
# the kit's approximate KL over a pasted reply's tokens that relay must stay under (the
# shipped profile on the embedded model; the measured values are printed)
PASTED_KL_BOUND = 0.05
TOPICS = ("a lighthouse keeper", "a market at dawn", "a chess tournament", "a river town",
          "a mountain railway", "a night shift at a bakery")  # fmt: skip


def run_kit(path: str, url: str, model: str) -> dict[str, str]:
    """Every test of the kit ``module.Mixin`` against the server at ``url``: test name ->
    ``passed`` / ``failed`` / ``errored`` / ``skipped``."""
    module, _, name = path.rpartition(".")
    mixin = getattr(importlib.import_module(f"sglang.test.kits.{module}"), name)

    def flush_cache(cls):
        requests.post(cls.base_url + "/flush_cache", timeout=60)

    attrs = {"base_url": url, "process": None, "model": model, "cache_chunk_size": CHUNK,
             "flush_cache": classmethod(flush_cache)}  # fmt: skip
    case = type(f"{name}OnServer", (mixin, unittest.TestCase), attrs)
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(case)
    outcome = {t.id().rpartition(".")[2]: "passed" for t in suite}  # (run() drops them)
    result = unittest.TestResult()
    suite.run(result)
    for kind, items in (("failed", result.failures), ("errored", result.errors),
                        ("skipped", result.skipped)):  # fmt: skip
        for test, _ in items:
            outcome[test.id().rpartition(".")[2]] = kind
    return outcome


def _kits(request) -> tuple[str, ...]:
    return CI_KITS + (FULL_KITS if request.config.getoption("--full") else ())


def _text(i: int) -> str:
    return " ".join(f"Write about {TOPICS[(i + j) % len(TOPICS)]}, part {i}." for j in range(64))


def _prompts(model: str, n: int, length: int) -> list[list[int]]:
    """``n`` local prompts of ``length`` token ids (what the kits would read from a dataset)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.encode(_text(i))[:length] for i in range(n)]


def run_function_kit(kit: str, url: str, model: str, tmp: Path) -> object:
    """One of :data:`FUNCTION_KITS` against ``url``: ``passed`` / ``failed: ...``, or what
    the kit returned that both servers must agree on."""
    import random

    try:
        if kit == "radix_cache_server":
            from sglang.test.kits import radix_cache_server_kit as k

            random.seed(0)
            full = k.gen_radix_tree
            k.gen_radix_tree = lambda: full(num_nodes=48, chunk_len=32)
            try:
                k.run_radix_attention_test(url)
            finally:
                k.gen_radix_tree = full
            return "passed"
        if kit == "cache_hit":
            from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test

            data = tmp / "conversations.json"
            turns = [[{"from": "human", "value": _text(i)}, {"from": "gpt", "value": "ok"}]
                     for i in range(16)]  # fmt: skip
            data.write_text(json.dumps([{"conversations": t} for t in turns]))
            got = run_multiturn_cache_hit_test(url, model, num_clients=4, num_rounds=3,
                                               request_length=96, output_length=16,
                                               dataset_path=str(data))  # fmt: skip
            return {r: v["cache_hit_rate"] for r, v in got["rounds"].items()}
        if kit == "kl_divergence":
            from sglang.test import kl_test_utils as kl

            key = f"{model}_{kl.DEFAULT_PROMPT_TOKENS}_{kl.DEFAULT_NUM_SAMPLES}"
            kl._cached_input_ids[key] = _prompts(model, kl.DEFAULT_NUM_SAMPLES, 160)
            thresholds = {model: {"kl_div": 1e-3}}
            kl.test_input_output_logprobs_match_prefill_cache_hit_helper(
                url, thresholds, model, max_samples=4, max_new_tokens=16)  # fmt: skip
            kl.test_input_output_logprobs_match_decode_cache_hit_helper(
                url, thresholds, model, max_samples=4, max_new_tokens=16)  # fmt: skip
            return "passed"
    except AssertionError as exc:
        return f"failed: {str(exc)[:80]}"
    raise ValueError(kit)


def test_sglangs_server_kits_end_the_same_with_and_without_relay(model_dir, request, tmp_path):
    kits = _kits(request)
    functions = FUNCTION_KITS if request.config.getoption("--full") else ()
    args = ["--model-path", str(model_dir), "--chunked-prefill-size", str(CHUNK)]
    outcomes = {}
    for name, extra in (("relay", []), ("plain", ["--no-relay"])):
        with running_server([*args, *extra]) as server:
            outcomes[name] = {kit: run_kit(kit, server.url, str(model_dir)) for kit in kits}
            for kit in functions:
                outcomes[name][kit] = run_function_kit(kit, server.url, str(model_dir), tmp_path)
    for kit in functions:
        assert outcomes["relay"][kit] == outcomes["plain"][kit], (kit, outcomes)
        assert outcomes["relay"][kit] != "failed" or kit == "kl_divergence", outcomes
    for kit in kits:
        relay, plain = outcomes["relay"][kit], outcomes["plain"][kit]
        assert relay == plain, (kit, relay, plain)
        assert relay and set(relay.values()) <= {"passed", "failed", "errored", "skipped"}
    # the API contract holds on this model with or without relay
    assert set(outcomes["relay"][CI_KITS[0]].values()) == {"passed"}, outcomes["relay"]


def _pasted_kl(url: str, model: str, relay: str | None) -> tuple[float, list[int]]:
    """The KL kit's measure on downstream prompts that paste an upstream reply mid-prompt
    (their replies decoded with ``relay`` as the relay option), against a fresh standard
    prefill of the same tokens; and each downstream's reused tokens."""
    from relay_helpers import generate_ids
    from sglang.test import kl_test_utils as kl

    kl._flush_cache(url)  # no prefix hit from an earlier round's prefill of these prompts
    heads = _prompts(model, len(TOPICS), 40)
    outputs, prompts, reused = [], [], []
    for i, head in enumerate(heads):
        span = generate_ids(url, head, 96)["output_ids"][:-1]  # an agent's reply, recorded
        prompt = [*heads[(i + 1) % len(heads)][:24], *span, *head[:16]]  # pasted mid-prompt
        out = generate_ids(url, prompt, 16, relay=relay, return_logprob=True)
        reused.append(out["meta_info"]["relay"]["reused_tokens"])
        prompts.append(prompt + out["output_ids"])
        outputs.append(kl._extract_output_logprobs(out))
    prefilled = kl._get_input_logprobs(url, prompts, outputs)  # flushes: standard prefill
    logr = [np.array(a) - np.array(b) for a, b in zip(prefilled, outputs, strict=True)]
    values = [float(np.mean(np.exp(r) - 1 - r)) for r in logr]
    kl.compare_kl_divergence(prefilled, outputs, {model: {"kl_div": 1.0}}, model, "pasted")
    return float(np.mean(values)), reused


@pytest.mark.full  # one more server and six relayed agent pairs, twice
def test_the_kl_kit_with_pasted_outputs_holds_relays_bound(model_dir):
    model = str(model_dir)
    with running_server(["--model-path", model, "--chunked-prefill-size", str(CHUNK)]) as server:
        relay_kl, reused = _pasted_kl(server.url, model, None)
        naive_kl, naive_reused = _pasted_kl(server.url, model, "naive")
    print(f"pasted-output KL: relay {relay_kl:.4f}, naive {naive_kl:.4f}")
    assert all(r >= 90 for r in reused), reused  # relay relayed each pasted reply
    assert all(r >= 90 for r in naive_reused), naive_reused
    assert relay_kl < PASTED_KL_BOUND, relay_kl
    assert relay_kl < naive_kl, (relay_kl, naive_kl)
