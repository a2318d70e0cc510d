"""Running the real SGLang runtime on a machine without CUDA.

Everything CPU-specific lives here and is active only where ``torch.cuda`` is unavailable;
on a GPU machine :func:`activate` does nothing and :func:`apply_server_defaults` leaves the
arguments alone. What it does on a CPU-only machine:

* sets ``SGLANG_USE_CPU_ENGINE=1`` (without it ``device="cpu"`` still takes GPU paths);
* puts a stand-in ``sgl_kernel`` package first on ``sys.path`` and ``PYTHONPATH`` so that
  the spawned scheduler and detokenizer processes import it too. The PyPI ``sgl_kernel``
  needs libcuda; the stand-in raises a clear error if a kernel is ever called;
* fills server defaults the CPU needs unless the user set them: ``device=cpu``,
  ``attention_backend=torch_native``, ``disable_cuda_graph``, ``dtype=float32``,
  ``sleep_on_idle`` (an idle scheduler busy-polls a core otherwise) and a bounded KV pool
  (SGLang's default pool would take ~15 GB of RAM).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

SHIM_DIR = str(Path(__file__).with_name("_cpu_shim"))
DEFAULT_CPU_MAX_TOTAL_TOKENS = 65536


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    if os.environ.get("SGLANG_RELAY_FORCE_CPU") == "1":
        return False
    import torch

    return bool(torch.cuda.is_available())


def activate() -> bool:
    """Prepare this process (and the processes it spawns) for CPU serving.

    Must run before anything imports ``sglang.srt``. Returns True if CPU mode is active.
    Idempotent.
    """
    if cuda_available():
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
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


def cpu_engine_active() -> bool:
    """Whether this process serves on the CPU (set by :func:`activate`, inherited by the
    processes SGLang spawns)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def model_parallel_group_without_pynccl(original, *args, **kwargs):
    """Around-hook of ``init_model_parallel_group`` on the CPU: SGLang 0.5.23 gives every
    in-tree platform a PyNccl communicator when the caller does not say otherwise, and
    PyNccl needs a CUDA device, so ``--tp 2`` on the CPU fails before loading the model.
    Without it the groups all-reduce through torch.distributed (gloo on the CPU)."""
    kwargs["use_pynccl"] = False
    return original(*args, **kwargs)
