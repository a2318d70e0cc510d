"""Architecture adapters: the reference executor against Hugging Face forwards of every
adapted architecture (random weights), and the start-up anatomy check against module trees
that differ from what an adapter drives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_relay.bench.models import ARCHITECTURES, random_hf_model
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference import (
    RefModel,
    SpanOccurrence,
    exact_prefill,
    generate,
    relay_prefill,
)
from sglang_relay.runtime.forward.layer_driver import LayerDriver
from sglang_relay.runtime.models.anatomy import (
    BASE_ATTENTION,
    DENSE_MLP,
    SHARED_EXPERT_MLP,
    SPARSE_MLP,
    anatomy_problems,
    mlp_output,
    mlp_takes_batch,
    split_qkv,
)
from sglang_relay.runtime.models.registry import ANATOMIES, anatomy_of
from sglang_relay.runtime.sglang.model import SUPPORTED_ROPE

FULL = RelayConfig(l_start=0, l_det=0, l_end=-1, top_ratio=1.0, l_suf=0)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_reference_executor_is_the_hf_forward_of_each_architecture(arch):
    torch.manual_seed(1)
    ref = RefModel(random_hf_model(arch, num_hidden_layers=3))
    ids = torch.randint(100, 40000, (48,)).tolist()
    ours = exact_prefill(ref, ids[:-12], forced=ids[-12:-1])
    with torch.no_grad():
        theirs = ref.model(torch.tensor([ids[:-1]])).logits[0].float()
    torch.testing.assert_close(ours.logits, theirs[-12:], atol=1e-4, rtol=0)
    # and its relay oracle: every span token recomputed in every layer is exact
    (rec,) = generate(ref, [ids[:10]], 24)
    span = rec.span_tokens
    prompt = ids[20:30] + span + ids[30:36]
    occ = SpanOccurrence(10, rec, 0, len(span))
    relayed = relay_prefill(ref, prompt, [occ], FULL)
    torch.testing.assert_close(relayed.logits, exact_prefill(ref, prompt).logits, atol=1e-4,
                               rtol=0)  # fmt: skip


def test_each_adapter_file_registers_its_architectures():
    """One file per architecture in runtime/models/adapters: the registry is exactly what the
    files define, each file at least one adapter, no architecture twice, and the package's
    explicit list names every file in the folder."""
    import pkgutil
    from importlib import import_module

    from sglang_relay.runtime.models import adapters

    names = [m.name for m in pkgutil.iter_modules(adapters.__path__)]
    defined = [a for n in names for a in import_module(f"{adapters.__name__}.{n}").ADAPTERS]
    assert all(import_module(f"{adapters.__name__}.{n}").ADAPTERS for n in names)
    assert sorted(a.architecture for a in defined) == sorted(ANATOMIES)
    assert len(names) >= 8 and len(ANATOMIES) == len(defined)
    assert [m.__name__.rpartition(".")[2] for m in adapters.MODULES] == sorted(names)


def test_every_random_model_has_an_adapter():
    for name, _ in ARCHITECTURES.values():
        assert f"{name}ForCausalLM" in ANATOMIES


# ---- the start-up check, on module trees named like SGLang's (its real modules need an
# initialised SGLang process; the e2e tests serve them)


class Rope(nn.Module):
    def __init__(self, head_size=64, rotary_dim=64):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, True


Rope.__name__ = "RotaryEmbedding"


class Radix(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.logit_cap, self.sliding_window_size = 0.0, -1
        self.k_scale = self.v_scale = None
        self.qk_head_dim = self.v_head_dim = 64
        self.tp_q_head_num = self.tp_k_head_num = self.tp_v_head_num = 1
        self.scaling, self.layer_id = 0.125, 0
        self.__dict__.update(kw)


class Attn(nn.Module):
    def __init__(self, children=BASE_ATTENTION, rope=None, radix=None):
        super().__init__()
        for name in sorted(children):
            setattr(self, name, nn.Identity())
        self.rotary_emb = rope or Rope()
        self.attn = radix or Radix()

    def forward_prepare_native(self, positions, x):  # pragma: no cover - not called
        raise AssertionError


class Layer(nn.Module):
    def __init__(self, attn, mlp=DENSE_MLP):
        super().__init__()
        self.input_layernorm = nn.Identity()
        self.self_attn = attn
        self.post_attention_layernorm = nn.Identity()
        self.mlp = nn.Module()
        for name in sorted(mlp):
            setattr(self.mlp, name, nn.Identity())


def stack(*attns, mlp=DENSE_MLP):
    model = nn.Module()
    model.embed_tokens, model.norm = nn.Identity(), nn.Identity()
    model.layers = nn.ModuleList(Layer(a, mlp) for a in attns)
    return model


def _shifted_rope():
    rope = Rope()
    rope.position_start = -8192  # e.g. a video M-RoPE's table
    return rope


def problems(arch, model):
    return anatomy_problems(anatomy_of(arch), model, SUPPORTED_ROPE)


def test_a_model_the_adapter_drives_passes():
    assert problems("LlamaForCausalLM", stack(Attn(), Attn())) == []
    qwen3 = BASE_ATTENTION | {"q_norm", "k_norm"}
    assert problems("Qwen3ForCausalLM", stack(Attn(qwen3))) == []


class MoeAttn(Attn):
    """Qwen3-MoE's block: its prepare takes the forward batch (and may store KV itself)."""

    def forward_prepare_native(self, positions, x, forward_batch):  # pragma: no cover
        raise AssertionError


