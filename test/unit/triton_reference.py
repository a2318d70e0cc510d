"""SGLang's own Triton kernels as references for the CPU stand-in's ops: a script that
defines ``RUN`` (kind of case -> a function launching the kernel on one case) runs under
the Triton interpreter in one subprocess (``TRITON_INTERPRET=1`` must be set before triton
loads; relay's stand-in ``sgl_kernel`` goes first on its path, so SGLang's kernel modules
import without CUDA), on CPU tensors the kernels mutate in place."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sglang_relay.cpu_setup import SHIM_DIR

_RUN_ALL = r"""
cases = torch.load(sys.argv[1])
for kind, items in cases.items():
    for c in items:
        RUN[kind](c)
torch.save(cases, sys.argv[2])
print("OK")
"""


def triton_outputs(kernels: str, cases: dict, folder: Path) -> tuple[Callable[[], dict], dict]:
    """(a fresh copy of ``cases`` on each call, the cases as the kernels left them)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: no reference kernels to run")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(cases, inputs)
    env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", kernels + _RUN_ALL, str(inputs), str(outputs), SHIM_DIR],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    return lambda: torch.load(inputs), torch.load(outputs)
