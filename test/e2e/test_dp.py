"""Data parallel inside one server: ``--dp-size 2`` (one scheduler per rank, one core each)
routes every downstream agent to the rank that holds its upstream's span, with no client
change: eight concurrent three-agent chains and two sequential ones (where round robin
alone sends every second agent to the other rank), every downstream agent relays its
upstreams whole, both ranks serve chains, and neither rank leaks a KV slot. Measured
without routing (``SGLANG_RELAY_DP_ROUTING=0``): 4/8 second and 2/8 third agents relayed
whole concurrently, 0/4 sequentially, with 47-token spans (docs/results.md)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests
from relay_helpers import generate_ids, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.model]

CHAINS = 8
OUT = 40  # upstream outputs: 39-token spans (>= min_span 32)


def _chain(url: str, i: int) -> tuple[dict, dict, int, int]:
    a1 = generate_ids(url, [1000 + 41 * i + k for k in range(40)], OUT)["output_ids"][:-1]
    head, mid, tail = [5000 + i, *range(5001, 5017)], list(range(6000, 6006)), [7000, 7001]
    a2 = generate_ids(url, head + a1 + tail, OUT)
    out2 = a2["output_ids"][:-1]
    a3 = generate_ids(url, head + a1 + mid + out2 + tail, 2)
    return a2["meta_info"]["relay"], a3["meta_info"]["relay"], len(a1), len(out2)


def _ranks(url: str) -> list[dict]:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return [state["relay"] for state in info["internal_states"]]


def test_dp2_routes_each_downstream_agent_to_its_upstream_rank(model_dir):
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    args = ["--model-path", str(model_dir), "--dp-size", "2", "--max-total-tokens", "8192"]
    with running_server(args, env=env) as server:
        with cf.ThreadPoolExecutor(CHAINS) as pool:
            results = list(pool.map(lambda i: _chain(server.url, i), range(CHAINS)))
        # sequential chains: round robin alone sends every second agent to the other rank
        results += [_chain(server.url, CHAINS + i) for i in range(2)]
        for second, third, n1, n2 in results:
            assert second["fallback"] is None and second["reused_tokens"] == n1, second
            assert third["fallback"] is None and third["reused_tokens"] == n1 + n2, third
        ranks = _ranks(server.url)
        assert sorted(r["dp_rank"] for r in ranks) == [0, 1]
        assert all(r["relay_extends"] > 0 for r in ranks)  # both ranks served chains
        assert all(r["dp_fingerprints_sent"] > 0 for r in ranks)
        assert all(r["dp_fingerprints_dropped"] == 0 for r in ranks)
        # the controller's decisions, counted by the ranks: every downstream agent matched,
        # every first agent (nothing stored yet for it) went through SGLang's method
        chains = len(results)
        assert sum(r.get("dp_routed_matched", 0) for r in ranks) == 2 * chains
        assert sum(r.get("dp_routed_fallback", 0) for r in ranks) >= chains
        for r in ranks:  # no leaked slots: SGLang's conservation law when idle, per rank
            pool_ = r["pool"]
            assert pool_["available"] + pool_["evictable"] + pool_["protected"] == pool_["total"]
