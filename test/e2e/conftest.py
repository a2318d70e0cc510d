"""One real SGLang server (relay backend, embedded model, bounded KV pool) per session."""

from __future__ import annotations

import psutil
import pytest
from relay_helpers import EXTRA_ARGS

from sglang_relay.runtime.launch import ServerProcess

E2E_KV_TOKENS = 16384


@pytest.fixture(scope="session")
def server(model_dir):
    proc = ServerProcess(
        [
            "--model-path",
            str(model_dir),
            "--max-total-tokens",
            str(E2E_KV_TOKENS),
            "--enable-metrics",
            *EXTRA_ARGS,
        ]
    )
    proc.start(timeout=600)
    group = [proc.proc.pid] + [c.pid for c in psutil.Process(proc.proc.pid).children(True)]
    yield proc
    proc.stop()
    alive = [pid for pid in group if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert not alive, f"server processes left behind: {alive}\n{proc.log_tail()}"


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
