"""The benchmark driver end to end on a tiny workload (every kind, two methods): it must
produce results.json, report.md and the plots, with the figures users read."""

from __future__ import annotations

import json

import numpy as np
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


@pytest.mark.full  # ~80 s: `bench run` end to end in the full tier, to keep CI under 25 minutes
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


@pytest.mark.full  # ~2 min; the arithmetic of censoring and goodput: test_capacity.py
def test_bench_serve_censors_what_a_run_did_not_finish(server, tmp_path, capsys):
    """Deep chains that finish; a file resumed only with the same settings; tool loops whose
    run ends during their tool's pause (later turns not arrivals); deep chains cut by the
    run's end (in-flight requests aborted on the server and censored); the server serves
    on."""
    from sglang_relay.bench import serve

    out, tools, cut = (tmp_path / f"{n}.json" for n in ("deep", "tools", "cut"))
    common = ["--url", server.url, "--chains", "2", "--rates", "120", "--methods",
              "standard,relay", "--out-tokens", "40", "--answer-tokens", "4", "--slos", "2,600",
              "--resume"]  # fmt: skip
    assert serve.main([*common, "--workloads", "deep", "--drain", "300", "--json", str(out)]) == 0
    with pytest.raises(SystemExit):  # other settings: not the same runs, refused
        serve.main([*common, "--workloads", "deep", "--drain", "30", "--json", str(out)])
    assert serve.main([*common, "--workloads", "toolloop", "--drain", "40", "--tool-pause",
                       "90,90", "--json", str(tools)]) == 0  # fmt: skip
    assert serve.main([*common, "--workloads", "deep", "--drain", "0", "--json", str(cut)]) == 0
    rows = [r for f in (out, tools, cut) for r in json.loads(f.read_text())["rows"]]
    assert [(r["workload"], r["method"]) for r in rows] == [
        (w, m) for w in ("deep", "toolloop", "deep") for m in ("standard", "relay")
    ]
    for r in rows:
        assert r["arrived"] == 2 and r["errors"] == 0 and r["wall_s"] > 0, r
    full, tool, short = rows[:2], rows[2:4], rows[4:]
    for r in full:  # every agent answered; relay reused the quoted outputs
        assert r["censored"] == 0 and [len(c) for c in r["chain_ttfts_all"]] == [5, 5]
        assert r["ttft_all_p90"] == pytest.approx(np.percentile(  # the file rounds to 0.1 ms
            [t for c in r["chain_ttfts_all"] for t in c], 90), abs=1e-3)  # fmt: skip
    assert full[1]["relayed_prompt_share"] > 0.1
    for r in tool:  # the first turn answered; the run ended in the tool's pause
        assert r["completed"] == 0 and r["censored"] == 0 and r["pending_tool"] == 4
        assert [len(c) for c in r["chain_ttfts_all"]] == [1, 1] and r["requests"] == 2
    for r in short:  # the run ended at the last arrival: what had not answered is censored
        assert r["completed"] == 0 and r["censored"] >= 8 and r["ttft_all_p90"] is None
        assert all(c[-1] is None for c in r["chain_ttfts_all"])
    report = capsys.readouterr().out
    assert "| toolloop | relay | 120 /" in report and "miss" in report
    gen = serve.generate(server.url, "Hello", {"max_new_tokens": 4})  # the aborts left it well
    assert gen.meta["completion_tokens"] >= 1
