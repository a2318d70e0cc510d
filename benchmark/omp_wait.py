"""OpenMP wait policy of a one-rank CPU server: greedy decode tokens/s at batch 1 and 4,
idle and beside one busy process (a Python spin loop), per policy.

    python benchmark/omp_wait.py [--policies default,PASSIVE,GOMP_SPINCOUNT=10000]

``default`` is OpenMP's own (libgomp: spin 300,000 iterations, then sleep), passed as
``GOMP_SPINCOUNT=300000`` because ``serve`` sets ``OMP_WAIT_POLICY=PASSIVE`` when neither
is given (``cpu_setup.py: serve_defaults``). Results: docs/results.md ("OpenMP waits").
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from sglang_relay.bench.decode import _round
from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess


def env_for(policy: str) -> dict[str, str]:
    if policy == "default":  # OpenMP's own default (a spin count, then sleep)
        return {"GOMP_SPINCOUNT": "300000"}  # libgomp's documented default; serve keeps it
    key, _, value = policy.partition("=")
    return {key: value} if value else {"OMP_WAIT_POLICY": key}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--policies", default="default,PASSIVE,GOMP_SPINCOUNT=10000")
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    model = str(ensure_model())
    print("| machine | policy | batch 1 tok/s | batch 4 tok/s |\n|---|---|---|---|")
    for busy in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for policy in args.policies.split(","):
                with ServerProcess(["--model-path", model], env=env_for(policy)) as server:
                    _round(server.url, 1, 8, "warm")
                    tps = {}
                    for b in (1, 4):
                        runs = [_round(server.url, b, args.tokens, f"{policy}{busy}{r}")
                                for r in range(2)]  # fmt: skip
                        tps[b] = sum(runs) / len(runs)
                print(f"| {'busy' if busy else 'idle'} | {policy} | {tps[1]:.1f} | {tps[4]:.1f} |",
                      flush=True)  # fmt: skip
        finally:
            if hog is not None:
                hog.kill()


if __name__ == "__main__":
    main()
