"""A quantized linear method registered through SGLang's own quantization registry, for
the CPU: int8 weights with per-output-row scales and a **per-tensor dynamic activation
scale** (the largest magnitude over every row of the matmul's input), the scheme of
dynamic per-tensor FP8 (SGLang's ``Fp8LinearMethod`` / ``W8A8Fp8LinearMethod`` without a
static input scale, on ROCm with per-tensor weights; CUDA quantizes those per token) and of
LLM.int8's batch-wide outlier columns, in integer arithmetic.

None of SGLang 0.5.23's activation-quantizing methods runs on this CPU (docs/limitations.md),
so this one stands in for them: it makes relay's path through a quantized module's
``apply`` with a batch-dependent activation scale run for real, in a served model
(test/e2e/test_quantized.py). Opt-in (tests): ``SGLANG_RELAY_CPU_INT8_PT=1`` on relay's
CPU stand-in registers it as ``--quantization`` / ``quant_method`` ``relay_int8_pt``
(the plugin, in every SGLang process). Weights load as SGLang's unquantized linear loads
them and are quantized after loading.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang_relay.runtime.config.modes import STANDIN_QUANTIZATION

CPU_INT8_PT_ENV = "SGLANG_RELAY_CPU_INT8_PT"
# where SGLang 0.5.23 keeps its methods (name -> config class) and its --quantization
# choices; ModelConfig checks a checkpoint's quant_method against the former
REGISTRY_MODULE = "sglang.srt.layers.quantization"
CHOICES_FUNCTION = "sglang.srt.server_args.add_quantization_method_choices"

INT8_MAX = 127.0


def standin_opted_in() -> bool:
    from sglang_relay.runtime.platform import cpu_engine_active

    return cpu_engine_active() and os.environ.get(CPU_INT8_PT_ENV) == "1"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``w`` with one scale per output row: ``w ~= q * scale[:, None]``."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_pertensor_linear(
    x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T`` with ``x`` rounded to int8 under one scale for the whole tensor (its
    largest magnitude over every row: a row's result depends on the other rows), the
    integer products summed in ``q``'s float dtype (exact in float64; in float32 while a
    sum stays below 2**24), rescaled to ``x``'s dtype. ``q``: int8 values, as int8 or as
    a float copy of them."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    acc_dtype = q.dtype if q.is_floating_point() else torch.float64
    a_scale = x2.abs().amax().clamp_min(1e-12).double() / INT8_MAX
    xq = torch.round(x2.double() / a_scale).clamp_(-INT8_MAX, INT8_MAX).to(acc_dtype)
    acc = (xq @ q.to(acc_dtype).t()).double()
    out = (acc * (a_scale * w_scale.double())).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], q.shape[0])


def register() -> None:
    """Add the method to SGLang's registry and ``--quantization`` choices (idempotent)."""
    import importlib

    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.base_config import QuantizationConfig
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    registry = importlib.import_module(REGISTRY_MODULE)
    if STANDIN_QUANTIZATION in registry.QUANTIZATION_METHODS:
        return

    class PerTensorInt8LinearMethod(UnquantizedLinearMethod):
        """SGLang's unquantized weight layout at load, int8 after it (see module doc)."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            q, scale = quantize_rows(layer.weight.data.float())
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            # the int8 values as float32 for the matmul (a CPU has no fast int8 GEMM in
            # torch: _int_mm is 5x slower than this here)
            layer.weight_grid = torch.nn.Parameter(q.float(), requires_grad=False)

        def apply(self, layer, x, bias=None):
            return int8_pertensor_linear(x, layer.weight_grid, layer.weight_scale, bias)

    class PerTensorInt8Config(QuantizationConfig):
        def get_name(self) -> str:
            return STANDIN_QUANTIZATION

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float32, torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> PerTensorInt8Config:
            return cls()

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            return PerTensorInt8LinearMethod() if isinstance(layer, LinearBase) else None

        def get_scaled_act_names(self) -> list[str]:
            return []

    registry.QUANTIZATION_METHODS[STANDIN_QUANTIZATION] = PerTensorInt8Config
    module, _, name = CHOICES_FUNCTION.rpartition(".")
    add_choices = getattr(importlib.import_module(module), name)
    add_choices([STANDIN_QUANTIZATION])
