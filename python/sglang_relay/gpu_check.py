"""``sglang-relay gpu-check`` (``make gpu-check``): the first GPU run as one command.

On a machine with one CUDA GPU it runs, each as a pytest subprocess with its own time limit,
the Triton kernels compiled (``TRITON_INTERPRET`` removed), the FlashInfer plan and glue
tests (the real FlashInfer call included), and a relay server on the embedded model in bf16
with FlashInfer and decode CUDA graphs checked against the reference executor
(``test/e2e/test_gpu_server.py``). It prints one table (step, result, seconds, what the step
proves) and writes it as JSON with the machine and versions. On a host without CUDA (or
with ``--cpu``) the GPU steps are reported ``skipped (no CUDA GPU)`` and the CPU twins run:
the same kernel tests under Triton's interpreter. The exit code is 1 if a step failed.

A step passes only if its tests all ran and passed: a skipped test fails the step (it did
not prove what the step claims), as do a failure, an error, a crash and the time limit.
The steps are data (:data:`STEPS`); docs/gpu.md lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_relay.errors import RelayError

# the budget for the GPU run; the limits of the steps a GPU host runs sum below it
GPU_BUDGET_S = 600.0
# after a step's limit: SIGINT (pytest unwinds, its fixtures stop their servers), then this
# long before its remaining processes are killed
STOP_GRACE_S = 30.0
# the GPU run's server: bf16, FlashInfer; decode graphs stay on (serve's GPU default), three
# captured batch sizes keep the capture short
GPU_SERVER_ARGS = "--dtype bfloat16 --attention-backend flashinfer --cuda-graph-bs-decode 1 2 4"
# environment a nested pytest must not inherit from a calling one (xdist workers, addopts)
_PYTEST_VARS = (
    "PYTEST_ADDOPTS",
    "PYTEST_CURRENT_TEST",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_XDIST_TESTRUNUID",
)
KERNEL_TESTS = ("kernels/tests/test_kernels.py", "kernels/tests/test_kernel_lowering.py")
FLASHINFER_TESTS = (
    "kernels/tests/test_flashinfer_plan.py",
    "kernels/tests/test_flashinfer_glue.py",
)


@dataclass(frozen=True, slots=True)
class Step:
    """One named check: ``pytest tests [-k select]`` from the repository root with ``env``
    set and ``unset`` removed, within ``timeout_s``. ``where``: ``"gpu"`` (a CUDA GPU
    only), ``"cpu"`` (the CPU twin, run where the GPU steps cannot) or ``"any"``."""

    name: str
    where: str
    tests: tuple[str, ...]
    timeout_s: float
    proves: str
    select: str = ""
    env: tuple[tuple[str, str], ...] = ()
    unset: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or " " in self.name:
            raise ValueError(f"step name must be one word, got {self.name!r}")
        if self.where not in ("gpu", "cpu", "any"):
            raise ValueError(f"step {self.name}: where must be gpu, cpu or any")
        if not self.tests:
            raise ValueError(f"step {self.name}: no tests")
        if not self.timeout_s > 0:
            raise ValueError(f"step {self.name}: timeout_s must be > 0")

    def command(self, junit: str | None = None) -> list[str]:
        """The pytest command (``python -m pytest``), a JUnit report to ``junit``."""
        cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider"]
        if junit is not None:  # xunit1: the tests' record_property values are kept
            cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        return cmd + (["-k", self.select] if self.select else []) + list(self.tests)

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the step's changes."""
        drop = set(self.unset) | set(_PYTEST_VARS)
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in drop}
        env.update(self.env)
        return env


_COMPILED = ("TRITON_INTERPRET", "SGLANG_RELAY_KERNELS")  # removed: compiled kernels, auto pick
_INTERPRETED = (("TRITON_INTERPRET", "1"),)


def _pair(tests, gpu: str, gpu_s: float, gpu_proves: str, cpu: str, cpu_s: float,
          cpu_proves: str, cpu_select: str = "") -> tuple[Step, Step]:  # fmt: skip
    """A GPU step over ``tests`` (compiled kernels: :data:`_COMPILED` removed) and its CPU
    twin over the same tests under Triton's interpreter (``cpu_select``: its ``-k``)."""
    return (
        Step(gpu, "gpu", tests, gpu_s, gpu_proves, unset=_COMPILED),
        Step(cpu, "cpu", tests, cpu_s, cpu_proves, select=cpu_select, env=_INTERPRETED),
    )


