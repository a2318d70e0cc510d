"""What a CPU relay server's start costs, its children spawned (SGLang's way) or forked from
the stand-in's preloaded forkserver (runtime/cpu.py): time to a healthy server and the CPU
seconds of every process of the server until then, alternating the two, servers one at a
time. CI starts ~30 servers on 2 cores, so the CPU seconds are what CI time pays.

    python research/studies/start_cost.py --rounds 4 --out research/studies/data/start_cost.json

``--plugins``: instead, what loading SGLang's plug-ins (relay's hooks applied) costs a process
that imported the forkserver's SGLang modules, i.e. what each child paid before the
forkserver loaded them once for all (``runtime/forkserver_preload.py``), one fresh
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
from sglang_relay.runtime.cpu import CPU_SPAWN_ENV
from sglang_relay.runtime.process import ServerProcess


def one_start(spawn: bool) -> dict:
    env = {CPU_SPAWN_ENV: "1" if spawn else "0"}
    t0 = time.monotonic()
    seen: dict[int, psutil.Process] = {}
    args = ["--model-path", str(ensure_model(quiet=True)), "--max-total-tokens", "8192"]
    server = ServerProcess(args, env=env)
    server.start(timeout=600)
    ready = time.monotonic() - t0
    root = psutil.Process(server.proc.pid)
    for p in [root, *root.children(recursive=True)]:
        seen[p.pid] = p
    cpu = sum(sum(p.cpu_times()[:2]) for p in seen.values())
    text = requests.post(server.url + "/generate", timeout=120, json={
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }).json()["text"]  # fmt: skip
    server.stop()
    return {"spawn": spawn, "ready_s": round(ready, 1), "cpu_s": round(cpu, 1), "text": text}


PLUGIN_LOAD = """
import time
from sglang_relay.runtime import cpu
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plugins", action="store_true", help="the plug-in load's CPU seconds")
    args = ap.parse_args()
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
    runs = []
    for r in range(args.rounds):
        for spawn in (True, False) if r % 2 == 0 else (False, True):
            runs.append(one_start(spawn))
            print(runs[-1], flush=True)
    summary = {}
    for spawn in (True, False):
        mine = [x for x in runs if x["spawn"] is spawn]
        summary["spawn" if spawn else "forkserver"] = {
            k: statistics.median(x[k] for x in mine) for k in ("ready_s", "cpu_s")
        }
    print(json.dumps(summary))
    assert len({x["text"] for x in runs}) == 1, "the two ways answered differently"
    if args.out:
        data = {"machine": f"{os.cpu_count()} cores", "rounds": args.rounds, "runs": runs,
                "median": summary, "argv": sys.argv[1:]}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
