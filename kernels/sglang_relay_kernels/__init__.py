"""GPU kernels of the relay extend, each beside its pure-torch reference.

The public functions pick the Triton kernel for CUDA tensors and the torch reference
otherwise; ``SGLANG_RELAY_KERNELS=torch`` forces the reference everywhere and
``SGLANG_RELAY_KERNELS=triton`` forces Triton (on CPU tensors that needs
``TRITON_INTERPRET=1``: how the tests run the kernels without a GPU).
"""

from __future__ import annotations

import os

import torch

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


def pick_extend_attention(server_backend: str | None, device: torch.device) -> str:
    """Which attention the relay extend uses on ``device``: ``"flashinfer"`` when the
    server's backend is FlashInfer (and the package imports), ``"triton"`` when it is
    Triton, else ``"torch"`` (the pure-torch positional attention: the CPU path and the
    semantics the others are tested against). ``SGLANG_RELAY_KERNELS`` forces either
    kernel family; forced ``triton`` on a CPU runs the kernels in Triton's interpreter
    (``TRITON_INTERPRET=1``), which is how the tests run them inside a real server."""
    forced = os.environ.get("SGLANG_RELAY_KERNELS")
    if forced == "torch":
        return "torch"
    if forced == "triton" and splice.triton is not None:
        return "triton"
    if device.type != "cuda":
        return "torch"
    if server_backend == "triton" and splice.triton is not None:
        return "triton"
    if server_backend != "flashinfer":
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "torch"
    return "flashinfer"


def splice_rerotate(k_buffers, v_buffers, src, dst, cos, sin, *, is_neox: bool = True) -> None:
    """Copy span KV ``src -> dst`` in every layer, keys rotated (see :mod:`.splice`)."""
    first = k_buffers if isinstance(k_buffers, torch.Tensor) else k_buffers[0]
    impl = splice.splice_rerotate_triton if use_triton(first) else splice.splice_rerotate_ref
    impl(k_buffers, v_buffers, src, dst, cos, sin, is_neox=is_neox)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return rows.gather_rows_triton(x, idx) if use_triton(x) else rows.gather_rows_ref(x, idx)


def scatter_rows(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    if use_triton(out):
        rows.scatter_rows_triton(out, idx, values)
    else:
        rows.scatter_rows_ref(out, idx, values)