_KERNELS = _pair(
    KERNEL_TESTS,
    "kernels-compiled", 120,
    "Triton splice + re-rotate, row gather/scatter and relay-extend attention compiled "
    "on the GPU (bf16 with 16-bit tl.dot operands) == their torch references",
    "kernels-interpreted", 150,
    "the same kernel tests under Triton's interpreter (fp32 tl.dot operands), and the "
    "kernels lowered to Triton IR for a CUDA target",
)  # fmt: skip
_FLASHINFER = _pair(
    FLASHINFER_TESTS,
    "flashinfer", 150,
    "the FlashInfer extend plan == positional causal attention; the real FlashInfer "
    "paged prefill with relay's mask == the plan's oracle; one plan per row set",
    "flashinfer-plan-cpu", 90,
    "the FlashInfer plan and glue against the CPU oracle (no FlashInfer call)",
    cpu_select="not on_a_gpu",
)  # fmt: skip
STEPS: tuple[Step, ...] = (
    _KERNELS[0],
    _FLASHINFER[0],
    Step(
        "server-bf16-graphs", "gpu", ("test/e2e/test_gpu_server.py",), 300,
        "a bf16 relay server with FlashInfer and decode CUDA graphs: the capture inside the "
        "graphs (capture_in_graph, graph decodes, no eager ones), relay == the reference "
        "executor within SGLang's own bf16 gap, all-selected relay == standard",
        env=(("SGLANG_RELAY_TEST_SERVER_ARGS", GPU_SERVER_ARGS), ("SGLANG_RELAY_TEST_ZYGOTE", "0")),
        unset=_COMPILED,
    ),
    _KERNELS[1],
    _FLASHINFER[1],
)  # fmt: skip


@dataclass
class Outcome:
    """What one step did: ``result`` is ``passed``, ``failed`` or ``skipped`` (``reason``
    says why; for a run step, the counts or the first failure)."""

    name: str
    result: str
    reason: str
    seconds: float
    proves: str
    timeout_s: float
    counts: dict[str, int] = field(default_factory=dict)
    measured: dict[str, str] = field(default_factory=dict)
    log: str = ""

    @property
    def label(self) -> str:
        """The table's result: ``failed (timed out after 120 s)``, ``passed (38 passed)``,
        ``skipped (no CUDA GPU)`` (a failure's detail, after ``;``, is printed below it)."""
        short = self.reason.split(";")[0]
        return f"{self.result} ({short})" if short else self.result


def plan(steps: tuple[Step, ...], *, cuda: bool, cpu: bool, only: set[str] | None = None):
    """``[(step, None)]`` for a step to run, ``[(step, reason)]`` for one to skip: GPU steps
    need CUDA (and no ``cpu``); CPU twins run where the GPU steps do not."""
    out = []
    for step in steps:
        reason = None
        if only is not None and step.name not in only:
            reason = "not selected (--only)"
        elif step.where == "gpu" and not cuda:
            reason = "no CUDA GPU"
        elif step.where == "gpu" and cpu:
            reason = "--cpu"
        elif step.where == "cpu" and cuda and not cpu:
            reason = "CUDA GPU: its compiled twin runs"
        out.append((step, reason))
    return out


def run_step(step: Step, repo: Path, log_dir: Path, timeout_scale: float = 1.0) -> Outcome:
    """Run ``step`` from ``repo``, its output to ``log_dir/<name>.log``, and judge it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log, junit = log_dir / f"{step.name}.log", log_dir / f"{step.name}.xml"
    junit.unlink(missing_ok=True)
    limit = step.timeout_s * timeout_scale
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            step.command(str(junit)), cwd=repo, env=step.environ(), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            rc, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            rc, timed_out = _stop(proc), True
    seconds = time.monotonic() - start
    report = _read_junit(junit)
    result, reason = _judge(rc, report, timed_out, limit)
    return Outcome(
        step.name, result, reason, seconds, step.proves, limit,
        report["counts"], report["measured"], str(log),
    )  # fmt: skip


def _stop(proc: subprocess.Popen) -> int:
    """Stop a step past its limit and every process it started (servers run in sessions of
    their own: they are found as its descendants, by pid)."""
    family = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *family, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return proc.wait()


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # psutil missing, or the process is gone
        return []


def _read_junit(path: Path) -> dict:
    """Counts (passed, failed, errors, skipped), the first failure's and the first skip's
    messages, and the tests' recorded properties, from a JUnit report."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    report: dict = {"counts": counts, "measured": {}, "failure": "", "skip": "", "found": False}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return report
    report["found"] = True
    for case in root.iter("testcase"):
        test = case.get("name", "?")
        outcome = "passed"
        for kind, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(kind)
            if node is not None:
                outcome = key
                msg = (node.get("message") or node.text or "").strip().splitlines()
                slot = "skip" if key == "skipped" else "failure"
                if not report[slot]:
                    report[slot] = f"{test}: {msg[0][:160] if msg else kind}"
                break
        counts[outcome] += 1
        for prop in case.iter("property"):
            report["measured"][f"{test}.{prop.get('name')}"] = prop.get("value", "")
    return report


