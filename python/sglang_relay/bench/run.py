"""``sglang-relay bench run``: every workload kind, all five methods, one server, one run.

The workload is data (``--workload FILE``, JSONL; the default ships in the package), one
case per line, by ``kind``:

* ``sweep`` / ``agents``: synthetic relays timed to the first token
  (:mod:`sglang_relay.bench.ttft`): one span of each length, or N agents of which each
  reads the outputs of the ones before it;
* ``humaneval``: Architect -> Developer -> Reviewer on HumanEval with pass@1 of the code
  agent (:mod:`sglang_relay.bench.chains`);
* ``frontend``: a frontend-language program (``fork``/``gen``) run as users write it.

A case may carry ``"quick": {...}``: the fields that ``--quick`` overrides (fewer sizes,
fewer problems). The run writes ``results.json`` (raw records and summaries, with the
command and machine), ``report.md`` (tables) and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_relay.bench import chains, ttft
from sglang_relay.errors import RelayError

KINDS = ("sweep", "agents", "humaneval", "frontend")
REQUIRED = {
    "sweep": ("span_tokens",),
    "agents": ("n_agents", "output_tokens"),
    "humaneval": ("agents",),
    "frontend": ("tasks",),
}
DEFAULT_WORKLOAD = "bench_workload.jsonl"


def load_workload(path: str | None, quick: bool) -> list[dict[str, Any]]:
    if path is None:
        text = resources.files("sglang_relay.data").joinpath(DEFAULT_WORKLOAD).read_text()
        path = DEFAULT_WORKLOAD
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise RelayError(f"--workload {path}: {exc.strerror}") from exc
    cases = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except ValueError as exc:
            raise RelayError(f"{path}:{n}: not JSON ({exc})") from exc
        kind = case.get("kind") if isinstance(case, dict) else None
        if kind not in KINDS:
            raise RelayError(f"{path}:{n}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        missing = [f for f in REQUIRED[kind] if f not in case]
        if missing:
            raise RelayError(f"{path}:{n}: {kind} case needs {', '.join(missing)}")
        if quick:
            case.update(case.get("quick", {}))
        cases.append(case)
    if not cases:
        raise RelayError(f"{path}: no cases")
    return cases


class Progress:
    """A status line per stage: ``[bench] humaneval 3/10 [######----] 2m13s`` (redrawn in
    place on a terminal, one line per step otherwise)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def stage(self, name: str, total: int) -> Callable[[], None]:
        done = [0]

        def tick() -> None:
            done[0] += 1
            self.show(name, done[0], total)

        self.show(name, 0, total)
        return tick

    def show(self, name: str, done: int, total: int) -> None:
        bar = "#" * int(20 * done / max(total, 1))
        t = time.perf_counter() - self.start
        line = f"[bench] {name} {done}/{total} [{bar:<20}] {t // 60:.0f}m{t % 60:02.0f}s"
        if self.tty:
            print("\r" + line, end="\n" if done == total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- summaries


def summarize_chains(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["kind"], rec["agent"], rec["method"]), []).append(rec)
    rows = []
    for (kind, agent, method), recs in sorted(groups.items()):
        row: dict[str, Any] = {"kind": kind, "agent": agent, "method": method, "n": len(recs)}
        row["prompt_tokens"] = statistics.median(r["prompt_tokens"] for r in recs)
        row["reuse_rate"] = round(statistics.median(r["reuse_rate"] for r in recs), 4)
        row["fallbacks"] = sum(r["fallback"] is not None for r in recs)
        key = "ttft_s" if "ttft_s" in recs[0] else "program_latency_s"
        row[key + "_median"] = round(statistics.median(r[key] for r in recs), 4)
        std = groups.get((kind, agent, "standard"))
        if std:
            base = statistics.median(r[key] for r in std)
            row["speedup_vs_standard"] = round(base / row[key + "_median"], 2)
        compared = [r for r in recs if "same_output" in r]
        if compared:
            row["same_output"] = round(sum(r["same_output"] for r in compared) / len(compared), 3)
            row["agree_first64"] = round(statistics.mean(r["agree_first64"] for r in compared), 3)
            row["rouge_l"] = round(statistics.mean(r["rouge_l"] for r in compared), 3)
        if "passed" in recs[0]:
            row["pass_at_1"] = round(sum(r["passed"] for r in recs) / len(recs), 3)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for _, key in columns:
            v = r.get(key)
            if isinstance(v, float) and v.is_integer() and key in ("prompt_tokens", "n"):
                v = int(v)
            cells.append("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CHAIN_COLUMNS = [
    ("workload", "kind"),
    ("agent", "agent"),
    ("method", "method"),
    ("n", "n"),
    ("prompt", "prompt_tokens"),
    ("reuse", "reuse_rate"),
    ("TTFT median s", "ttft_s_median"),
    ("program s", "program_latency_s_median"),
    ("speedup", "speedup_vs_standard"),
    ("same output", "same_output"),
    ("agree@64", "agree_first64"),
    ("ROUGE-L", "rouge_l"),
    ("pass@1", "pass_at_1"),
    ("fallbacks", "fallbacks"),
]


# ----------------------------------------------------------------------------- plots


