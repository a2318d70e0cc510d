"""What a CPU relay server's start costs, its children spawned (SGLang's way) or forked from
the stand-in's preloaded forkserver (runtime/standin/cpu.py): time to a healthy server and the CPU
seconds of every process of the server until then, alternating the two, servers one at a
time. CI starts ~30 servers on 2 cores, so the CPU seconds are what CI time pays.

    python research/studies/start_cost.py --rounds 4 --out research/studies/data/start_cost.json

``--gc``: forkserver starts with the garbage collector on during SGLang's imports against
the default (paused: runtime/import_gc.py), CPU seconds per process.

``--zygote``: the tests' launchers (test/e2e/launcher_zygote.py) forked from the study
process's preloaded parent against spawned ``sglang-relay serve`` interpreters, alternating:
time to healthy and CPU seconds per process (the parent's own, paid once per test process,
is reported apart).

``--plugins``: instead, what loading SGLang's plug-ins (relay's hooks applied) costs a process
that imported the forkserver's SGLang modules, i.e. what each child paid before the
forkserver loaded them once for all (``runtime/standin/forkserver_preload.py``), one fresh
interpreter per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import psutil
import requests

from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess
from sglang_relay.runtime.import_gc import IMPORT_GC_ENV
from sglang_relay.runtime.standin.cpu import CPU_SPAWN_ENV


def _role(p: psutil.Process) -> str:
    line = " ".join(p.cmdline())
    for role in ("forkserver", "resource_tracker", "scheduler", "detokenizer"):
        if role in line:
            return role
    return "launcher"


def one_start(spawn: bool, import_gc: bool | None = None, server_class=ServerProcess) -> dict:
    env = {CPU_SPAWN_ENV: "1" if spawn else "0"}
    if import_gc is not None:
        env[IMPORT_GC_ENV] = "1" if import_gc else "0"
    t0 = time.monotonic()
    seen: dict[int, psutil.Process] = {}
    args = ["--model-path", str(ensure_model(quiet=True)), "--max-total-tokens", "8192"]
    server = server_class(args, env=env)
    server.start(timeout=600)
    ready = time.monotonic() - t0
    root = psutil.Process(server.proc.pid)
    for p in [root, *root.children(recursive=True)]:
        seen[p.pid] = p
    by_role: dict[str, float] = {}
    for p in seen.values():
        role = _role(p)
        by_role[role] = round(by_role.get(role, 0.0) + sum(p.cpu_times()[:2]), 2)
    cpu = sum(by_role.values())
    text = requests.post(server.url + "/generate", timeout=120, json={
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }).json()["text"]  # fmt: skip
    server.stop()
    out = {"spawn": spawn, "ready_s": round(ready, 1), "cpu_s": round(cpu, 1), "text": text}
    if import_gc is not None:
        out.update(import_gc=import_gc)
    return {**out, "cpu_by_process": by_role}


PLUGIN_LOAD = """
import time
from sglang_relay.runtime.standin import cpu
cpu.activate()
for name in cpu.FORKSERVER_PRELOAD[:-1]:
    __import__(name)
from sglang.srt.plugins import load_plugins
t = time.process_time()
load_plugins()
print("LOAD", time.process_time() - t)
"""


def plugin_load_s() -> float:
    import subprocess

    out = subprocess.run([sys.executable, "-c", PLUGIN_LOAD], capture_output=True, text=True)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("LOAD ")]
    return round(float(line.split()[1]), 3)


def _alternate(rounds: int, out: str | None, key: str, names: dict, start) -> int:
    """``start(True)`` and ``start(False)`` alternating for ``rounds`` rounds, each run
    marked ``key``; medians per ``names[value]`` (time, CPU, CPU per process), JSON to
    ``out``; both ways must answer the same text."""
    runs = []
    for r in range(rounds):
        for value in (True, False) if r % 2 == 0 else (False, True):
            runs.append({key: value, **start(value)})
            print(runs[-1], flush=True)
    summary = {}
    for value in (True, False):
        mine = [x for x in runs if x[key] is value]
        roles = sorted({k for x in mine for k in x["cpu_by_process"]})
        summary[names[value]] = {
            **{k: statistics.median(x[k] for x in mine) for k in ("ready_s", "cpu_s")},
            **{k: statistics.median(x["cpu_by_process"].get(k, 0) for x in mine) for k in roles},
        }
    return _report(runs, summary, rounds, out)


def _report(runs: list, summary: dict, rounds: int, out: str | None) -> int:
    print(json.dumps(summary))
    assert len({x["text"] for x in runs}) == 1, "the two ways answered differently"
    if out:
        data = {"machine": f"{os.cpu_count()} cores", "rounds": rounds, "runs": runs,
                "median": summary, "argv": sys.argv[1:]}  # fmt: skip
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def compare_import_gc(rounds: int, out: str | None) -> int:
    """Forkserver starts alternating: SGLANG_RELAY_IMPORT_GC=1 (collector on while SGLang
    is imported) against the default (paused; runtime/import_gc.py)."""
    names = {True: "collector_on", False: "paused"}
    return _alternate(rounds, out, "import_gc", names, lambda on: one_start(False, import_gc=on))


def compare_zygote(rounds: int, out: str | None) -> int:
    """Launchers forked from the tests' preloaded parent against spawned ones, alternating
    (the scheduler and detokenizer fork from the stand-in's forkserver in both); the
    parent's own CPU seconds, paid once per test process, printed apart."""
    from multiprocessing import forkserver

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "test", "e2e"))
    from relay_helpers import PreloadedServerProcess

    def start(forked: bool) -> dict:
        return one_start(False, server_class=PreloadedServerProcess if forked else ServerProcess)

    code = _alternate(rounds, out, "forked", {True: "forked", False: "spawned"}, start)
    parent = psutil.Process(forkserver._forkserver._forkserver_pid)
    print(json.dumps({"parent_cpu_s_once": round(sum(parent.cpu_times()[:2]), 1)}))
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plugins", action="store_true", help="the plug-in load's CPU seconds")
    ap.add_argument(
        "--gc",
        action="store_true",
        help="forkserver starts with the collector on during imports vs paused",
    )
    ap.add_argument(
        "--zygote", action="store_true", help="launchers forked from the tests' parent vs spawned"
    )
    args = ap.parse_args()
    if args.zygote:
        return compare_zygote(args.rounds, args.out)
    if args.gc:
        return compare_import_gc(args.rounds, args.out)
    if args.plugins:
        cpu_s = [plugin_load_s() for _ in range(args.rounds)]
        data = {"machine": f"{os.cpu_count()} cores", "rounds": args.rounds,
                "load_plugins_cpu_s": cpu_s, "median": statistics.median(cpu_s),
                "argv": sys.argv[1:]}  # fmt: skip
        print(json.dumps(data))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
        return 0
    names = {True: "spawn", False: "forkserver"}
    return _alternate(args.rounds, args.out, "spawn", names, one_start)


if __name__ == "__main__":
    sys.exit(main())