def _judge(rc: int, report: dict, timed_out: bool, limit: float) -> tuple[str, str]:
    counts = report["counts"]
    if timed_out:
        return "failed", f"timed out after {limit:.0f} s"
    if counts["failed"] or counts["errors"]:
        n = counts["failed"] + counts["errors"]
        return "failed", f"{n} failed; {report['failure']}"
    if rc != 0 or not report["found"]:
        return "failed", f"pytest exited {rc}" + ("" if report["found"] else ", no report")
    if counts["skipped"]:
        return "failed", f"{counts['skipped']} skipped, so not proven; {report['skip']}"
    if counts["passed"] == 0:
        return "failed", "no test ran"
    return "passed", f"{counts['passed']} passed"


def format_table(outcomes: list[Outcome]) -> str:
    """One table: step, result, seconds, what it proves."""
    rows = [("step", "result", "seconds", "what it proves")]
    rows += [(o.name, o.label, f"{o.seconds:.1f}", o.proves) for o in outcomes]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    lines = []
    for name, label, secs, proves in rows:
        lines.append(f"{name:<{w0}}  {label:<{w1}}  {secs:>{w2}}  {proves}")
    return "\n".join(lines)


def machine(cuda: bool) -> dict[str, str | None]:
    """The host and the versions the run used."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version(), "host": platform.node()}
    for pkg in ("torch", "triton", "flashinfer-python", "sglang", "sglang-relay"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    out["gpu"] = None
    if cuda:
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
    return out


def find_repo(given: str | None = None) -> Path:
    """The checkout whose tests the steps run: ``given``, else this file's, else the cwd."""
    here = Path(__file__).resolve().parents[2]
    for cand in [Path(given)] if given else [here, Path.cwd()]:
        if (cand / "kernels" / "tests").is_dir() and (cand / "test" / "e2e").is_dir():
            return cand.resolve()
    raise RelayError(
        "gpu-check runs the repository's tests: run it in a checkout (make gpu-check) or "
        "pass --repo"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-relay gpu-check",
        description="The first GPU run in one command (docs/gpu.md); CPU parts without CUDA.",
    )
    p.add_argument("--cpu", action="store_true", help="the CPU parts only, even with a GPU")
    p.add_argument("--only", default=None, help="comma-separated step names to run")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    p.add_argument("--out", default="gpu-check.json", help="the JSON report (and its logs)")
    p.add_argument("--repo", default=None, help="the checkout to test (default: found)")
    p.add_argument(
        "--timeout-scale", type=float, default=1.0,
        help="multiply every step's limit (e.g. 2 on a first run that JIT-compiles FlashInfer)",
    )  # fmt: skip
    return p


def main(
    argv: list[str] | None = None, *, cuda: bool | None = None, steps: tuple[Step, ...] = STEPS
) -> int:
    """Run the check; ``cuda`` (default: detected) and ``steps`` are for tests."""
    args = _parser().parse_args(argv)
    if args.list:
        for s in steps:
            sel = f" -k {s.select!r}" if s.select else ""
            print(f"{s.name} [{s.where}, {s.timeout_s:.0f} s]: pytest {' '.join(s.tests)}{sel}")
            print(f"    {s.proves}")
        return 0
    only = set(args.only.split(",")) if args.only else None
    unknown = sorted((only or set()) - {s.name for s in steps})
    if unknown:
        raise RelayError(f"--only: no step {', '.join(unknown)} (steps: see --list)")
    if not args.timeout_scale > 0:
        raise RelayError("--timeout-scale must be > 0")
    repo = find_repo(args.repo)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    out_path = Path(args.out)
    log_dir = out_path.with_name(out_path.stem + "-logs")
    outcomes, start = [], time.monotonic()
    for step, reason in plan(steps, cuda=cuda, cpu=args.cpu, only=only):
        if reason is not None:
            outcomes.append(Outcome(step.name, "skipped", reason, 0.0, step.proves, 0.0))
            continue
        limit = step.timeout_s * args.timeout_scale
        print(f"gpu-check: {step.name} (limit {limit:.0f} s) ...", flush=True)
        outcomes.append(run_step(step, repo, log_dir, args.timeout_scale))
        print(f"gpu-check: {step.name}: {outcomes[-1].label}", flush=True)
    failed = [o for o in outcomes if o.result == "failed"]
    report = {
        "passed": not failed,
        "cuda": cuda,
        "mode": "cpu" if args.cpu or not cuda else "gpu",
        "total_seconds": round(time.monotonic() - start, 1),
        "machine": machine(cuda),
        "steps": [asdict(o) for o in outcomes],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(format_table(outcomes))
    print(f"\n{report['mode']} run, {report['total_seconds']} s; report: {out_path}")
    for o in failed:
        print(f"  {o.name}: {o.reason}\n    log: {o.log}")
    return 1 if failed else 0