def plot(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = result["ttft"]
    for kind, x_key, x_label, name in (
        ("sweep", "span_tokens", "relayed span length (tokens)", "ttft_vs_span.png"),
        ("agents", "n_agents", "number of agents", "ttft_vs_agents.png"),
    ):
        sel = [r for r in rows if r["case"] == kind]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in sorted({r["method"] for r in sel}):
            pts = sorted((r[x_key], r["ttft_median_s"]) for r in sel if r["method"] == method)
            ax.plot(*zip(*pts, strict=False), marker="o", label=method)
        ax.set_xlabel(x_label)
        ax.set_ylabel("TTFT, median (s)")
        if kind == "sweep":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"TTFT of the relaying agent ({result['meta']['machine_short']})")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    sel = [r for r in result["chains"] if "agree_first64" in r and r["method"] != "standard"]
    if sel:
        fig, ax = plt.subplots(figsize=(6, 4))
        by_method: dict[str, list[dict[str, Any]]] = {}
        for r in sel:
            by_method.setdefault(r["method"], []).append(r)
        for method, rs in sorted(by_method.items()):
            ax.scatter(
                [r["reuse_rate"] for r in rs], [r["agree_first64"] for r in rs], label=method
            )
        ax.set_xlabel("reuse rate (token-layers of relayed spans reused)")
        ax.set_ylabel("greedy agreement with standard, first 64 tokens")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("Fidelity vs reuse (one point per workload agent)")
        fig.tight_layout()
        fig.savefig(out / "fidelity_vs_reuse.png", dpi=110)
        plt.close(fig)
        written.append("fidelity_vs_reuse.png")
    return written


def report(result: dict[str, Any], plots: list[str]) -> str:
    meta = result["meta"]
    parts = [
        "# sglang-relay benchmark",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs, {meta['device']}; "
        f"model {meta['model']}; {meta['elapsed_s']:.0f} s.",
        "",
    ]
    for kind, title in (
        ("sweep", "TTFT vs relayed span length (one upstream output, synthetic)"),
        ("agents", "TTFT vs number of agents (agent N reads agents 1..N-1)"),
    ):
        rows = [r for r in result["ttft"] if r["case"] == kind]
        if rows:
            parts += [f"## {title}", "", ttft.markdown(rows), ""]
    if result["chains"]:
        cols = [c for c in CHAIN_COLUMNS if any(c[1] in r for r in result["chains"])]
        parts += ["## Agent chains (every method on the same upstream outputs)", ""]
        parts += [_table(result["chains"], cols), ""]
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def write_report(out: Path, result: dict[str, Any]) -> str:
    """Plots and ``report.md`` into ``out`` from a run's ``results.json`` content."""
    plots = plot(result, out)
    text = report(result, plots)
    (out / "report.md").write_text(text)
    return text


def main_report(argv: list[str]) -> int:
    """``sglang-relay bench report DIR``: redraw plots and report.md from DIR/results.json."""
    if len(argv) != 1:
        raise RelayError("usage: sglang-relay bench report DIR (a folder with results.json)")
    out = Path(argv[0])
    try:
        result = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise RelayError(f"{out}/results.json: {exc}") from exc
    print(write_report(out, result))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the workload's quick sizes")
    parser.add_argument("--workload", help="JSONL workload (default: the packaged one)")
    parser.add_argument("--out", default="bench-results", help="output folder")
    parser.add_argument("--url", help="use a running relay server instead of starting one")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument("--reps", type=int, help="TTFT repetitions (default 3 quick, 7 full)")
    parser.add_argument("--methods", default=",".join(ttft.METHODS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="run only these case kinds")
    args, server_flags = parser.parse_known_args(argv)

    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(ttft.METHODS)
    if unknown:
        raise RelayError(f"unknown methods: {', '.join(sorted(unknown))}")
    kinds = set(args.kinds.split(","))
    cases = [c for c in load_workload(args.workload, args.quick) if c["kind"] in kinds]
    reps = args.reps or (3 if args.quick else 7)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tok = AutoTokenizer.from_pretrained(model_path)
    progress = Progress()
    server = None
    url = args.url
    if url is None:
        print("[bench] starting SGLang with the relay backend ...", file=sys.stderr, flush=True)
        server = ServerProcess(["--model-path", model_path, *server_flags]).start()
        url = server.url
    started = time.time()
    records: list[dict[str, Any]] = []
    ttft_rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            kind = case["kind"]
            if kind in ("sweep", "agents"):
                rows = ttft.run(url, tok, [case], reps, methods, progress=True)
                ttft_rows += [{**r, "case": kind} for r in rows]
            elif kind == "humaneval":
                limit = case.get("limit")
                total = len(chains.humaneval_problems(limit))
                tick = progress.stage("humaneval", total)
                records += chains.run_humaneval(url, tok, case, methods, limit, tick)
            else:
                limit = case.get("limit")
                total = len(case["tasks"][:limit] if limit else case["tasks"])
                tick = progress.stage("frontend", total)
                records += chains.run_frontend(url, tok, case, methods, limit, tick)
    finally:
        if server is not None:
            server.stop()
    device = "cuda " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {
        "meta": {
            "command": "sglang-relay bench run " + shlex.join(argv),
            "machine": platform.platform(),
            "machine_short": f"{platform.machine()}, {device}",
            "cpus": os.cpu_count(),
            "device": device,
            "python": sys.version.split()[0],
            "model": Path(model_path).name,
            "methods": methods,
            "reps": reps,
            "quick": args.quick,
            "elapsed_s": round(time.time() - started, 1),
        },
        "ttft": ttft_rows,
        "chains": summarize_chains(records),
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(write_report(out, result))
    print(f"[bench] wrote {out}/results.json, report.md and plots", file=sys.stderr)
    return 0
