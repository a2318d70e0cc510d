"""The Triton attention kernel lowers to Triton IR for a CUDA target: the code generator's
type checks (a variable may not change type in a branch, ...) run there and not under the
interpreter the other kernel tests use on a CPU. No GPU is needed to reach Triton IR; a
kernel that fails here would fail to compile on every GPU (it did once: ``lo`` int32 before
a window branch, int64 inside it). Runs in a subprocess without ``TRITON_INTERPRET`` (the
interpreter patches ``triton.language`` for the whole process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_LOWER = r"""
import sys
try:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
except ImportError as e:
    print("SKIP", e)
    sys.exit(0)
from sglang_relay_kernels.attention import _positional_attention_kernel as kernel

types = {
    "q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16",
    "q_pos_ptr": "*i64", "tile_row_ptr": "*i64", "tile_len_ptr": "*i64", "tile_kv_ptr": "*i64",
    "kv_indices_ptr": "*i64", "sink_ptr": "*fp32", "scale": "fp32", "window": "i32",
}  # the strides: int64
target = GPUTarget("cuda", 80, 32)
backend = make_backend(target)
options = backend.parse_options({})
for has_sink in (False, True):
    for upcast in (False, True):
        consts = {"GROUP": 2, "D": 64, "DV": 64, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64,
                  "BLOCK_DV": 64, "PRECISION": None, "UPCAST": upcast, "HAS_SINK": has_sink}
        sig = {n: "constexpr" if n in consts else types.get(n, "i64") for n in kernel.arg_names}
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ASTSource(kernel, sig, consts).make_ir(
            target, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context,
        )
        assert "tt.func" in str(module)
print("LOWERED")
"""


def test_positional_attention_kernel_lowers_to_triton_ir():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _LOWER], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "LOWERED" in proc.stdout, proc.stderr[-2000:]
