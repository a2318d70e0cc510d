"""The benchmark driver end to end on a tiny workload (every kind, two methods): it must
produce results.json, report.md and the plots, with the figures users read."""

from __future__ import annotations

import json

import pytest

from sglang_relay.bench import run

pytestmark = pytest.mark.e2e

AGENTS = [
    {"name": "Architect", "max_new_tokens": 40, "system": "You are an architect.",
     "template": "Plan `{entry_point}`:\n{task}"},
    {"name": "Developer", "max_new_tokens": 48, "system": "You are a developer.",
     "template": "Plan:\n{Architect}\n\nWrite `{entry_point}`:\n```python\n{task}\n```"},
]  # fmt: skip
TINY = [
    {"kind": "sweep", "span_tokens": [64], "template": "{outputs}\n\nSummarize."},
    {"kind": "agents", "n_agents": [3], "output_tokens": 48},
    {"kind": "humaneval", "limit": 1, "agents": AGENTS},
    {"kind": "frontend", "tasks": ["Write `add(a, b)`."], "max_new_tokens": 48},
]


def test_bench_run_writes_results_report_and_plots(server, tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("\n".join(json.dumps(c) for c in TINY))
    out = tmp_path / "out"
    argv = ["--url", server.url, "--workload", str(workload), "--reps", "1",
            "--methods", "standard,relay", "--out", str(out)]  # fmt: skip
    assert run.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert {r["case"] for r in result["ttft"]} == {"sweep", "agents"}
    assert {r["method"] for r in result["ttft"]} == {"standard", "relay", "stock_prefix_hit"}
    relay_sweep = next(r for r in result["ttft"] if r["method"] == "relay" and r["case"] == "sweep")
    assert relay_sweep["reuse_rate"] > 0.5 and relay_sweep["speedup_vs_standard"] > 0
    dev = {r["method"]: r for r in result["chains"] if r["agent"] == "Developer"}
    assert set(dev) == {"standard", "relay"}
    assert dev["relay"]["reuse_rate"] > 0.5 and "pass_at_1" in dev["relay"]
    assert 0.0 <= dev["relay"]["agree_first64"] <= 1.0 and 0.0 <= dev["relay"]["rouge_l"] <= 1.0
    relay_dev = [
        r for r in result["records"] if r["agent"] == "Developer" and r["method"] == "relay"
    ]
    assert relay_dev[0]["reused_tokens"] >= 20 and relay_dev[0]["fallback"] is None
    fronts = [r for r in result["chains"] if r["kind"] == "frontend" and r["method"] == "relay"]
    assert fronts and all(r["reuse_rate"] > 0 for r in fronts if r["agent"].startswith("review"))
    report = (out / "report.md").read_text()
    for png in ("ttft_vs_span.png", "ttft_vs_agents.png", "fidelity_vs_reuse.png"):
        assert (out / png).stat().st_size > 1000 and png in report


@pytest.mark.full  # 90 s; the arithmetic of censoring and goodput: test_capacity.py
def test_bench_serve_censors_what_a_run_did_not_finish(server, tmp_path, capsys):
    """Two workloads in one file (the second appended by ``--resume``): deep chains that
    finish, and tool loops whose 30 s tool outlives the run, so their later turns are never
    sent: censored, a miss of any SLO, and the server serves on."""
    from sglang_relay.bench import serve

    out = tmp_path / "capacity.json"
    common = ["--url", server.url, "--chains", "2", "--rates", "120", "--methods",
              "standard,relay", "--out-tokens", "40", "--answer-tokens", "4", "--slos", "2,600",
              "--json", str(out), "--resume"]  # fmt: skip
    assert serve.main([*common, "--workloads", "deep", "--drain", "300"]) == 0
    assert serve.main([*common, "--workloads", "deep,toolloop", "--drain", "3",
                       "--tool-pause", "30,30"]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["workload"], r["method"]) for r in rows) == [
        ("deep", "relay"),
        ("deep", "standard"),
        ("toolloop", "relay"),
        ("toolloop", "standard"),
    ]
    for r in rows:
        assert r["arrived"] == 2 and r["errors"] == 0 and r["wall_s"] > 0, r
        if r["workload"] == "deep":  # every agent answered; relay reused the quoted outputs
            assert r["censored"] == 0 and [len(c) for c in r["chain_ttfts_all"]] == [5, 5]
            assert r["ttft_all_p90"] == pytest.approx(r["ttft_p90"])
        else:  # the first turn answered, the two after the tool never sent
            assert r["completed"] == 0 and r["censored"] == 4 and r["requests"] == 2
            assert [c[1:] for c in r["chain_ttfts_all"]] == [[None, None]] * 2
            assert r["ttft_all_p90"] is None and r["ttft_p90"] is not None
    relay_deep = next(r for r in rows if r["workload"] == "deep" and r["method"] == "relay")
    assert relay_deep["relayed_prompt_share"] > 0.1
    report = capsys.readouterr().out
    assert "| toolloop | relay | 120 /" in report and "miss" in report
    gen = serve.generate(server.url, "Hello", {"max_new_tokens": 4})  # serves on
    assert gen.meta["completion_tokens"] >= 1
