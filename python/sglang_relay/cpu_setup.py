"""``sglang-relay serve`` on a machine without CUDA: the process set-up and the server
defaults the CPU needs. On a GPU machine :func:`activate` does nothing and the defaults leave
the arguments alone. What it does on a CPU-only machine:

* sets ``SGLANG_USE_CPU_ENGINE=1`` (without it ``device="cpu"`` still takes GPU paths)
  and ``SGLANG_RELAY_CPU_STANDIN=1`` (relay's CPU stand-in, :mod:`sglang_relay.runtime.standin`,
  registers its hooks only where it is set);
* puts the stand-in ``sgl_kernel`` package first on ``sys.path`` and ``PYTHONPATH`` so that
  the spawned scheduler and detokenizer processes import it too. The PyPI ``sgl_kernel``
  needs libcuda; the stand-in raises a clear error if a kernel is ever called;
* fills server defaults the CPU needs unless the user set them: ``device=cpu``,
  ``attention_backend=torch_native``, ``disable_cuda_graph``, ``dtype=float32``,
  ``sleep_on_idle`` (an idle scheduler busy-polls a core otherwise) and a bounded KV pool
  (SGLang's default pool would take ~15 GB of RAM);
* for ``sglang-relay serve``, the environment and graph bounds of the shape it serves
  (:func:`serve_defaults`): passive OpenMP waits, a thread binding for more ranks than NUMA
  nodes, a bounded list of captured batch sizes.

Part of the launcher, not of the plug-in: it imports nothing of the runtime's but
:mod:`sglang_relay.runtime.platform` (the stand-in package is named by its folder only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from sglang_relay.runtime.platform import CPU_STANDIN_ENV, cuda_available

# the stand-in sgl_kernel package (runtime/standin/_cpu_shim/sgl_kernel)
SHIM_DIR = str(Path(__file__).parent / "runtime" / "standin" / "_cpu_shim")
DEFAULT_CPU_MAX_TOTAL_TOKENS = 65536


def activate() -> bool:
    """Prepare this process (and the processes it spawns) for CPU serving.

    Must run before anything imports ``sglang.srt``. Returns True if CPU mode is active.
    Idempotent.
    """
    if cuda_available():
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[CPU_STANDIN_ENV] = "1"
    if SHIM_DIR not in sys.path:
        sys.path.insert(0, SHIM_DIR)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SHIM_DIR not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *parts])
    loaded = sys.modules.get("sgl_kernel")
    if loaded is not None and not getattr(loaded, "SGL_RELAY_CPU_SHIM", False):
        raise RuntimeError("sgl_kernel was imported before sglang_relay could set up CPU mode")
    return True


def apply_server_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return ``kwargs`` (ServerArgs fields) with CPU defaults filled where unset."""
    if cuda_available():
        return kwargs
    out = dict(kwargs)
    out.setdefault("device", "cpu")
    out.setdefault("attention_backend", "torch_native")
    out.setdefault("disable_cuda_graph", True)
    out.setdefault("dtype", "float32")
    if out.get("max_total_tokens") is None and out.get("mem_fraction_static") is None:
        out["max_total_tokens"] = DEFAULT_CPU_MAX_TOTAL_TOKENS
    return out


# CPU graph mode (--enable-torch-compile) captures every batch size SGLang lists by default
# (24 on 0.5.23, ~30 s each on a 2-core VM: 12 minutes before serving); these bound it.
CPU_GRAPH_BATCH_SIZES = ("1", "2", "4")


def numa_node_count() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


def usable_cpus() -> list[int]:
    """The cpus this process may run on (all of them where affinity is not reported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def threads_bind(ranks: int, cpus: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``cpus``: contiguous, equal
    groups (``"0,1|2,3"``); with more ranks than cpus, one cpu each, round robin."""
    if ranks > len(cpus):
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    per, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for r in range(ranks):
        size = per + (1 if r < extra else 0)
        groups.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return "|".join(groups)


def serve_defaults(
    ranks: int, torch_compile: bool, user_flags: set[str], environ: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """Flags and environment a CPU server needs for the shape it serves (``ranks`` = tp x dp
    x pp processes), where the user set none of them (``user_flags``: the flags given,
    ``environ``: the environment). Returns (flags to add, environment to add).

    * ``OMP_WAIT_POLICY=PASSIVE`` (unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is
      set): OpenMP's default spin-wait has a rank's idle threads burn a core another
      process (or rank) needs. Measured on 2 cores, one rank of the embedded model,
      greedy decode tokens/s at batch 1 / 4 (``benchmark/omp_wait.py``, docs/results.md):
      idle 10.3 / 22.4 spinning vs 8.4 / 15.8 passive; beside one busy process 1.3 / 1.0 spinning vs
      8.8 / 20.6 passive (a spin count of 10,000: 10.3 / 23.8 idle, 6.1 / 7.3 busy). DP 2
      beside one busy process decoded at 0.44 tokens/s spinning. A server that owns its
      cores can set ``OMP_WAIT_POLICY=ACTIVE`` for the idle-machine figures.
    * ``SGLANG_CPU_OMP_THREADS_BIND`` when there are more ranks than NUMA nodes (SGLang
      asserts at start-up otherwise): the cores this process may use, split evenly.
    * with ``--enable-torch-compile``, the captured batch sizes bounded to
      :data:`CPU_GRAPH_BATCH_SIZES` (larger batches decode eagerly).
    """
    if cuda_available():
        return [], {}
    env: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in environ and ranks > numa_node_count():
        env["SGLANG_CPU_OMP_THREADS_BIND"] = threads_bind(ranks, usable_cpus())
    flags: list[str] = []
    bounds = {"--cuda-graph-bs-decode", "--torch-compile-max-bs", "--cuda-graph-max-bs-decode"}
    if torch_compile and not (bounds & user_flags):
        flags += ["--cuda-graph-bs-decode", *CPU_GRAPH_BATCH_SIZES]
        flags += ["--torch-compile-max-bs", max(CPU_GRAPH_BATCH_SIZES, key=int)]
    return flags, env
