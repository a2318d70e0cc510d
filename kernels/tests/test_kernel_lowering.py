"""Relay's Triton kernels (attention, splice, row copies) lower to Triton IR for a CUDA
target: the code generator's type checks (a variable may not change type in a branch, ...)
run there and not under the interpreter the other kernel tests use on a CPU. No GPU is
needed to reach Triton IR; a kernel that fails here would fail to compile on every GPU (the
attention kernel did once: ``lo`` int32 before a window branch, int64 inside it). Runs in a
subprocess without ``TRITON_INTERPRET`` (the interpreter patches ``triton.language`` for
the whole process)."""

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
from sglang_relay_kernels.rows import _copy_rows_kernel
from sglang_relay_kernels.splice import _splice_rerotate_kernel

target = GPUTarget("cuda", 80, 32)
backend = make_backend(target)
options = backend.parse_options({})


def lower(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i64") for n in fn.arg_names}
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(fn, sig, consts).make_ir(
        target, options, backend.get_codegen_implementation(options),
        backend.get_module_map(), context,
    )
    assert "tt.func" in str(module)


for neox in (False, True):  # the splice: fp16 pools, int64 slots, fp32 cos / sin
    lower(_splice_rerotate_kernel,
          {"k_ptr": "*fp16", "v_ptr": "*fp16", "src_ptr": "*i64", "dst_ptr": "*i64",
           "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
          {"HALF": 32, "D": 64, "DV": 64, "IS_NEOX": neox, "BLOCK_HALF": 32, "BLOCK_D": 64,
           "BLOCK_DV": 64})
for src_idx in (False, True):  # row gather / scatter
    for dst_idx in (False, True):
        lower(_copy_rows_kernel,
              {"src_ptr": "*fp16", "dst_ptr": "*fp16", "src_idx_ptr": "*i64",
               "dst_idx_ptr": "*i64", "W": "i32"},
              {"HAS_SRC_IDX": src_idx, "HAS_DST_IDX": dst_idx, "BLOCK": 128})

types = {
    "q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16",
    "q_pos_ptr": "*i64", "tile_row_ptr": "*i64", "tile_len_ptr": "*i64", "tile_kv_ptr": "*i64",
    "kv_indices_ptr": "*i64", "sink_ptr": "*fp32", "scale": "fp32", "window": "i32",
}  # the strides: int64
for has_sink in (False, True):
    for upcast in (False, True):
        lower(kernel, types,
              {"GROUP": 2, "D": 64, "DV": 64, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64,
               "BLOCK_DV": 64, "PRECISION": None, "UPCAST": upcast, "HAS_SINK": has_sink})
print("LOWERED")
"""


def test_the_kernels_lower_to_triton_ir():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _LOWER], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "LOWERED" in proc.stdout, proc.stderr[-2000:]
