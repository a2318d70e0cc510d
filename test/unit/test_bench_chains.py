"""Helpers of the chain benchmark: similarity metrics, code extraction and execution, workloads."""

from __future__ import annotations

import json

import pytest

from sglang_relay.bench import chains, evaluation
from sglang_relay.bench.run import load_workload, summarize_chains
from sglang_relay.errors import RelayError


def test_rouge_l_and_divergence_on_known_sequences():
    assert evaluation.rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert evaluation.rouge_l([], []) == 1.0
    assert evaluation.rouge_l([1, 2], [3, 4]) == 0.0
    # LCS of (1 2 3 4 5) and (1 3 5 7) is (1 3 5): p = 3/5, r = 3/4
    assert evaluation.rouge_l([1, 2, 3, 4, 5], [1, 3, 5, 7]) == pytest.approx(2 / (5 / 3 + 4 / 3))
    assert evaluation.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert evaluation.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert evaluation.first_divergence([1, 2], [1, 2, 3]) == 2


def _tail_loop_brute(ids, min_repeats=3, max_period=32):
    """Longest suffix that is a block repeated >= min_repeats times (possibly plus a partial
    block in front), by trying every suffix and every period."""
    best = 0
    for period in range(1, max_period + 1):
        for start in range(len(ids)):
            tail = ids[start:]
            if len(tail) >= min_repeats * period and all(
                tail[j] == tail[j + period] for j in range(len(tail) - period)
            ):
                best = max(best, len(tail))
                break
    return best


def test_tail_loop_equals_a_brute_force_search():
    import random

    rng = random.Random(0)
    cases = [[1, 2, 3], [7] * 10, [1, 2] + [5, 6, 7] * 4, [1, 2, 3, 1, 2, 3, 1, 2], []]
    for _ in range(300):
        head = [rng.randrange(5) for _ in range(rng.randrange(8))]
        block = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        cases.append(head + block * rng.randrange(1, 6) + block[: rng.randrange(len(block))])
    for ids in cases:
        assert evaluation.tail_loop(ids) == _tail_loop_brute(ids), ids
    assert evaluation.tail_loop([7] * 10) == 10
    assert evaluation.tail_loop([1, 2] + [5, 6, 7] * 4) == 12


def test_collapse_is_a_short_or_looping_output_where_standard_is_neither():
    ref = list(range(100))
    assert evaluation.collapsed(ref[:10], ref)  # stopped early (the demo's Reviewer: 1 token)
    assert not evaluation.collapsed(ref[:60], ref)
    looping = list(range(40)) + [3, 4] * 30
    assert evaluation.collapsed(looping, ref)
    assert not evaluation.collapsed(looping, looping)  # standard loops the same way
    assert not evaluation.collapsed(list(range(200, 300)), ref)  # different, not degenerate


def test_method_order_rotates_relay_methods_and_keeps_standard_last():
    methods = ["standard", "naive", "relay"]
    assert chains.method_order(methods, 0) == ["naive", "relay", "standard"]
    assert chains.method_order(methods, 1) == ["relay", "naive", "standard"]


def test_extract_code_prefers_the_block_defining_the_entry_point():
    text = "Sure:\n```\nprint(1)\n```\nThen:\n```python\ndef f(x):\n    return x\n```\nDone."
    assert chains.extract_code(text, "f") == "def f(x):\n    return x\n"
    assert chains.extract_code(text, "g") == "print(1)\n"
    assert chains.extract_code("def f(): pass", "f") == "def f(): pass"
    # an unterminated block (generation cut by max_new_tokens) still counts
    assert chains.extract_code("```python\ndef f(x):\n    return x", "f").startswith("def f")


@pytest.fixture(scope="module")
def problem():
    return chains.humaneval_problems(1)[0]


def test_canonical_solution_passes_and_wrong_code_fails(problem):
    assert chains.passes_tests(problem, problem["canonical_solution"])
    name = problem["entry_point"]
    assert not chains.passes_tests(problem, f"def {name}(*a, **k):\n    return None\n")
    assert not chains.passes_tests(problem, "this is not python")


def test_checker_blocks_network_exit_and_runaway_code(problem):
    import socket

    with socket.socket() as listener:  # a port that accepts: only the block can refuse it
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        reach = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        canonical = problem["canonical_solution"]
        assert chains.passes_tests(problem, canonical)
        assert not chains.passes_tests(problem, canonical + "\n" + reach)
        # the same program passes once the connection is allowed: the block made it fail
        sneaky = "import socket as _s\n_s.socket = _s.socket.__mro__[1]\n" + reach
        assert chains.passes_tests(problem, canonical + "\n" + sneaky)
    # leaving early with status 0 is not a pass
    assert not chains.passes_tests(problem, "import sys\nsys.exit(0)\n")
    assert not chains.passes_tests(problem, "while True:\n    pass\n", timeout=2.0)


def test_packaged_workload_has_every_kind_and_quick_sizes():
    full = load_workload(None, quick=False)
    quick = load_workload(None, quick=True)
    assert {c["kind"] for c in full} == {"sweep", "agents", "humaneval", "frontend"}
    he_full = next(c for c in full if c["kind"] == "humaneval")
    he_quick = next(c for c in quick if c["kind"] == "humaneval")
    assert he_full.get("limit") is None and he_quick["limit"] > 0


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        (json.dumps({"kind": "poem"}), "kind must be one of"),
        (json.dumps({"kind": "sweep"}), "needs span_tokens"),
        (json.dumps({"kind": "humaneval"}), "needs agents"),
    ],
)
def test_bad_workloads_are_refused_with_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"kind": "frontend", "tasks": ["t"]}) + "\n" + line + "\n")
    with pytest.raises(RelayError, match=f"w.jsonl:2: .*{message}"):
        load_workload(str(path), quick=False)


def test_summary_speedup_and_pass_rate():
    def rec(method, ttft, passed, same):
        return {
            "kind": "humaneval",
            "agent": "Developer",
            "method": method,
            "ttft_s": ttft,
            "prompt_tokens": 300,
            "reuse_rate": 0.8 if method != "standard" else 0.0,
            "fallback": None,
            "passed": passed,
            "same_output": same,
            "agree_first64": 1.0 if same else 0.5,
            "rouge_l": 1.0 if same else 0.5,
        }

    rows = summarize_chains(
        [rec("standard", 1.0, True, True), rec("standard", 3.0, False, True)]
        + [rec("relay", 0.5, True, True), rec("relay", 0.5, True, False)]
    )
    relay = next(r for r in rows if r["method"] == "relay")
    assert relay["speedup_vs_standard"] == 4.0  # median 2.0 / median 0.5
    assert relay["pass_at_1"] == 1.0
    assert relay["same_output"] == 0.5
