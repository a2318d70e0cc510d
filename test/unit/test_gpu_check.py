"""``sglang-relay gpu-check`` (``make gpu-check``) on this CPU: its plan, its pytest
subprocesses (a real kernel test under the interpreter, a failing, a skipping and a hanging
test written here), the table and the JSON report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sglang_relay import gpu_check as G
from sglang_relay.errors import RelayError

REPO = Path(__file__).resolve().parents[2]


def _step(name: str, where: str, tests: tuple[str, ...], timeout_s: float = 60, **kw) -> G.Step:
    return G.Step(name, where, tests, timeout_s, f"{name} works", **kw)


def _run(tmp_path, steps, argv=(), cuda=False):
    out = tmp_path / "report.json"
    rc = G.main(["--out", str(out), *argv], cuda=cuda, steps=tuple(steps))
    return rc, json.loads(out.read_text())


def _by_name(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["steps"]}


def test_budget_gpu_steps_fit_in_ten_minutes_and_run_compiled_kernels():
    on_gpu = [s for s in G.STEPS if s.where in ("gpu", "any")]
    assert {s.name for s in on_gpu} == {"kernels-compiled", "flashinfer", "server-bf16-graphs"}
    assert sum(s.timeout_s for s in on_gpu) < 600  # the ten minutes
    for s in on_gpu:  # compiled: no interpreter, whatever the caller's environment holds
        env = s.environ({"TRITON_INTERPRET": "1", "SGLANG_RELAY_KERNELS": "torch", "A": "b"})
        assert "TRITON_INTERPRET" not in env and "SGLANG_RELAY_KERNELS" not in env
        assert env["A"] == "b"
    server = next(s for s in on_gpu if s.name == "server-bf16-graphs").environ({})
    flags = server["SGLANG_RELAY_TEST_SERVER_ARGS"].split()
    assert flags[flags.index("--dtype") + 1] == "bfloat16"
    assert flags[flags.index("--attention-backend") + 1] == "flashinfer"
    assert "--disable-cuda-graph" not in flags  # decode graphs on
    for s in G.STEPS:  # every test file a step names exists
        for t in s.tests:
            assert (REPO / t.split("::")[0]).is_file(), (s.name, t)
    cpu = [s for s in G.STEPS if s.where == "cpu"]
    assert cpu and all(s.environ({})["TRITON_INTERPRET"] == "1" for s in cpu)
    assert sum(s.timeout_s for s in cpu) <= 240


def test_plan_picks_the_steps_by_host():
    steps = (_step("g", "gpu", ("x",)), _step("c", "cpu", ("x",)), _step("a", "any", ("x",)))

    def reasons(**kw):
        return {s.name: r for s, r in G.plan(steps, **kw)}

    assert reasons(cuda=False, cpu=False) == {"g": "no CUDA GPU", "c": None, "a": None}
    assert reasons(cuda=True, cpu=False) == {
        "g": None, "c": "CUDA GPU: its compiled twin runs", "a": None,
    }  # fmt: skip
    assert reasons(cuda=True, cpu=True) == {"g": "--cpu", "c": None, "a": None}
    only = reasons(cuda=True, cpu=False, only={"a"})
    assert only["a"] is None and only["g"] == only["c"] == "not selected (--only)"


def test_step_definitions_are_checked():
    with pytest.raises(ValueError, match="where"):
        _step("x", "tpu", ("t",))
    with pytest.raises(ValueError, match="timeout"):
        _step("x", "cpu", ("t",), timeout_s=0)
    with pytest.raises(ValueError, match="one word"):
        _step("two words", "cpu", ("t",))


def test_cpu_host_runs_a_real_kernel_test_and_skips_the_gpu_steps(tmp_path, capsys):
    kernel = "kernels/tests/test_kernels.py::test_gather_and_scatter_rows"  # 2 parametrized
    steps = [
        _step("needs-gpu", "gpu", ("kernels/tests/test_kernels.py",)),
        _step("rows-interpreted", "cpu", (kernel,), env=(("TRITON_INTERPRET", "1"),)),
    ]
    rc, report = _run(tmp_path, steps)
    table = capsys.readouterr().out
    assert rc == 0 and report["passed"] is True and report["mode"] == "cpu"
    steps = _by_name(report)
    assert list(steps) == ["needs-gpu", "rows-interpreted"]
    assert steps["needs-gpu"]["result"] == "skipped"
    assert steps["needs-gpu"]["reason"] == "no CUDA GPU"
    ran = steps["rows-interpreted"]
    assert ran["result"] == "passed" and ran["counts"]["passed"] == 2, ran
    assert 0 < ran["seconds"] < 60
    assert "test_gather_and_scatter_rows" in Path(ran["log"]).read_text()
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert "skipped (no CUDA GPU)" in rows["needs-gpu"]
    assert "passed (2 passed)" in rows["rows-interpreted"]
    assert rows["step"].split()[:3] == ["step", "result", "seconds"]
    assert report["machine"]["torch"] and report["machine"]["gpu"] is None


def test_a_failing_or_skipping_step_fails_the_check(tmp_path, capsys):
    (tmp_path / "test_bad.py").write_text(
        "import pytest\n\n"
        "def test_wrong():\n    assert 1 + 1 == 3\n\n"
        "def test_right(record_property):\n    record_property('gap', 0.25)\n\n"
        "def test_not_here():\n    pytest.skip('needs a thing')\n"
    )
    bad = str(tmp_path / "test_bad.py")
    steps = [
        _step("fails", "cpu", (f"{bad}::test_wrong", f"{bad}::test_right")),
        _step("skips", "cpu", (f"{bad}::test_not_here", f"{bad}::test_right")),
    ]
    rc, report = _run(tmp_path, steps)
    table = capsys.readouterr().out
    assert rc == 1 and report["passed"] is False
    steps = _by_name(report)
    assert steps["fails"]["result"] == "failed"
    assert steps["fails"]["counts"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 0}
    assert "test_wrong" in steps["fails"]["reason"]
    assert steps["skips"]["result"] == "failed"  # a skip did not prove what the step claims
    assert "needs a thing" in steps["skips"]["reason"]
    assert steps["fails"]["measured"] == {"test_right.gap": "0.25"}  # record_property
    lines = table.splitlines()
    assert any(ln.startswith("fails") and "failed (1 failed)" in ln for ln in lines)
    assert any(ln.startswith("skips") and "failed (1 skipped" in ln for ln in lines)


def test_a_step_past_its_limit_is_stopped(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, time\n\n"
        "def test_hang():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                             start_new_session=True)\n"
        f"    open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(120)\n"
    )
    # a limit past pytest's start (~4 s here, more beside other tests): the test has begun
    step = _step("hangs", "cpu", (str(tmp_path / "test_hang.py"),), timeout_s=20)
    start = time.monotonic()
    outcome = G.run_step(step, REPO, tmp_path / "logs")
    assert outcome.result == "failed" and outcome.reason == "timed out after 20 s"
    # stopped long before its 120 s sleep ends: the limit, then at most the grace a SIGINT
    # gets before SIGKILL, then a few seconds to reap and read the report (on a busy machine
    # the step's pytest once let the whole grace pass: 50.02 s, CI beside the demo)
    assert time.monotonic() - start < 20 + G.STOP_GRACE_S + 15
    # the process it started in a session of its own is gone too
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cli_lists_the_steps_and_refuses_unknown_ones(capsys):
    from sglang_relay.cli import main

    assert main(["gpu-check", "--list"]) == 0
    listed = capsys.readouterr().out
    for s in G.STEPS:
        assert f"{s.name} [{s.where}," in listed
    assert main(["gpu-check", "--only", "no-such-step"]) == 1
    assert "no step no-such-step" in capsys.readouterr().err
    with pytest.raises(RelayError):
        G.find_repo("/")