def test_a_sparse_block_is_run_only_by_the_moe_adapters():
    qwen3 = MoeAttn(BASE_ATTENTION | {"q_norm", "k_norm"})
    assert problems("Qwen3MoeForCausalLM", stack(qwen3, mlp=SPARSE_MLP)) == []
    # a MoE model may keep dense layers (mlp_only_layers)
    assert problems("Qwen3MoeForCausalLM", stack(qwen3, mlp=DENSE_MLP)) == []
    # a block whose prepare has the native contract under the split adapter: refused
    native = Attn(BASE_ATTENTION | {"q_norm", "k_norm"})
    (out,) = problems("Qwen3MoeForCausalLM", stack(native, mlp=SPARSE_MLP))
    assert "expects no forward_prepare_native" in out
    # a dense adapter on a MoE layer is refused
    (out,) = problems("Qwen3ForCausalLM", stack(native, mlp=SPARSE_MLP))
    assert "layers[0].mlp" in out and "['experts', 'gate', 'topk']" in out
    # and a Qwen3 block without the native contract under the native adapter
    assert "expects a forward_prepare_native" in problems("Qwen3ForCausalLM", stack(qwen3))[0]
    # a shared expert is run only by an adapter that names it (Qwen2-MoE's), not dropped
    (out,) = problems("Qwen3MoeForCausalLM", stack(qwen3, mlp=SHARED_EXPERT_MLP))
    assert "['shared_expert', 'shared_expert_gate']" in out
    split = MoeAttn(BASE_ATTENTION)
    assert problems("Qwen2MoeForCausalLM", stack(split, mlp=SHARED_EXPERT_MLP)) == []


def test_the_mlp_block_is_found_under_its_adapters_name():
    split = MoeAttn(BASE_ATTENTION)
    model = stack(split, mlp=SPARSE_MLP)
    (out,) = problems("MixtralForCausalLM", model)  # Mixtral's block is block_sparse_moe
    assert "lacks ['block_sparse_moe']" in out and "['mlp']" in out
    for layer in model.layers:
        layer.block_sparse_moe = layer.mlp
        del layer.mlp
    assert problems("MixtralForCausalLM", model) == []
    # the layer driver, built from the Mixtral adapter, runs that block (without a forward
    # batch: Mixtral's block takes none)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Identity()
            self.experts.reduce_results = True

        def forward(self, x):
            return 2 * x

    model.layers[0].block_sparse_moe = Twice()
    drv = LayerDriver(model, None, anatomy_of("MixtralForCausalLM"))
    x = torch.ones(2, 3)
    torch.testing.assert_close(drv.mlp(0, x, fb=object()), 2 * x, atol=0, rtol=0)


