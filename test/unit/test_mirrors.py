"""The start-up check that the SGLang functions relay's layer driver reproduces by hand
are the ones it was verified on (``runtime/sglang/mirrors.py``), against the installed
SGLang's real classes."""

from __future__ import annotations

import json

import pytest
import sglang
from torch import nn

from sglang_relay.runtime.sglang.mirrors import (
    RECORD,
    SHARED,
    check_served_mirrors,
    mirror_problems,
    recorded,
    served_mirrors,
)


def test_the_record_is_the_installed_sglang():
    record = recorded()
    assert mirror_problems(record) == []
    assert json.loads(RECORD.read_text())["sglang"] == sglang.__version__
    # every function the docs table names as mirrored is pinned
    for name in (
        "sglang.srt.models.llama.LlamaDecoderLayer.forward",
        "sglang.srt.models.llama.LlamaModel.forward",
        "sglang.srt.models.qwen2_moe.Qwen2MoeModel.forward",
        "sglang.srt.models.qwen3_moe.Qwen3MoeDecoderLayer.forward",
        "sglang.srt.layers.layer_boundary.prepare._reduce_update_read",
        "sglang.srt.layers.layer_boundary.residual.batch.final_norm",
    ):
        assert name in record


def _bare(cls, **children):
    """An instance of SGLang's class ``cls`` without its ``__init__`` (which needs an
    initialised SGLang process); only its type is read."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for name, child in children.items():
        setattr(obj, name, child)
    return obj


def _llama(layer_cls=None, n=2):
    from sglang.srt.models import llama

    layer_cls = layer_cls or llama.LlamaDecoderLayer
    layers = [
        _bare(layer_cls, self_attn=_bare(llama.LlamaAttention), mlp=_bare(llama.LlamaMLP))
        for _ in range(n)
    ]
    return _bare(llama.LlamaModel, layers=nn.ModuleList(layers))


def test_the_functions_of_a_served_llama_stack():
    got = served_mirrors(_llama())
    llama = "sglang.srt.models.llama."
    assert set(got) == {
        llama + "LlamaModel.forward",
        llama + "LlamaDecoderLayer.forward",
        llama + "LlamaAttention.forward",
        llama + "LlamaAttention.forward_prepare_native",
        llama + "LlamaMLP.forward",
        *SHARED,
    }
    assert len(got) == len(set(got))
    check_served_mirrors(_llama())  # SGLang as released: accepted


def test_a_changed_function_is_refused_with_its_name(monkeypatch):
    from sglang.srt.models import llama

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        return hidden_states  # a release that skips the MLP, say

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", forward)
    with pytest.raises(ValueError) as err:
        check_served_mirrors(_llama())
    msg = str(err.value)
    assert "sglang.srt.models.llama.LlamaDecoderLayer.forward (source changed" in msg
    assert "--no-relay" in msg
    assert "LlamaMLP" not in msg  # only what changed is named


def test_a_layer_class_no_adapter_was_verified_on_is_refused():
    from sglang.srt.models import llama

    class ForkLayer(llama.LlamaDecoderLayer):
        def forward(self, positions, hidden_states, forward_batch, capture_output=None):
            return super().forward(positions, hidden_states, forward_batch, capture_output)

    with pytest.raises(ValueError, match="ForkLayer.forward \\(no adapter was verified on it\\)"):
        check_served_mirrors(_llama(ForkLayer))

    class RenamedLayer(llama.LlamaDecoderLayer):  # inherits SGLang's forward: the same code
        pass

    check_served_mirrors(_llama(RenamedLayer))


def test_the_mlp_block_is_read_under_the_adapters_name():
    from sglang.srt.models import mixtral

    layer = _bare(
        mixtral.MixtralDecoderLayer,
        self_attn=_bare(mixtral.MixtralAttention),
        block_sparse_moe=_bare(mixtral.MixtralMoE),
    )
    model = _bare(mixtral.MixtralModel, layers=nn.ModuleList([layer]))
    got = served_mirrors(model, "block_sparse_moe")
    assert "sglang.srt.models.mixtral.MixtralMoE.forward" in got
    assert mirror_problems(got) == []
