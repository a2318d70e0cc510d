"""The CPU stand-in for sgl_kernel: importable, and loud when a kernel is actually called."""

from __future__ import annotations

import subprocess
import sys

from sglang_relay.runtime.cpu import SHIM_DIR


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {SHIM_DIR!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_names_import_and_raise_when_called():
    proc = _run(
        "from sgl_kernel import rmsnorm, copy_all_layer_kv_cache_cpu\n"
        "try:\n    rmsnorm(1)\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERR sgl_kernel.rmsnorm was called" in proc.stdout
    assert "needs a GPU" in proc.stdout


def test_submodules_are_absent_so_sglang_takes_its_fallbacks():
    proc = _run("import sgl_kernel.scalar_type")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
