"""The reference executor on an MLA model (random DeepSeek-V3, 3 layers: one dense, two MoE;
q through ``q_lora_rank`` and through a plain ``q_proj``) against Hugging Face and SGLang:
its prefill and greedy decode are Hugging Face's; its cache rows are what SGLang's MLA pool
holds (Hugging Face's latent cache, the rotary part put back in GPT-J pairs; the rotation
is SGLang's own DeepSeek YaRN module's); the splice turns only the rotary columns of a row;
the relay oracles (everything recomputed, the probe, the context mass, the influence) hold
through the up-projection of the cached rows."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_relay.bench.models import random_hf_model
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference import (
    RefModel,
    SpanOccurrence,
    exact_prefill,
    generate,
    last_row_probe,
    load_model,
    record_context_mass,
    relay_prefill,
)

NUM_LAYERS = 3
R, P, C = 256, 32, 32  # the random config's kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim
FULL = RelayConfig(l_start=0, l_det=0, l_end=-1, top_ratio=1.0, l_suf=0)
IDS = torch.randint(100, 40000, (120,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=[96, None], ids=["q_lora", "q_proj"])
def ref(request) -> RefModel:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; one thread is fastest on a shared machine
    model = random_hf_model("deepseek_v3", num_hidden_layers=NUM_LAYERS, q_lora_rank=request.param)
    model.set_attn_implementation("eager")  # Hugging Face's attention weights, below
    yield RefModel(model)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def upstream(ref):
    """A greedy decode of 20 tokens after a 12-token prompt (19 span tokens)."""
    (rec,) = generate(ref, [IDS[:12]], 20)
    return rec


def hf_attentions(ref: RefModel, ids: list[int], pos: list[int] | None = None):
    """Hugging Face's eager attention weights, ``L x [H, T, T]``."""
    kw = {} if pos is None else {"position_ids": torch.tensor([pos])}
    with torch.no_grad():
        att = ref.model(torch.tensor([ids]), output_attentions=True, **kw).attentions
    return [a[0] for a in att]


def test_prefill_and_greedy_decode_are_hfs(ref, upstream):
    assert ref.mla and ref.num_kv_heads == 1 and (ref.head_dim, ref.v_dim) == (R + P, R)
    assert ref.scale == pytest.approx((C + P) ** -0.5 * (0.1 * 0.707 * math.log(8.0) + 1) ** 2)
    ours = exact_prefill(ref, IDS[:36], forced=IDS[36:47])
    with torch.no_grad():
        theirs = ref.model(torch.tensor([IDS[:47]])).logits[0].float()
    torch.testing.assert_close(ours.logits, theirs[-12:], atol=5e-5, rtol=0)
    assert ours.cache.k.shape == (NUM_LAYERS, 47, 1, R + P)
    assert torch.equal(ours.cache.v, ours.cache.k[..., :R])  # the value: the latent columns
    with torch.no_grad():
        out = ref.model.generate(torch.tensor([IDS[:12]]), max_new_tokens=20, do_sample=False)
    assert upstream.output == out[0, 12:].tolist()
    assert upstream.k.shape == (NUM_LAYERS, 19, 1, R + P) and upstream.v.shape[-1] == R


def sglang_layout(hf_rot: torch.Tensor) -> torch.Tensor:
    """Hugging Face's interleaved RoPE output ``cat(evens, odds)`` back into pairs."""
    half = hf_rot.shape[-1] // 2
    return torch.stack((hf_rot[..., :half], hf_rot[..., half:]), -1).flatten(-2)


def test_cached_rows_are_hfs_latent_cache_in_sglangs_pair_layout(ref):
    """Hugging Face caches ``kv_a_layernorm(latent)`` and the rotated ``k_rot`` apart; the
    reference's row is the two side by side, the rotary part in GPT-J pairs."""
    ids = IDS[:40]
    rows = exact_prefill(ref, ids).cache.k[:, :, 0]  # [L, T, r + p]
    with torch.no_grad():
        cache = ref.model(torch.tensor([ids]), use_cache=True).past_key_values
        attn = ref.layers[0].self_attn  # layer 0 by hand: its input is the embedding
        x = ref.layers[0].input_layernorm(ref.embed(torch.tensor(ids)))
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :R])
    torch.testing.assert_close(rows[0, :, :R], latent, atol=1e-6, rtol=0)
    for lid in range(NUM_LAYERS):
        kv_nope, k_rot = cache.layers[lid].keys[0, 0], cache.layers[lid].values[0, 0]
        tol = 1e-6 if lid == 0 else 1e-4  # later layers: the streams differ in rounding
        torch.testing.assert_close(rows[lid, :, :R], kv_nope, atol=tol, rtol=0)
        torch.testing.assert_close(rows[lid, :, R:], sglang_layout(k_rot), atol=tol, rtol=0)
        assert (rows[lid, :, R:] - k_rot).abs().max() > 1e-2  # the layouts do differ


def deepseek_rope():
    """SGLang's DeepSeek YaRN rotary module with the random config's values, built as on its
    CPU engine (the flag this process may have imported unset sends the constructor to a
    GPU kernel), applied through ``forward_native``."""
    pytest.importorskip("sglang")
    from sglang.srt.layers.rotary_embedding import base
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "_is_cpu", True)
        rope = DeepseekScalingRotaryEmbedding(
            P, P, 1024, 10000, False, 8.0, torch.float32, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=0.707, device="cpu",
        )  # fmt: skip
    rope.forward = rope.forward_native
    return rope


