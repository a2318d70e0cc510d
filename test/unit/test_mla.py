"""DeepSeek's multi-head latent attention (MLA) in relay's loop, against independent
references: the absorbed q / latent key / value that :func:`anatomy.mla_qkv` builds from an
MLA block's pieces, un-absorbed by :func:`anatomy.mla_out`, attends exactly as the
up-projected per-head attention (float64, weights split from ``kv_b_proj`` by hand); the
splice through the latent row's two views copies the latent bit for bit and turns the
rotated part as a direct rotation at the new position does (SGLang's own DeepSeek YaRN
module, float64 angles); the start-up check and the server modes refuse what the loop would
not run on it. The served model is the e2e test's (test_architectures.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_relay.core.attention import positional_causal_attention
from sglang_relay.runtime.config import modes
from sglang_relay.runtime.forward.layer_driver import LayerDriver, RopeGroup
from sglang_relay.runtime.models.adapters.deepseek_v2 import MLA_ATTENTION, Q_DIRECT, Q_LORA
from sglang_relay.runtime.models.anatomy import (
    DENSE_MLP,
    anatomy_problems,
    mla_out,
    mla_qkv,
    radix_of,
)
from sglang_relay.runtime.models.registry import anatomy_of
from sglang_relay.runtime.sglang.model import SUPPORTED_ROPE

H, C, P, R, DV = 3, 16, 8, 32, 12  # heads, nope dims, rope dims, latent rank, value dims


def deepseek_rope(p=P, dtype=torch.float32):
    """SGLang's own DeepSeek YaRN rotary module (GPT-J pairs, mscale != mscale_all_dim),
    built as on its CPU engine (whose flag this process may have imported unset: the
    constructor then reaches for a GPU kernel), applied through ``forward_native``."""
    from sglang.srt.layers.rotary_embedding import base
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "_is_cpu", True)
        rope = DeepseekScalingRotaryEmbedding(
            p, p, 256, 10000, False, 4.0, dtype, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=0.707, device="cpu",
        )  # fmt: skip
    rope.forward = rope.forward_native
    return rope


def mla_block(q_lora: int | None, seed=0):
    """An MLA attention block with SGLang's interface (``DeepseekV2AttentionMLA``'s
    attributes and methods the absorbed path calls), float64 weights, and the
    up-projection ``kv_b`` [H * (C + DV), R] it splits into ``w_kc`` / ``w_vc``."""
    g = torch.Generator().manual_seed(seed)
    hidden = 24
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.3  # noqa: E731
    kv_b = rnd(H * (C + DV), R)
    per_head = kv_b.view(H, C + DV, R)
    w_kc = per_head[:, :C, :].contiguous()  # [H, C, R]: q_nope -> latent space
    w_vc = per_head[:, C:, :].transpose(1, 2).contiguous()  # [H, R, DV]: latent -> value
    w_q_a = rnd(q_lora or 1, hidden)
    w_q = rnd(H * (C + P), q_lora or hidden)
    w_kv_a = rnd(R + P, hidden)
    norm = lambda x: x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # noqa: E731
    block = SimpleNamespace(
        q_lora_rank=q_lora, kv_lora_rank=R, qk_rope_head_dim=P, qk_nope_head_dim=C,
        qk_head_dim=C + P, num_local_heads=H, w_kc=w_kc, w_vc=w_vc,
        q_a_layernorm=norm, kv_a_layernorm=norm, rotary_emb=deepseek_rope(dtype=torch.float64),
        prepare_qkv_latent=lambda x, fb: torch.cat((x @ w_q_a.T, x @ w_kv_a.T), -1),
        q_b_proj_forward=lambda q: (q @ w_q.T).view(-1, H, C + P),
        q_proj=lambda x: (x @ w_q.T, None), kv_a_proj_with_mqa=lambda x: (x @ w_kv_a.T, None),
    )  # fmt: skip
    return block, kv_b, w_q, w_q_a, w_kv_a, norm


@pytest.mark.parametrize("q_lora", [10, None])
def test_absorbed_mla_attends_as_the_up_projected_heads(q_lora):
    """Independent reference: the per-head keys ``[W_uk c ; k_pe]`` and values ``W_uv c``
    up-projected from the normed latent ``c`` by ``kv_b_proj``'s rows, q from the block's
    projections, the same RoPE; attention over them, causal, float64."""
    block, kv_b, w_q, w_q_a, w_kv_a, norm = mla_block(q_lora)
    n = 9
    x = torch.randn(n, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5, 5 + n)
    q, k, v = mla_qkv(block, pos, x)
    assert q.shape == (n, H * (R + P)) and k.shape == (n, R + P) and v.shape == (n, R)
    assert torch.equal(k[:, :R], v)  # the value is the latent part of the key row
    scale = 0.17
    # key j sits at index j (the mask is by index; RoPE at pos = index + 5)
    o = positional_causal_attention(q.view(n, H, R + P), k.view(n, 1, R + P),
                                    v.view(n, 1, R), pos - 5, scale)  # fmt: skip
    out = mla_out(block, o.reshape(n, H * R))

    # reference: no absorption
    qr = ((norm(x @ w_q_a.T) if q_lora else x) @ w_q.T).view(n, H, C + P)
    latent = x @ w_kv_a.T
    c = norm(latent[:, :R])
    up = (c @ kv_b.T).view(n, H, C + DV)
    q_pe, k_pe = block.rotary_emb(pos, qr[..., C:].clone(), latent[:, R:].clone().view(n, 1, P))
    keys = torch.cat((up[..., :C], k_pe.view(n, 1, P).expand(n, H, P)), -1)
    queries = torch.cat((qr[..., :C], q_pe.view(n, H, P)), -1)
    logits = torch.einsum("ihd,jhd->hij", queries, keys) * scale
    logits = logits.masked_fill(pos[None, :, None] < pos[None, None, :], -math.inf)
    want = torch.einsum("hij,jhd->ihd", logits.softmax(-1), up[..., C:]).reshape(n, H * DV)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_the_splice_turns_only_the_rotated_part_of_a_latent_row():
    """One pool buffer per layer ``[slots, 1, R + P]`` (SGLang's MLA pool; the value buffer is
    its first ``R`` columns): the driver's splice copies the latent bit for bit and the
    rotated part equals the key rotated at its new position directly (SGLang's module)."""
    rope = deepseek_rope()
    slots = 40
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(slots, 1, R + P, generator=g)  # un-rotated k_pe in the last P
    old = torch.arange(slots) % 17
    kbuf = raw.clone()
    _, kbuf[:, :, R:] = rope(old, torch.zeros(slots, 1, P), raw[:, :, R:].clone())
    pool = SimpleNamespace(get_key_buffer=lambda i: kbuf, get_value_buffer=lambda i: kbuf[..., :R])
    driver = LayerDriver.__new__(LayerDriver)
    driver.pool = pool
    driver._heads = (SimpleNamespace(layer_id=0),)
    from sglang_relay.core.rope import delta_cos_sin
    from sglang_relay.runtime.models.anatomy import rotation_table

    table = lambda d: delta_cos_sin(rotation_table(rope), d)  # noqa: E731
    driver._rope_groups = (RopeGroup((0,), table, False, latent=R),)
    src, dst = torch.arange(0, 8), torch.arange(20, 28)
    new = old[src] + torch.tensor([3, 50, 1, 7, 90, 0, 12, 33])
    before = kbuf.clone()
    driver.splice(src, dst, new - old[src])
    assert torch.equal(kbuf[dst, :, :R], before[src, :, :R])  # the latent: bit-identical
    _, direct = rope(new, torch.zeros(8, 1, P), raw[src, :, R:].clone())
    torch.testing.assert_close(kbuf[dst, :, R:], direct, rtol=0, atol=2e-6)
    others = torch.ones(slots, dtype=torch.bool)
    others[dst] = False
    assert torch.equal(kbuf[others], before[others])


# ---- the start-up check and the modes --------------------------------------------------------


class Radix(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.logit_cap, self.sliding_window_size, self.k_scale = 0.0, -1, None
        self.v_scale = None
        self.qk_head_dim, self.v_head_dim = R + P, R
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = H, 1, 1
        self.scaling, self.layer_id = 0.1, 0
        self.__dict__.update(kw)


def mla_stack(q=Q_LORA, extra=(), radix=None, **attrs):
    attn = nn.Module()
    for name in sorted((MLA_ATTENTION | q | set(extra)) - {"rotary_emb", "attn_mqa", "attn_mha"}):
        setattr(attn, name, nn.Identity())
    attn.rotary_emb = deepseek_rope()
    attn.attn_mqa = radix or Radix()
    attn.attn_mha = Radix(tp_k_head_num=H, qk_head_dim=C + P, v_head_dim=DV)
    attn.kv_lora_rank, attn.qk_rope_head_dim = R, P
    attn.w_kc, attn.w_vc = torch.zeros(H, C, R), torch.zeros(H, R, DV)
    attn.__dict__.update(attrs)
    layer = nn.Module()
    layer.input_layernorm, layer.post_attention_layernorm = nn.Identity(), nn.Identity()
    layer.self_attn, layer.mlp = attn, nn.Module()
    for name in sorted(DENSE_MLP):
        setattr(layer.mlp, name, nn.Identity())
    model = nn.Module()
    model.embed_tokens, model.norm = nn.Identity(), nn.Identity()
    model.layers = nn.ModuleList([layer])
    return model


def problems(model):
    return anatomy_problems(anatomy_of("DeepseekV3ForCausalLM"), model, SUPPORTED_ROPE)


def test_mla_blocks_of_either_q_form_pass_and_what_the_loop_would_not_run_is_refused():
    assert problems(mla_stack()) == []
    assert problems(mla_stack(Q_DIRECT)) == []
    block = mla_stack().layers[0].self_attn
    assert radix_of(block) is block.attn_mqa  # the absorbed RadixAttention, one latent head
    cases = {
        "['indexer']": mla_stack(extra=["indexer"]),  # DSA (V3.2, GLM-5)
        "use_dsa": mla_stack(use_dsa=True),
        "use_deep_gemm_bmm": mla_stack(use_deep_gemm_bmm=True),
        "w_kc of torch.float8_e4m3fn": mla_stack(w_kc=torch.zeros(1, dtype=torch.float8_e4m3fn)),
        "2 key heads": mla_stack(radix=Radix(tp_k_head_num=2)),
        "decode context parallelism": mla_stack(dcp_size=2),
        "kimi_split_gguf_kv_b": mla_stack(_kimi_split_gguf_kv_b=True),
    }
    for words, model in cases.items():
        (found,) = problems(model)
        assert words in found, (words, found)
    both = mla_stack(Q_LORA | Q_DIRECT)  # one q form or the other, not both
    assert problems(both) and "has ['kv_a_proj_with_mqa', 'q_proj']" in problems(both)[0]


def test_modes_relay_has_not_verified_on_latent_rows_are_refused_with_the_way_out():
    arch = "DeepseekV3ForCausalLM"
    view = modes.ServerView
    assert modes.refusal(view(), architecture=arch) is None
    cases = {
        "speculative decoding": view(speculative_algorithm="NGRAM"),
        "LoRA": view(enable_lora=True, lora_backend="torch_native"),
        "--enable-hierarchical-cache": view(enable_hierarchical_cache=True),
        "--kv-cache-dtype fp8_e4m3": view(kv_cache_dtype="fp8_e4m3"),
    }
    for words, v in cases.items():
        message = modes.refusal(v, architecture=arch)
        assert message and words in message and "on an MLA model" in message, message
    assert "span shipping" in modes.refusal(view(), architecture=arch, ship_role="decode")
    # the same modes on a non-MLA model are not refused for MLA's reasons
    assert "MLA" not in (modes.refusal(view(kv_cache_dtype="fp8_e4m3")) or "")


def test_decode_influence_reads_the_rotary_part_a_backend_passes_apart():
    """On FlashInfer / FA3 / TRT-LLM MLA SGLang passes the absorbed query's rotary part as
    ``q_rope``; the influence hook must see the query the Triton and torch backends get
    whole (``[q_nope_out ; q_pe]`` per head): the same influence scores either way."""
    from sglang_relay.runtime.forward.decode import InfluenceHook

    g = torch.Generator().manual_seed(5)
    slots, seq = 16, 11
    kbuf = torch.randn(slots, 1, R + P, generator=g)
    radix = Radix()
    ledger = SimpleNamespace(influence=None)
    pool = SimpleNamespace(get_key_buffer=lambda i: kbuf)
    req_to_token = torch.arange(slots).view(1, slots)
    fb = SimpleNamespace(seq_lens=torch.tensor([seq]), req_pool_indices=torch.tensor([0]))
    q = torch.randn(1, H, R + P, generator=g)
    scores = []
    for args, kwargs in (
        ((q.reshape(1, -1), None, None, fb), {}),  # whole: torch_native / Triton
        ((q[..., :R].reshape(1, -1), None, None, fb), {"q_rope": q[..., R:].reshape(1, -1)}),
    ):
        ledger.influence = torch.zeros(slots)
        hook = InfluenceHook.__new__(InfluenceHook)
        hook.ledger, hook.pool, hook.req_to_token, hook.armed = ledger, pool, req_to_token, True
        hook._accumulate(radix, args, kwargs, None)
        scores.append(ledger.influence.clone())
    assert scores[0][:seq].sum() == pytest.approx(H)  # each head's probabilities sum to 1
    torch.testing.assert_close(scores[1], scores[0], rtol=0, atol=1e-6)
