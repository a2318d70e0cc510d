"""``make docs-numbers``: the tables of measured numbers in README.md and docs/*.md, rewritten
from the committed data files they come from.

In a Markdown file a generated table sits between two markers::

    <!-- numbers:NAME -->
    | ... the table, written by this module ... |
    <!-- /numbers:NAME -->

:data:`TABLES` registers each block: the file it lives in, its name, the data files it reads
and the function that turns them into the block's text. ``--check`` (the default) exits 1
and names every block whose text is not what its data give (a test runs the same check);
``--write`` rewrites the blocks in place. Text outside the markers is never touched: a
number in prose is the writer's to keep true.

    python -m sglang_relay.bench.docs_numbers [--check | --write] [--root DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sglang_relay.bench import docs_fidelity, docs_growth, docs_readme, docs_serve, docs_ttft

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Table:
    """One generated block: ``build(root)`` gives its text from the data in ``sources``."""

    target: str  # Markdown file, relative to the repository root
    name: str
    sources: tuple[str, ...]
    build: Callable[[Path], str]


TTFT_RUNS = ("docs/bench/ttft_*.json", "research/studies/data/**/ttft*.json")
FRONTIERS = docs_readme.FRONTIERS
HELDOUT = dict(zip(("humaneval82", "heldout72"), FRONTIERS, strict=True))
R, F = "docs/results.md", "docs/fidelity.md"
TABLES: tuple[Table, ...] = (
    Table(
        "README.md",
        "results",
        (
            *FRONTIERS,
            *TTFT_RUNS,
            docs_readme.FANOUT,
            *docs_serve.CAPACITY_RUNS,
            docs_readme.DECODE,
            docs_readme.CHAOS,
        ),
        docs_readme.results_table,
    ),
    Table(R, "ttft-quick", ("docs/ttft_quick.json",), docs_ttft.quick_table),
    Table(R, "ttft-points", docs_ttft.POINTS_RUNS, docs_ttft.points_table),
    Table(R, "ttft-probe", ("docs/bench/ttft_probe.json",), docs_ttft.probe_table),
    Table(R, "ttft-low-points", ("docs/bench/ttft_low_points.json",), docs_ttft.low_points_table),
    Table(R, "ttft-target", TTFT_RUNS, docs_ttft.target_line),
    Table(R, "decode-pairs", (docs_readme.DECODE,), docs_serve.decode_table),
    Table(R, "growth-ttft", docs_growth.GROWTH_RUNS, docs_growth.ttft_table),
    Table(R, "growth-phases", docs_growth.GROWTH_RUNS, docs_growth.phases_table),
    Table(R, "growth-shares", docs_growth.GROWTH_RUNS, docs_growth.shares_table),
    Table(R, "short-span-profile", (docs_growth.SHORT_SPAN,), docs_growth.profile_table),
    Table(
        R,
        "cpu-attention-timing",
        (docs_growth.ATTENTION_TIMING,),
        docs_growth.attention_timing_table,
    ),
    Table(R, "cpu-attention-ab", (docs_growth.AB_BLOCKS,), docs_growth.ab_table),
    Table(R, "decode-batch", docs_growth.DECODE_RUNS, docs_growth.decode_batch_table),
    *(
        Table(R, name, (rel,), partial(docs_serve.serve_table, name=name))
        for name, (rel, _) in docs_serve.SERVE_TABLES.items()
    ),
    Table(R, "serve-fanout-goodput", (docs_serve.FANOUT_RUN,), docs_serve.fanout_goodput),
    Table(R, "capacity", (docs_serve.CAPACITY_RUN,), docs_serve.capacity_tables),
    Table(
        R,
        "capacity-toolloop",
        (docs_serve.TOOLLOOP_RUN,),
        partial(docs_serve.capacity_tables, rel=docs_serve.TOOLLOOP_RUN),
    ),
    Table(R, "capacity-retention", (docs_serve.TOOLLOOP_RUN,), docs_serve.retention_table),
    Table(
        R,
        "capacity-retention-tight",
        (docs_serve.RETENTION_TIGHT,),
        partial(docs_serve.retention_table, rel=docs_serve.RETENTION_TIGHT),
    ),
    Table(R, "serve-fanout-seeds", (docs_readme.FANOUT,), docs_serve.fanout_seeds_table),
    Table(R, "serve-fanout-seeds-goodput", (docs_readme.FANOUT,), docs_serve.fanout_seeds_goodput),
    Table(F, "fidelity-quick", ("docs/bench/fidelity_quick.json",), docs_fidelity.quick_table),
    *(
        Table(F, f"frontier-{key}", (rel,), partial(docs_fidelity.frontier_table, rel=rel))
        for key, rel in HELDOUT.items()
    ),
    *(
        Table(F, f"verdicts-{key}", (rel,), partial(docs_fidelity.verdict_table, rel=rel))
        for key, rel in HELDOUT.items()
    ),
    Table(F, "points", ("docs/bench/frontier.json", *TTFT_RUNS), docs_fidelity.points_table),
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- numbers:{name} -->", f"<!-- /numbers:{name} -->"


def block(text: str, name: str) -> str | None:
    """The text between ``name``'s markers (without the newlines next to them), or None
    when the file does not hold exactly one such block."""
    start, end = (re.escape(m) for m in _markers(name))
    found = re.findall(rf"{start}\n(.*?)\n?{end}", text, flags=re.S)
    return found[0] if len(found) == 1 else None


def replace_block(text: str, name: str, body: str) -> str:
    start, end = _markers(name)
    if block(text, name) is None:
        raise ValueError(f"no single block {start} ... {end}")
    pattern = rf"{re.escape(start)}\n.*?\n?{re.escape(end)}"
    return re.sub(pattern, lambda _: f"{start}\n{body}\n{end}", text, count=1, flags=re.S)


def stale(root: Path = ROOT, docs: Path | None = None) -> list[str]:
    """Every block whose text differs from what its data give, as ``file: name: why``; the
    data come from ``root``, the Markdown from ``docs`` (default: ``root``)."""
    docs = root if docs is None else docs
    out = []
    for t in TABLES:
        current = block((docs / t.target).read_text(), t.name)
        if current is None:
            out.append(f"{t.target}: {t.name}: no single <!-- numbers:{t.name} --> block")
        elif current != t.build(root):
            out.append(f"{t.target}: {t.name}: differs from {', '.join(t.sources)}")
    return out


def write(root: Path = ROOT, docs: Path | None = None) -> list[str]:
    """Rewrite every block from its data; the ``file: name`` of each block that changed."""
    docs = root if docs is None else docs
    changed = []
    for t in TABLES:
        path = docs / t.target
        text = path.read_text()
        new = replace_block(text, t.name, t.build(root))
        if new != text:
            path.write_text(new)
            changed.append(f"{t.target}: {t.name}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docs_numbers", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 on a stale block (default)")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks from the data")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (data and docs)")
    args = parser.parse_args(argv)
    if args.write:
        for line in write(args.root):
            print(f"rewrote {line}")
        return 0
    problems = stale(args.root)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("run `make docs-numbers` to rewrite them from the data", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
