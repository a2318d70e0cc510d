"""The committed data behind the docs' tables, read for ``make docs-numbers``
(:mod:`sglang_relay.bench.docs_numbers`): JSON files by repository path, the TTFT runs with
what each ran, and the few formatting rules every generated table shares.

Which configuration a TTFT run measured: ``bench ttft`` writes per row only the method label
(``relay`` = the server's default point, ``relay@T`` = the point for reuse ``T``,
``relay@T:noprobe`` = that point without its last-row probe). The profile the server loaded
is the one committed with the data: a run counts as the shipped configuration of point ``T``
when the profile at the commit that last wrote its file (``git log``) holds the same config
for ``T`` as the profile in the tree, and its rows' reuse is ``T``. A data file not yet
committed counts as the newest run, made with the profile in the tree. Write a re-run to a
new file: an overwritten file keeps its first commit's profile in git's history too."""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE = "python/sglang_relay/data/profile_SmolLM2-135M-Instruct.json"
# Every committed file of `bench ttft` rows: one run per file, or {"runs": {name: rows}}.
TTFT_GLOBS = (
    "docs/ttft_quick.json",
    "docs/bench/ttft_*.json",
    "research/studies/data/**/ttft*.json",
)
# Runs of another model than the embedded fp32 one (the bench's JSON did not name the model).
OTHER_MODELS = {
    "docs/bench/ttft_quick_bnb8.json": "the bitsandbytes 8-bit checkpoint",
    "docs/bench/ttft_tp2.json": "a random 8-head Llama at tp 2",
}
EMBEDDED = "SmolLM2-135M-Instruct"
NEWEST = 2**62  # commit time given to a data file git does not know yet


def load(root: Path, rel: str) -> Any:
    return json.loads((root / rel).read_text())


def _git(root: Path, *args: str) -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError as e:  # pragma: no cover - git is part of the checkout
        raise RuntimeError("docs-numbers reads commit history: git is not installed") from e
    if proc.returncode != 0 and "not a git repository" in proc.stderr:
        raise RuntimeError(f"docs-numbers reads commit history: {root} is not a git checkout")
    return proc.stdout if proc.returncode == 0 else ""


@functools.cache
def last_commit(root: Path, rel: str) -> tuple[int, str | None]:
    """(commit time, commit) of the last commit that wrote ``rel``; a file git does not know
    yet is the newest (:data:`NEWEST`, None)."""
    out = _git(root, "log", "-1", "--format=%ct %H", "--", rel).split()
    return (int(out[0]), out[1]) if out else (NEWEST, None)


def _point_configs(profile: dict[str, Any]) -> dict[float, dict[str, Any]]:
    return {round(float(p["target"]), 2): p["config"] for p in profile.get("frontier", [])}


@functools.cache
def profile_points(root: Path, commit: str | None) -> dict[float, dict[str, Any]]:
    """Each operating point's relay config in the shipped profile at ``commit`` (None: the
    profile in the tree)."""
    if commit is None:
        return _point_configs(load(root, PROFILE))
    text = _git(root, "show", f"{commit}:{PROFILE}")
    return _point_configs(json.loads(text)) if text else {}


def default_point(root: Path) -> float:
    return round(float(load(root, PROFILE)["min_reuse"]), 2)


def label_point(label: str, default: float) -> float | None:
    """The operating point a ``bench ttft`` relay label ran (None: not a profile's point)."""
    if label == "relay":
        return default
    if label.startswith("relay@") and ":" not in label:
        try:
            return round(float(label[len("relay@") :]), 2)
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class TtftRun:
    """One ``bench ttft`` run: its rows and the operating points it ran as shipped now."""

    source: str  # repository path, with ``#name`` for one run of a file of several
    committed: int
    rows: tuple[dict[str, Any], ...]
    shipped: frozenset[float]

    def row(self, label: str, span: int, agents: int = 2) -> dict[str, Any] | None:
        for r in self.rows:
            if (r["method"], r["span_tokens"], r["n_agents"]) == (label, span, agents):
                return r
        return None

    @property
    def file(self) -> str:
        return self.source.partition("#")[0]


def _runs_in(data: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    if isinstance(data, list):
        return [("", data)]
    if isinstance(data, dict) and isinstance(data.get("runs"), dict):
        return [(f"#{k}", v) for k, v in data["runs"].items() if isinstance(v, list)]
    return []


@functools.cache
def ttft_runs(root: Path) -> tuple[TtftRun, ...]:
    """Every committed TTFT run of the embedded model, newest first (by commit time)."""
    if _git(root, "rev-parse", "--is-shallow-repository").strip() == "true":
        raise RuntimeError("docs-numbers reads the commit of each run: `git fetch --unshallow`")
    now, default = profile_points(root, None), default_point(root)
    files = sorted({p.relative_to(root).as_posix() for g in TTFT_GLOBS for p in root.glob(g)})
    out = []
    for rel in files:
        if rel in OTHER_MODELS:
            continue
        when, commit = last_commit(root, rel)
        then = profile_points(root, commit)
        for name, rows in _runs_in(load(root, rel)):
            models = {r.get("run", {}).get("model", EMBEDDED) for r in rows}
            if models != {EMBEDDED}:  # a run whose metadata names another model
                continue
            shipped = set()
            for r in rows:
                point = label_point(r["method"], default)
                if (
                    point is not None
                    and point in now
                    and then.get(point) == now[point]
                    and abs(r["reuse_rate"] - point) <= 0.01
                ):
                    shipped.add(point)
            out.append(TtftRun(rel + name, when, tuple(rows), frozenset(shipped)))
    return tuple(sorted(out, key=lambda r: (-r.committed, r.source)))


def newest_shipped(
    root: Path, points: Iterable[float], spans: Iterable[int] = (1024,)
) -> TtftRun | None:
    """The newest run that measured every one of ``points`` as shipped, at every span."""
    points, spans = tuple(points), tuple(spans)
    default = default_point(root)
    for run in ttft_runs(root):
        labels = {p: "relay" if p == default else f"relay@{p:.2f}" for p in points}
        if set(points) <= run.shipped and all(
            run.row(labels[p], s) is not None for p in points for s in spans
        ):
            return run
    return None


def point_label(point: float, default: float) -> str:
    return "relay" if point == default else f"relay@{point:.2f}"


# --- formatting shared by the tables ---


def fx(v: float, digits: int = 2) -> str:
    """A speedup or ratio: ``3.44x``."""
    return f"{v:.{digits}f}x"


def spread(values: Iterable[float], fmt: str = ".2f", unit: str = "") -> str:
    """``lo-hi`` of the formatted values, or one value when they round alike."""
    vals = sorted(values)
    lo, hi = format(vals[0], fmt), format(vals[-1], fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def reps(rows: Iterable[dict[str, Any] | None]) -> str:
    """The repetitions behind a row of TTFT medians (``n`` of its cells)."""
    ns = sorted({int(r["n"]) for r in rows if r is not None})
    return "-" if not ns else str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