def test_the_loop_sums_a_blocks_partials_unless_the_block_reduced_them():
    class Block(nn.Module):
        def __init__(self, reduce_results=None):
            super().__init__()
            self.experts = nn.Identity()
            self.experts.reduce_results = False
            if reduce_results is not None:
                self.reduce_results = reduce_results

        def forward(self, x):
            return x

    for partial in (Block(), Block(reduce_results=False)):  # the layer boundary reduces
        assert mlp_output(partial) is partial.experts
    reduced = Block(reduce_results=True)  # the block all-reduced its own output
    assert mlp_output(reduced) is reduced
    dense = nn.Module()
    dense.down_proj = nn.Identity()
    assert mlp_output(dense) is dense.down_proj
    # a block whose forward takes no forward batch (Mixtral's) is called without one
    assert not mlp_takes_batch(Block())

    class Dense(nn.Module):
        def forward(self, x, forward_batch=None, use_reduce_scatter=False):
            return x

    assert mlp_takes_batch(Dense())


def test_qk_norms_under_the_llama_adapter_are_refused_not_dropped():
    # the old check tested names only: a Qwen3 layer passed it and q_norm/k_norm were skipped
    out = problems("LlamaForCausalLM", stack(Attn(BASE_ATTENTION | {"q_norm", "k_norm"})))
    assert len(out) == 1 and "['k_norm', 'q_norm']" in out[0]
    # and a Qwen3 adapter on a layer without them is refused too
    assert problems("Qwen3ForCausalLM", stack(Attn()))


@pytest.mark.parametrize(
    "attn, words",
    [
        (Attn(radix=Radix(logit_cap=30.0)), "logit cap"),
        (Attn(radix=Radix(sliding_window_size=4096)), "sliding-window"),
        (Attn(radix=Radix(k_scale=torch.tensor(0.5))), "scaled (quantized) KV"),
        (Attn(rope=Rope(rotary_dim=33)), "rotary_dim 33 of head size 64"),
        (Attn(rope=Rope(rotary_dim=128)), "rotary_dim 128 of head size 64"),
        (Attn(rope=_shifted_rope()), "positions start at -8192"),
        (Attn(radix=Radix(v_head_dim=32)), "v head dim"),
    ],
)
def test_what_the_loop_would_not_run_is_refused_in_any_layer(attn, words):
    out = problems("LlamaForCausalLM", stack(Attn(), attn))
    assert len(out) == 1 and out[0].startswith("layers[1]") and words in out[0]


def test_glm_q_k_norms_are_all_or_none():
    """GLM-4.x serves with (GLM-4.5 to 4.7) and without (4.5-Air) per-head q/k norms; one
    without the other is a layer the split preparation would run wrongly: refused."""

    def glm(children=BASE_ATTENTION, mlp=SPARSE_MLP | {"shared_experts"}):
        attn = Attn(children)
        attn.forward_prepare_native = None  # GLM's prepare takes the forward batch
        return problems("Glm4MoeForCausalLM", stack(attn, mlp=mlp))

    assert glm(BASE_ATTENTION | {"q_norm", "k_norm"}) == []
    assert glm() == []
    assert glm(mlp=SPARSE_MLP) == []  # the shared expert fused into the experts (GPU)
    (out,) = glm(BASE_ATTENTION | {"q_norm"})
    assert "lacks ['k_norm']" in out and "with or without ['k_norm', 'q_norm']" in out


