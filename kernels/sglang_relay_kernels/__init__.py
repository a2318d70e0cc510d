"""GPU kernels of the relay extend, each beside its pure-torch reference.

The public functions pick the Triton kernel for CUDA tensors and the torch reference
otherwise; ``SGLANG_RELAY_KERNELS=torch`` forces the reference everywhere and
``SGLANG_RELAY_KERNELS=triton`` forces Triton (on CPU tensors that needs
``TRITON_INTERPRET=1``: how the tests run the kernels without a GPU).
"""

from __future__ import annotations

import os

import torch

from sglang_relay.core.rope import FP8_DTYPES
from sglang_relay_kernels import rows, splice


def kernel_family(device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: which implementation the functions below use on ``device``."""
    choice = os.environ.get("SGLANG_RELAY_KERNELS", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"SGLANG_RELAY_KERNELS must be auto, torch or triton; got {choice!r}")
    if choice == "torch" or splice.triton is None:
        return "torch"
    return "triton" if choice == "triton" or device.type == "cuda" else "torch"


def use_triton(x: torch.Tensor) -> bool:
    return kernel_family(x.device) == "triton"


def pick_extend_attention(
    server_backend: str | None,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
    *,
    latent: bool = False,
) -> str:
    """Which attention the relay extend uses on ``device``: ``"flashinfer"`` when the
    server's backend is FlashInfer (and the package imports), ``"triton"`` when it is
    Triton, else ``"torch"`` (the pure-torch positional attention: the CPU path and the
    semantics the others are tested against). ``SGLANG_RELAY_KERNELS`` forces either
    kernel family; forced ``triton`` on a CPU runs the kernels in Triton's interpreter
    (``TRITON_INTERPRET=1``), which is how the tests run them inside a real server. An FP8
    KV cache (``kv_dtype``) under FlashInfer takes the Triton kernel: its FP8 path (FP8
    elements, fp32 products) is the one the tests run; relay's FlashInfer glue plans FP8
    caches nowhere this project can test. MLA latent rows (``latent``: one shared key head of
    ``kv_lora_rank + rope`` values, 576 in DeepSeek-V3) take the torch path unless forced:
    relay's Triton kernel would reload the shared row for every query head in tiles wider
    than its GPU configuration was sized for, and its FlashInfer glue plans no such heads."""
    forced = os.environ.get("SGLANG_RELAY_KERNELS")
    if forced == "torch":
        return "torch"
    if forced == "triton" and splice.triton is not None:
        return "triton"
    if device.type != "cuda" or latent:
        return "torch"
    if server_backend == "triton" and splice.triton is not None:
        return "triton"
    if server_backend == "flashinfer" and kv_dtype in FP8_DTYPES and splice.triton is not None:
        return "triton"
    if server_backend != "flashinfer":
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "torch"
    return "flashinfer"


def splice_rerotate(k_buffers, v_buffers, src, dst, cos, sin, *, is_neox: bool = True) -> None:
    """Copy span KV ``src -> dst`` in every layer, keys rotated (see :mod:`.splice`). FP8
    pools always take the torch path: no Triton float8 store is verified here (Triton's CPU
    interpreter drops mantissa bits converting to float8)."""
    first = k_buffers if isinstance(k_buffers, torch.Tensor) else k_buffers[0]
    triton_ok = use_triton(first) and first.dtype not in FP8_DTYPES
    impl = splice.splice_rerotate_triton if triton_ok else splice.splice_rerotate_ref
    impl(k_buffers, v_buffers, src, dst, cos, sin, is_neox=is_neox)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return rows.gather_rows_triton(x, idx) if use_triton(x) else rows.gather_rows_ref(x, idx)


def scatter_rows(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    if use_triton(out):
        rows.scatter_rows_triton(out, idx, values)
    else:
        rows.scatter_rows_ref(out, idx, values)
