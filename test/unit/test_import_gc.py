"""SGLang's imports without the garbage collector (runtime/import_gc.py), in fresh
interpreters: paused inside, on again after with the survivors frozen; the forkserver's
first preload pauses it and every forked child has it on; ``SGLANG_RELAY_IMPORT_GC=1``
leaves it alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SERVE = """
import gc
from sglang_relay.runtime.import_gc import collector_paused
with collector_paused():
    inside = gc.isenabled()
    import json, email.mime.text  # something to import
print(inside, gc.isenabled(), gc.get_freeze_count() > 1000)
"""

FORKSERVER = """
import gc, os
import sglang_relay.runtime.standin.forkserver_first  # the forkserver's first preload
paused = gc.isenabled()
pid = os.fork()
if pid == 0:
    os._exit(0 if gc.isenabled() else 3)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
from sglang_relay.runtime.import_gc import freeze_and_resume
freeze_and_resume()  # what the last preload (forkserver_preload) ends with
print(paused, child, gc.isenabled(), gc.get_freeze_count() > 1000)
"""


def _run(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize("opt_out", [False, True])
def test_serve_imports_with_the_collector_paused_then_frozen(opt_out):
    env = {"SGLANG_RELAY_IMPORT_GC": "1" if opt_out else "0"}
    inside, after, frozen = _run(SERVE, **env)
    assert after == "True"
    assert (inside, frozen) == (("True", "False") if opt_out else ("False", "True"))


@pytest.mark.parametrize("opt_out", [False, True])
def test_the_forkserver_pauses_it_and_every_child_has_it_on(opt_out):
    env = {"SGLANG_RELAY_IMPORT_GC": "1" if opt_out else "0"}
    paused, child, after, frozen = _run(FORKSERVER, **env)
    assert (child, after) == ("True", "True")
    assert (paused, frozen) == (("True", "False") if opt_out else ("False", "True"))