def test_minimax_q_k_norm_runs_the_blocks_own_norm_across_heads():
    """MiniMax-M2's q/k norm is one RMS over all heads (``qk_norm_impl``), not SGLang's
    per-head ``apply_qk_norm``: a block with the norms but no such implementation is refused,
    and the split preparation calls it on q and k before RoPE."""

    class Block(Attn):
        forward_prepare_native = None  # MiniMax's prepare takes the forward batch

    def minimax(block):
        model = stack(block, mlp=SPARSE_MLP)
        for layer in model.layers:  # the block lives under Mixtral's name
            layer.block_sparse_moe = layer.mlp
            del layer.mlp
        return problems("MiniMaxM2ForCausalLM", model)

    block = Block(BASE_ATTENTION | {"q_norm", "k_norm"})
    (out,) = minimax(block)
    assert "no qk_norm_impl" in out
    calls = []

    class Impl:
        def forward(self, q, k):
            calls.append((q.shape, k.shape))
            return 2 * q, 3 * k

    block.qk_norm_impl = Impl()
    assert minimax(block) == []
    prepared = SimpleNamespace(
        qkv_proj=lambda x: (torch.cat((x, x, x), -1), None), q_size=4, kv_size=4,
        q_norm=None, qk_norm_impl=Impl(),
        rotary_emb=lambda positions, q, k: (q + positions, k + positions),
    )  # fmt: skip
    q, k, v = split_qkv(prepared, 1.0, torch.ones(1, 4), across_heads=True)
    assert calls == [((1, 4), (1, 4))]  # the norm before RoPE: (2x + 1, 3x + 1)
    assert q.tolist() == [[3.0] * 4] and k.tolist() == [[4.0] * 4]
    assert v.tolist() == [[1.0] * 4]


def test_gpt_oss_windows_and_sinks_are_served_only_where_the_adapter_names_them():
    """gpt-oss: a window layer beside a full one, each with one sink per query head, passes
    its adapter (relay's attention applies both); a sink per KV head, or another parameter
    beside the sinks, is refused; the Llama adapter still refuses both."""

    def gpt_oss(sinks=4, extra=None, window=127):
        layers = []
        for w in (window, -1):
            attn = Attn(radix=Radix(tp_q_head_num=4, tp_k_head_num=2, sliding_window_size=w))
            attn.forward_prepare_native = None  # its prepare takes the forward batch
            attn.sinks = nn.Parameter(torch.zeros(sinks))
            if extra:
                setattr(attn, extra, nn.Parameter(torch.zeros(1)))
            layers.append(attn)
        return stack(*layers, mlp=frozenset({"router", "topk", "experts"}))

    assert problems("GptOssForCausalLM", gpt_oss()) == []
    out = problems("GptOssForCausalLM", gpt_oss(sinks=2))
    assert len(out) == 2 and all("not one per query head (4)" in p for p in out)
    (out, _) = problems("GptOssForCausalLM", gpt_oss(extra="bias"))
    assert "holds parameters ['bias', 'sinks'], not the adapter's ['sinks']" in out
    llama = problems("LlamaForCausalLM", gpt_oss())
    assert any("holds parameters ['sinks']" in p for p in llama)


def test_heads_read_the_window_sglang_keeps_as_w_minus_1():
    from sglang_relay.runtime.forward.layer_driver import Heads

    assert Heads.of(Radix(sliding_window_size=127)).window == 128  # gpt-oss's 128 keys
    assert Heads.of(Radix()).window == 0 and Heads.of(Radix()).sinks is None
    param = nn.Parameter(torch.ones(1, dtype=torch.bfloat16), requires_grad=False)
    sinks = Heads.of(Radix(), param).sinks
    with torch.no_grad():
        param.fill_(2.0)  # a weight update in place: relay reads the live values
    assert sinks.tolist() == [2.0] and not sinks.requires_grad


