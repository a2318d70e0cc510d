"""The generated tables of README.md and docs/*.md agree with the committed data they come
from (``make docs-numbers`` rewrites them), a changed number is caught, and the cells of
three tables equal values this test recomputes from the raw JSON on its own."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from sglang_relay.bench import docs_numbers, docs_serve
from sglang_relay.bench.docs_growth import GROWTH_RUNS
from sglang_relay.bench.docs_numbers import ROOT, TABLES, block, replace_block, stale, write

DOCS = sorted({t.target for t in TABLES})


def _raw(rel: str):
    return json.loads((ROOT / rel).read_text())


def _cells(name: str, target: str) -> list[list[str]]:
    """The body rows of a generated table (header and rule dropped), cells stripped of bold."""
    text = block((ROOT / target).read_text(), name)
    assert text is not None, f"{target} has no block {name}"
    rows = [line for line in text.splitlines() if line.startswith("|")][2:]
    return [[c.strip().replace("**", "") for c in r.strip("|").split("|")] for r in rows]


def test_every_generated_block_matches_its_data():
    assert stale() == [], "run `make docs-numbers` (python -m sglang_relay.bench.docs_numbers)"


def test_the_registry_names_each_block_once_and_every_block_exists():
    keys = [(t.target, t.name) for t in TABLES]
    assert len(keys) == len(set(keys))
    for t in TABLES:
        assert block((ROOT / t.target).read_text(), t.name) is not None, (t.target, t.name)
    assert {"README.md", "docs/results.md", "docs/fidelity.md"} <= set(DOCS)


def _copy_docs(tmp_path: Path) -> None:
    for target in DOCS:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / target, tmp_path / target)


def test_a_changed_number_is_caught_and_rewritten(tmp_path):
    _copy_docs(tmp_path)
    readme = tmp_path / "README.md"
    text = readme.read_text()
    old = block(text, "results")
    assert old is not None
    match = re.search(r"\d+\.\d\dx", old)  # the first speedup of the table
    assert match is not None
    number = match.group(0)
    tampered = old.replace(number, f"{float(number[:-1]) + 0.01:.2f}x", 1)
    assert tampered != old
    readme.write_text(replace_block(text, "results", tampered))
    fidelity = tmp_path / "docs" / "fidelity.md"
    text = fidelity.read_text()
    old = block(text, "frontier-humaneval82")
    assert old is not None and "**0.0078**" in old
    fidelity.write_text(
        replace_block(text, "frontier-humaneval82", old.replace("**0.0078**", "**0.0079**", 1))
    )
    found = stale(ROOT, docs=tmp_path)
    assert [": ".join(f.split(": ")[:2]) for f in found] == [
        "README.md: results",
        "docs/fidelity.md: frontier-humaneval82",
    ]
    assert found[0].startswith("README.md: results: differs from docs/bench/frontier_humaneval82")
    prose = "\nA line of prose after the tables.\n"
    readme.write_text(readme.read_text() + prose)
    assert write(ROOT, docs=tmp_path) == [": ".join(f.split(": ")[:2]) for f in found]
    assert stale(ROOT, docs=tmp_path) == []
    assert readme.read_text() == (ROOT / "README.md").read_text() + prose


def test_a_missing_or_doubled_marker_is_reported(tmp_path):
    _copy_docs(tmp_path)
    path = tmp_path / "docs" / "results.md"
    text = path.read_text()
    path.write_text(text.replace("<!-- /numbers:ttft-probe -->", "", 1))
    assert "docs/results.md: ttft-probe: no single" in " ".join(stale(ROOT, docs=tmp_path))
    two = "<!-- numbers:x -->\na\n<!-- /numbers:x -->\n<!-- numbers:x -->\nb\n<!-- /numbers:x -->"
    assert block(two, "x") is None
    with pytest.raises(ValueError):
        replace_block(two, "x", "c")
    assert replace_block("p\n<!-- numbers:x -->\n<!-- /numbers:x -->\nq", "x", "T") == (
        "p\n<!-- numbers:x -->\nT\n<!-- /numbers:x -->\nq"
    )


def test_check_exits_zero_on_the_repository():
    assert docs_numbers.main(["--check"]) == 0


# --- cells recomputed from the raw JSON, without the generator's helpers ---


def _frontier_summary(per_relay: list[dict], field: str, stat: str) -> float:
    values = [float(r[field]) for r in per_relay]
    return statistics.median(values) if stat == "median" else statistics.fmean(values)


FRONTIER_COLUMNS = (  # column index in the table, per-relay field, statistic, format
    (3, "first_token_kl", "mean", ".4f"),
    (4, "first_token_kl", "median", ".4f"),
    (5, "top1", "mean", ".3f"),
    (6, "tf_top1", "mean", ".3f"),
    (7, "greedy_prefix", "mean", ".3f"),
    (8, "collapsed", "mean", ".3f"),
    (9, "rouge_l", "mean", ".3f"),
)


@pytest.mark.parametrize(
    "name,rel",
    [
        ("frontier-humaneval82", "docs/bench/frontier_humaneval82.json"),
        ("frontier-heldout72", "docs/bench/frontier_heldout72.json"),
    ],
)
def test_frontier_cells_equal_the_per_relay_data(name, rel):
    points = {(p["method"], p["target"]): p for p in _raw(rel)["workloads"][0]["points"]}
    rows = _cells(name, "docs/fidelity.md")
    assert len(rows) == len([k for k in points if k[1] is not None])
    for row in rows:
        p = points[(row[0], float(row[1]))]
        per = p["per_relay"]
        assert row[-1] == str(len(per))
        reuse = sum(r["reuse_rate"] * r["span_tokens"] for r in per) / sum(
            r["span_tokens"] for r in per
        )
        assert abs(float(row[2]) - reuse) <= 0.0015, (row[0], row[1], reuse)
        for col, field, stat, fmt in FRONTIER_COLUMNS:
            value = row[col].split(" [")[0]
            assert value == format(_frontier_summary(per, field, stat), fmt), (row[:2], field)


def test_fidelity_quick_cells_equal_the_per_relay_data():
    runs = {r["method"]: r for r in _raw("docs/bench/fidelity_quick.json")}
    for row in _cells("fidelity-quick", "docs/fidelity.md"):
        per = runs[row[0]]["per_relay"]
        kl = [r["first_token_kl"] for r in per]
        assert row[3] == f"{statistics.fmean(kl):.4f} / {statistics.median(kl):.4f}"
        assert row[4] == f"{statistics.fmean(r['top1'] for r in per):.3f}"
        assert row[6] == f"{statistics.fmean(r['greedy_prefix'] for r in per):.3f}"
        assert row[8] == str(len(per))


def test_probe_table_cells_equal_the_run_and_its_medians():
    rows = _raw("docs/bench/ttft_probe.json")
    by = {(r["method"], r["span_tokens"]): r for r in rows}
    table = _cells("ttft-probe", "docs/results.md")
    header = block((ROOT / "docs/results.md").read_text(), "ttft-probe").splitlines()[0]
    heads = [h.strip() for h in header.strip("|").split("|")]
    methods = {"relay 0.80 (default)": "relay", "limit (naive)": "naive",
               "EPIC (first 16)": "epic"}  # fmt: skip
    for h in heads:
        m = re.fullmatch(r"(?:relay )?(0\.\d\d)( without its probe| \(probe\))?", h)
        if m and h != "relay 0.80 (default)":
            methods[h] = f"relay@{m.group(1)}" + (":noprobe" if "without" in h else "")
    assert len(table) == 2
    for row in table:
        span = int(row[0])
        std = by[("standard", span)]
        assert row[2] == f"{std['ttft_median_s']:.3f}"
        assert row[-1] == str(std["n"])
        for h, method in methods.items():
            r = by[(method, span)]
            cell = row[heads.index(h)].split(" (")[0]
            assert cell == f"{r['speedup_vs_standard']:.2f}x"
            # the stored speedup is the ratio of the two medians
            assert abs(std["ttft_median_s"] / r["ttft_median_s"] / float(cell[:-1]) - 1) < 0.01


def test_readme_fidelity_and_ttft_cells_equal_the_raw_data():
    rows = {r[0]: r for r in _cells("results", "README.md")}
    kl = rows["first-token KL vs exact prefill at reuse 0.80 (mean)"]
    mine, best = [], []
    for rel in ("docs/bench/frontier_humaneval82.json", "docs/bench/frontier_heldout72.json"):
        at = {p["method"]: p for p in _raw(rel)["workloads"][0]["points"] if p["target"] == 0.8}
        mine.append(statistics.fmean(r["first_token_kl"] for r in at["relay"]["per_relay"]))
        best.append(
            min(
                statistics.fmean(r["first_token_kl"] for r in at[m]["per_relay"])
                for m in ("epic", "cacheblend")
            )
        )
    assert kl[1] == " / ".join(f"{v:.4f}" for v in mine)
    assert kl[2] == "best baseline " + " / ".join(f"{v:.4f}" for v in best)

    ttft = next(r for k, r in rows.items() if k.startswith("TTFT with 1,024 relayed tokens"))
    caption = block((ROOT / "README.md").read_text(), "results").splitlines()[-1]
    source = re.search(r"`(docs/bench/ttft_[a-z_0-9]+\.json)`", caption).group(1)
    run = {(r["method"], r["span_tokens"]): r for r in _raw(source)}
    # the run measured the probed points beside their probe-less twins: the probe was on
    assert ("relay@0.90:noprobe", 1024) in run and ("relay@0.95:noprobe", 1024) in run
    want = [run[(m, 1024)]["speedup_vs_standard"] for m in ("relay", "relay@0.90", "relay@0.95")]
    assert re.findall(r"(\d+\.\d\d)x", ttft[1]) == [f"{v:.2f}" for v in want]
    assert f"standard prefill {run[('standard', 1024)]['ttft_median_s']:.2f} s" in ttft[2]
    assert f"{run[('naive', 1024)]['speedup_vs_standard']:.2f}x" in ttft[2]
    lo, hi = (float(x) for x in re.search(r"give (\d\.\d\d)-(\d\.\d\d)x", ttft[3]).groups())
    assert lo <= want[0] <= hi


def test_readme_capacity_cells_name_a_ratio_neither_method_has():
    """Where neither relay nor standard meets the lowest rate at an SLO, the cell says so in
    words (it once printed ``nanx``); every other ratio is a number or inf. One row per
    workload of the capacity runs."""
    rows = [r for r in _cells("results", "README.md") if r[0].startswith("agent chains")]
    workloads = {r.get("workload") for f in docs_serve.CAPACITY_RUNS for r in _raw(f)["rows"]}
    assert len(rows) == len(workloads)
    for row in rows:
        assert "nan" not in " ".join(row)
        standard = row[2].split(" · ")[0].removeprefix("standard: ").split("; ")
        cells = row[1].removeprefix("goodput, chains/min achieved, at p90 TTFT <= ").split("; ")
        for k, part in enumerate(cells):
            if "none either" in part:
                assert part.split(": ")[1].startswith("0.0 ") and standard[k].startswith("0.0 ")
            else:
                assert re.search(
                    r"\(standard: none, even|\(both at the highest|x standard's \[", part
                )


def test_growth_cells_are_each_points_ttft_over_its_compute_proportional_ideal():
    """Recomputed from the raw run: ideal = naive + (1 - reuse)(standard - naive)."""
    rows = _raw(GROWTH_RUNS[0])
    med = {(r["method"], r["span_tokens"]): r for r in rows}
    cells = {row[0].replace(",", ""): row for row in _cells("growth-ttft", "docs/results.md")}
    for span in (256, 1024, 4096, 8192):
        std, naive = med[("standard", span)]["ttft_median_s"], med[("naive", span)]["ttft_median_s"]
        for col, point in ((5, "relay@0.80"), (6, "relay@0.90"), (7, "relay@0.95")):
            r = med[(point, span)]
            ideal = naive + (1 - r["reuse_rate"]) * (std - naive)
            ttft, ratio = cells[str(span)][col].rstrip(")").split(" (")
            assert ttft == f"{r['ttft_median_s']:.2f}", (span, point)
            # the run's medians are stored to 4 digits: the ratio from them agrees to 0.01
            assert abs(float(ratio) - r["ttft_median_s"] / ideal) <= 0.006, (span, point, ratio)


def test_growth_shares_cells_equal_the_raw_medians():
    raw = [r for rel in GROWTH_RUNS for r in _raw(rel)]
    by = {(r["method"], r["span_tokens"]): r for r in raw}
    rows = _cells("growth-shares", "docs/results.md")
    assert [int(r[0].replace(",", "")) for r in rows] == [256, 1024, 4096, 8192, 16384]
    for row in rows:
        span = int(row[0].replace(",", ""))
        cb = by[("cacheblend", span)]["ttft_median_s"]
        ratios = [by[(f"relay@{p}", span)]["ttft_median_s"] / cb for p in ("0.80", "0.90", "0.95")]
        assert [float(x) for x in row[2].split(" / ")] == [round(x, 2) for x in ratios]
        naive, std = by[("naive", span)], by[("standard", span)]
        loop = naive["phases_ms"]["layers"]
        rows_run = naive["prompt_tokens"] - naive["reused_tokens"]
        assert row[6] == f"{loop:.0f}, {rows_run:,.0f}, {loop / std['ttft_median_s'] / 10:.0f} %"
        assert row[7] == f"{by[('stock_prefix_hit', span)]['ttft_median_s']:.2f}"


def test_a_workload_in_two_capacity_files_is_refused_not_picked(monkeypatch):
    from sglang_relay.bench import docs_readme

    rel = docs_serve.TOOLLOOP_RUN
    monkeypatch.setattr(docs_readme, "CAPACITY_RUNS", (rel, rel))
    with pytest.raises(ValueError, match="is in two capacity runs"):
        docs_readme._capacity_rows(ROOT)
