"""benchmark/merge_frontier.py: a re-measured method replaces exactly its own rows, and two
runs that scored different relays or different measures are refused, not mixed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmark" / "merge_frontier.py"
_SPEC = importlib.util.spec_from_file_location("merge_frontier", _PATH)
mf = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mf)


def _point(method, target, kl, ids=("a", "b"), extra=()):
    row = {"method": method, "target": target, "first_token_kl": kl}
    row.update(dict.fromkeys(extra, 0.0))
    row["per_relay"] = [{"id": i, "first_token_kl": kl} for i in ids]
    return row


def _run(points, workload="w.jsonl"):
    return {"workload": workload, "points": points}


def test_the_new_rows_replace_only_their_method_and_target():
    base = _run([_point("epic", 0.8, 0.02), _point("relay", 0.8, 0.01), _point("relay", 0.9, 0.03)])
    new = _run([_point("relay", 0.9, 0.025), _point("relay", 0.95, 0.04)])
    merged, replaced = mf.merge(base, new)
    got = {(p["method"], p["target"]): p["first_token_kl"] for p in merged["points"]}
    assert got == {
        ("epic", 0.8): 0.02,
        ("relay", 0.8): 0.01,
        ("relay", 0.9): 0.025,
        ("relay", 0.95): 0.04,  # a target the base run lacked is added
    }
    assert [(t, b["first_token_kl"], a["first_token_kl"]) for t, b, a in replaced] == [
        (0.9, 0.03, 0.025)
    ]


def test_runs_over_other_relays_or_other_measures_are_refused():
    base = _run([_point("relay", 0.8, 0.01)])
    with pytest.raises(SystemExit, match="same relays"):
        mf.merge(base, _run([_point("relay", 0.8, 0.01, ids=("a", "c"))]))
    with pytest.raises(SystemExit, match="collapse_rate"):
        mf.merge(base, _run([_point("relay", 0.8, 0.01, extra=("collapse_rate",))]))
    with pytest.raises(SystemExit, match="workloads differ"):
        mf.merge(base, _run([_point("relay", 0.8, 0.01)], workload="other.jsonl"))
