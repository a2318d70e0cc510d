"""A pytest plug-in: CPU seconds per test, the test process's own and its descendants'
(servers, routers, ranks), written as JSON lines. Where CI's CPU goes, test by test.

    PYTHONPATH=research/studies python -m pytest -p cpu_per_test -n 2 --dist loadfile \
        --no-loadscope-reorder test kernels/tests   # SGLANG_RELAY_CPU_LOG=out.jsonl

A sampler thread reads every descendant's CPU time each second and keeps the last value per
process; a test is charged the growth of (own CPU + every descendant's last value) from its
set-up to its teardown, so a module server's start lands on the test that started it. A
process's CPU between its last sample and its exit (at most ~1 s) is not counted."""

from __future__ import annotations

import json
import os
import threading
import time

import psutil
import pytest

_last: dict[int, float] = {}
_lock = threading.Lock()


def _sample() -> None:
    me = psutil.Process()
    while True:
        try:
            kids = me.children(recursive=True)
        except psutil.Error:
            kids = []
        for p in kids:
            try:
                t = p.cpu_times()
                with _lock:
                    _last[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass
        time.sleep(1.0)


def _total() -> tuple[float, float]:
    with _lock:
        kids = sum(_last.values())
    return time.process_time(), kids


def pytest_configure(config):
    threading.Thread(target=_sample, daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, (own, kids) = time.monotonic(), _total()
    yield
    time.sleep(1.1)  # one more sample of processes the test still runs
    own2, kids2 = _total()
    row = {
        "test": item.nodeid,
        "wall": round(time.monotonic() - wall - 1.1, 2),
        "cpu_own": round(own2 - own, 2),
        "cpu_children": round(kids2 - kids, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
    }
    path = os.environ.get("SGLANG_RELAY_CPU_LOG", "cpu_per_test.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
