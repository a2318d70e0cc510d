"""SGLang's own server test kits (``sglang/test/kits``, shipped inside the package) as a
conformance suite: each kit runs against a relay server and a ``--no-relay`` server of the
same settings on the embedded model, and every one of its tests must end the same way on
both (passed, failed, errored or skipped; a kit written for a larger model may fail some
tests on SmolLM2-135M, and must then fail them without relay too: here the decode kit's
math and colour prompts, one matched-stop string, the stress kit's concurrent and long
prompts, the branching kit and the abort kit end that way on both). ``make test`` runs the
API contract and decode-correctness kits; the full tier adds the matched-stop, scheduler
stress, prefix-branching and abort kits. Not yet: the kits with an upstream output pasted
mid-prompt (so that relay relays) against relay's fidelity bounds."""

from __future__ import annotations

import importlib
import unittest

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


def test_sglangs_server_kits_end_the_same_with_and_without_relay(model_dir, request):
    kits = _kits(request)
    args = ["--model-path", str(model_dir), "--chunked-prefill-size", str(CHUNK)]
    outcomes = {}
    for name, extra in (("relay", []), ("plain", ["--no-relay"])):
        with running_server([*args, *extra]) as server:
            outcomes[name] = {kit: run_kit(kit, server.url, str(model_dir)) for kit in kits}
    for kit in kits:
        relay, plain = outcomes["relay"][kit], outcomes["plain"][kit]
        assert relay == plain, (kit, relay, plain)
        assert relay and set(relay.values()) <= {"passed", "failed", "errored", "skipped"}
    # the API contract holds on this model with or without relay
    assert set(outcomes["relay"][CI_KITS[0]].values()) == {"passed"}, outcomes["relay"]