def test_gemma3_refuses_what_its_loop_would_not_run_as_sglang_does():
    """A Gemma 3 layer is refused with a dynamic model-level RoPE (its frequencies change in
    the forward; the splice keeps them fixed), a logit soft-cap (SGLang's attention drops
    it) or bidirectional attention; a plain one passes."""
    from sglang_relay.runtime.models.anatomy import gemma3_problems

    def model(rope_type="linear", **cfg):
        m = nn.Module()
        m.rotary_emb, m.rotary_emb_local = nn.Module(), nn.Module()
        for r, kind in ((m.rotary_emb, rope_type), (m.rotary_emb_local, "default")):
            r.register_buffer("inv_freq", torch.ones(4))
            r.rope_type = kind
        m.config = SimpleNamespace(**cfg)
        return m

    attn = SimpleNamespace(is_sliding=True)
    assert gemma3_problems(model(), attn) is None
    assert "dynamic" in gemma3_problems(model("dynamic"), attn)
    assert "attn_logit_softcapping 50.0" in gemma3_problems(
        model(attn_logit_softcapping=50.0), attn
    )
    assert "final_logit_softcapping" in gemma3_problems(model(final_logit_softcapping=30.0), attn)
    assert "bidirectional" in gemma3_problems(model(use_bidirectional_attention=True), attn)
    assert "no model-level RoPE" in gemma3_problems(nn.Module(), attn)


def test_attention_parameters_outside_its_modules_are_refused():
    """A parameter held by the attention block itself (gpt-oss's per-head ``sinks``, which
    enter the softmax) would be dropped by relay's attention: refused, even in a layer
    without a window."""
    attn = Attn()
    attn.sinks = nn.Parameter(torch.zeros(8))
    (out,) = problems("LlamaForCausalLM", stack(Attn(), attn))
    assert out.startswith("layers[1].self_attn holds parameters ['sinks']")


def test_partial_rotary_is_served():
    """GLM-4.x and MiniMax-M2 rotate the first half of each head: a prefix of even length
    passes (the splice turns those dims alone; test_splice_keeps_the_unrotated_dims)."""
    assert problems("LlamaForCausalLM", stack(Attn(rope=Rope(rotary_dim=32)))) == []


def test_unknown_rope_and_unknown_architecture_are_refused():
    odd = Rope()
    odd.__class__ = type("MRotaryEmbedding", (Rope,), {})
    assert "cannot re-rotate" in problems("LlamaForCausalLM", stack(Attn(rope=odd)))[0]
    with pytest.raises(ValueError, match="no adapter for the Llama4ForCausalLM"):
        anatomy_of("Llama4ForCausalLM")


def test_rotation_table_is_float32_where_sglang_keeps_a_bf16_cache():
    from sglang_relay.core.rope import apply_rope_ref, build_cos_sin_cache, rerotate_keys
    from sglang_relay.runtime.models.anatomy import rotation_table

    full = build_cos_sin_cache(64, 8192, base=1e5)  # float32, as _compute_cos_sin_cache
    rope = nn.Module()
    rope.cos_sin_cache = full.bfloat16()  # SGLang's cache off CUDA / HIP / XPU
    rope._compute_cos_sin_cache = lambda: full
    table = rotation_table(rope)
    assert table.dtype == torch.float32 and torch.equal(table, full)
    assert rotation_table(rope) is table  # computed once
    torch.manual_seed(0)
    raw = torch.randn(200, 2, 64)
    old, new = torch.randint(0, 8192, (200,)), torch.randint(0, 8192, (200,))
    cached = apply_rope_ref(raw, old, full).float()
    truth = apply_rope_ref(raw, new, full)  # float64

    def err(cache):
        got = rerotate_keys(cached, new - old, cache).double()
        return float((got - truth).norm() / truth.norm())

    assert err(table) < 1e-5 < 1e-3 < err(rope.cos_sin_cache)  # bf16 angles are far off
    fp32 = nn.Module()
    fp32.cos_sin_cache = full
    assert rotation_table(fp32) is full  # SGLang's own float32 cache is used as it is