def test_rope_table_and_rotated_part_are_sglangs(ref):
    rope = deepseek_rope()
    table = ref.cos_sin_cache(8192)
    torch.testing.assert_close(table[:8192], rope.cos_sin_cache[:8192], atol=1e-6, rtol=0)
    assert float(table[0, 0]) == pytest.approx(1.0531, abs=1e-4)  # YaRN's mscale, folded in
    assert (ref.rot_slice, ref.is_neox) == (slice(R, R + P), False)
    ids = IDS[:40]
    rows = exact_prefill(ref, ids).cache.k[0, :, 0]  # layer 0
    with torch.no_grad():
        x = ref.layers[0].input_layernorm(ref.embed(torch.tensor(ids)))
        k_pe = ref.layers[0].self_attn.kv_a_proj_with_mqa(x)[:, R:].reshape(len(ids), 1, P)
        _, turned = rope(torch.arange(len(ids)), torch.zeros(len(ids), 1, P), k_pe.clone())
    torch.testing.assert_close(rows[:, R:], turned[:, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("head", [5, 40])  # the span moves back 7 positions, or on 28
def test_the_splice_turns_only_the_rotary_part_of_each_row(ref, upstream, head):
    span = upstream.span_tokens
    prompt = IDS[50 : 50 + head] + span + IDS[45:50]
    occ = SpanOccurrence(head, upstream, 0, len(span))
    naive = relay_prefill(ref, prompt, [occ], RelayConfig(method="naive"))
    rows = torch.arange(head, head + len(span))
    new = rows.clone()
    for lid, layer in enumerate(ref.layers):
        got = naive.cache.k[lid, rows]  # [S, 1, r + p]
        assert torch.equal(got[..., :R], upstream.k[lid, ..., :R])  # the latent: bit for bit
        assert torch.equal(naive.cache.v[lid, rows], upstream.v[lid])
        with torch.no_grad():  # the decode stream's key at the new positions, directly
            _, k_new, _ = ref.qkv(layer, layer.input_layernorm(upstream.hidden[:, lid]), new)
        rel = (got[..., R:] - k_new[..., R:]).norm() / k_new[..., R:].norm()
        assert rel < 1e-5, (lid, float(rel))
        assert (upstream.k[lid, ..., R:] - k_new[..., R:]).norm() / k_new[..., R:].norm() > 1e-2


def test_relay_oracles_hold_through_the_up_projection(ref, upstream):
    """Every span token recomputed in every layer is the exact prefill; the probe, the
    context mass and the influence are Hugging Face's eager attention weights."""
    span, head = upstream.span_tokens, len(upstream.prompt)
    prompt = IDS[50:60] + span + IDS[45:50]
    occ = SpanOccurrence(10, upstream, 0, len(span))
    exact = exact_prefill(ref, prompt)
    full = relay_prefill(ref, prompt, [occ], FULL)
    torch.testing.assert_close(full.logits, exact.logits, atol=5e-5, rtol=0)
    torch.testing.assert_close(full.cache.k, exact.cache.k, atol=1e-5, rtol=0)
    naive = relay_prefill(ref, prompt, [occ], RelayConfig(method="naive"))
    assert (naive.logits - exact.logits).abs().max() > 1e-2  # the oracle could fail
    # a detection at layer 1 over the spliced latent rows
    det = relay_prefill(ref, prompt, [occ], RelayConfig(l_start=0, l_det=1, l_end=-1))
    assert det.deviation.shape == (len(span),) and bool(det.deviation.isfinite().all())

    # the probe: the span behind its own prompt (its decode KV is exact there), no rows between
    probe_prompt = upstream.prompt + span + IDS[45:50] + [IDS[60]]
    got = last_row_probe(ref, probe_prompt, [SpanOccurrence(head, upstream, 0, len(span))])
    pos = list(range(head + len(span))) + [len(probe_prompt) - 1]
    att = hf_attentions(ref, upstream.prompt + span + [IDS[60]], pos)
    cols = slice(head, head + len(span))
    want = torch.stack([a[:, -1, cols].mean(0) for a in att]).float()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)

    att = hf_attentions(ref, upstream.prompt + span)
    for lid in range(NUM_LAYERS):
        mass = att[lid][:, head:, 1:head].sum(-1).mean(0)
        torch.testing.assert_close(record_context_mass(ref, upstream, lid), mass, atol=2e-5,
                                   rtol=0)  # fmt: skip
        received = att[lid][:, head:, head:].sum((0, 1))  # from the fed tokens, every head
        torch.testing.assert_close(upstream.influence[:, lid], received, atol=1e-4, rtol=1e-5)


def test_load_model_reads_a_saved_random_checkpoint_as_mla(model_dir, tmp_path):
    from sglang_relay.bench.models import random_model

    path = random_model("deepseek_v3", tmp_path / "Random-deepseek_v3", model_dir)
    ref = load_model(str(path), num_layers=NUM_LAYERS, device="cpu")
    assert ref.mla and ref.rot_slice == slice(R, R + P) and not ref.is_neox
    ours = exact_prefill(ref, IDS[:30])
    with torch.no_grad():
        theirs = ref.model(torch.tensor([IDS[:30]])).logits[0, -1].float()
    torch.testing.assert_close(ours.logits[0], theirs, atol=5e-5, rtol=0)
