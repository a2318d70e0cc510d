"""Stopping a server's process group leaves none of its members running: the teardown of
every e2e test checks that at once after ``stop``, and a killed scheduler (SGLang's crash
handler sleeps before its diagnostics) may take a moment to go (a CI flake of
2026-12: "server processes left behind")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sglang_relay.process import _group_members, _wait_group_gone

# a leader whose two children ignore SIGTERM, as busy workers would
_TREE = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
kids = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
print("up", flush=True)
time.sleep(60)
"""


def test_a_stopped_group_has_no_live_member():
    leader = subprocess.Popen([sys.executable, "-c", _TREE], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert leader.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while len(_group_members(leader.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_group_members(leader.pid)) == 3  # the leader and its two children
        os.killpg(leader.pid, signal.SIGTERM)  # ignored by all three
        time.sleep(0.2)
        assert len(_group_members(leader.pid)) == 3
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        _wait_group_gone(leader.pid, 10)
        assert _group_members(leader.pid) == []
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()


# a child that dies at start-up as a TP server whose rank failed does: one process's
# traceback (chained), then many lines of others' noise, then the launcher's own traceback
_DIES = r"""
import sys
try:
    try:
        raise ValueError("the cause,\nover two lines")
    except ValueError as exc:
        raise RuntimeError("rank 0 could not listen on its port") from exc
except RuntimeError:
    import traceback
    print("Scheduler hit an exception: " + traceback.format_exc(), flush=True)
for i in range(50):
    print(f"noise {i}", flush=True)
raise SystemExit("Rank 0 scheduler died during initialization")
"""


def test_a_start_up_failure_shows_the_first_error_not_only_the_tail():
    import pytest

    from sglang_relay.errors import RelayError
    from sglang_relay.process import _ChildProcess

    class Dies(_ChildProcess):
        name = "dier"

        def command(self):
            return [sys.executable, "-c", _DIES]

        def ready(self):
            return False

    with pytest.raises(RelayError) as err:
        Dies([], port=1).start(timeout=60)
    text = str(err.value)
    assert "exited with code 1 during start-up" in text
    assert "Rank 0 scheduler died during initialization" in text  # the tail
    assert "noise 49" in text and "noise 5\n" not in text
    first = text.split("first error in the log:")[1].split("last lines:")[0]
    assert first.splitlines()[1].startswith("Scheduler hit an exception: Traceback")
    assert "ValueError: the cause,\nover two lines" in first  # the chained cause, whole
    assert first.rstrip().endswith("...")
    assert "RuntimeError: rank 0 could not listen on its port" in first
