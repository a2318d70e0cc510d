"""The per-tensor int8 stand-in method (runtime/standin/quant_standin.py) and the start-up probe
that tells a batch-coupled linear method from a row-independent one
(``runtime/sglang/model.py: linear_rows``), on SGLang's own ``ReplicatedLinear``."""

from __future__ import annotations

import torch

from sglang_relay.runtime.sglang.model import linear_rows
from sglang_relay.runtime.standin.quant_standin import (
    STANDIN_QUANTIZATION,
    int8_pertensor_linear,
    quantize_rows,
    register,
)


def _int8(values: list[float], scale: float) -> list[int]:
    return [max(-127, min(127, round(v / scale))) for v in values]


def _exact(x, w, bias):
    """The stand-in's result by hand: Python integers for every product and sum."""
    a = max(abs(v) for row in x.tolist() for v in row) / 127.0
    xq = [_int8(row, a) for row in x.tolist()]
    ws = [max(abs(v) for v in row) / 127.0 for row in w.tolist()]
    wq = [_int8(row, s) for row, s in zip(w.tolist(), ws, strict=True)]
    out = []
    for xr in xq:
        dots = [sum(p * q for p, q in zip(xr, wr, strict=True)) for wr in wq]
        out.append([d * a * s + b for d, s, b in zip(dots, ws, bias, strict=True)])
    return torch.tensor(out, dtype=torch.float64)


def test_int8_pertensor_linear_is_integer_arithmetic_under_one_scale():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g), torch.randn(7)
    x[0] *= 8.0  # the tensor's largest magnitude is in row 0
    q, scale = quantize_rows(w.double())
    got = int8_pertensor_linear(x.double(), q, scale, bias.double())
    assert torch.allclose(
        got, _exact(x.double(), w.double(), bias.tolist()), rtol=1e-12, atol=1e-12
    )
    # one scale for the tensor: a row's result depends on the other rows
    alone = int8_pertensor_linear(x[1:].double(), q, scale, bias.double())
    assert not torch.allclose(alone, got[1:], atol=1e-6)


class _Model(torch.nn.Module):
    def __init__(self, proj):
        super().__init__()
        attn = torch.nn.Module()
        attn.qkv_proj = proj
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.layers = torch.nn.ModuleList([layer])


def _linear(quant=None):
    from sglang.srt.layers.linear import ReplicatedLinear

    lin = ReplicatedLinear(64, 32, bias=False, params_dtype=torch.float32, quant_config=quant)
    lin.weight.data.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    lin.quant_method.process_weights_after_loading(lin)
    return lin


def test_the_probe_tells_a_batch_coupled_method_from_a_row_independent_one():
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()  # idempotent
    config_cls = get_quantization_config(STANDIN_QUANTIZATION)
    assert config_cls is QUANTIZATION_METHODS[STANDIN_QUANTIZATION]
    standin = _linear(config_cls())
    assert type(standin.quant_method).__name__ == "PerTensorInt8LinearMethod"
    assert standin.weight.dtype == torch.int8
    assert linear_rows(_Model(standin)) == "batch-coupled"
    assert linear_rows(_Model(_linear())) == "independent"  # SGLang's unquantized method


def test_a_per_row_scale_is_row_independent():
    """The probe's control admits what a batched matmul's rounding does, not a
    quantization step: the same integer method with one scale per row, in one batched
    matmul, is independent."""

    class PerRow:
        def apply(self, layer, x, bias=None):
            scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
            xq = torch.round(x / scale).clamp(-127, 127)
            return (xq @ layer.q.float().t()) * scale * layer.s

    lin = _linear()
    lin.q, lin.s = quantize_rows(lin.weight.data)
    lin.quant_method = PerRow()
    assert linear_rows(_Model(lin)) == "independent"
