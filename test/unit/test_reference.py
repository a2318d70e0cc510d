"""The HF reference executor: METHOD.md's exactness oracles and sanity of the relay.

Runs the first 6 layers of the embedded model (fp32) so that it takes seconds.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.reference import (
    RefModel,
    SpanOccurrence,
    exact_kv_prefill,
    exact_prefill,
    fidelity,
    first_token_kl,
    generate,
    greedy_after_forced,
    greedy_continue,
    last_row_probe,
    load_model,
    record_context_mass,
    relay_prefill,
    teacher_forced,
    true_value_deviation,
)
from sglang_relay.core.rope import apply_rotation, delta_cos_sin

pytestmark = pytest.mark.model

NUM_LAYERS = 6
STORY = (
    "The history of the city begins in the early middle ages, when a small market grew up "
    "beside the river crossing. Merchants from the surrounding villages brought grain, wool "
    "and timber, and within a century the town had a church, a wall and a charter granted "
    "by the king. Over the following centuries the population grew steadily, and the old "
    "wooden houses were replaced by buildings of brick and stone."
)
# every span-layer recomputed from the embeddings: must equal the exact prefill
FULL = RelayConfig(l_start=0, l_det=0, l_end=-1, top_ratio=1.0, l_suf=0)


@pytest.fixture(scope="module")
def ref(model_dir) -> RefModel:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; one thread is fastest on a shared machine
    yield load_model(str(model_dir), num_layers=NUM_LAYERS)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat(tok, system: str, user: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def upstream(ref, tok):
    """A: a real English text decoded token by token (teacher-forced decode)."""
    prompt = chat(tok, "You are a historian.", "Tell me the history of the old city.")
    story = tok(STORY, add_special_tokens=False).input_ids
    (rec,) = generate(ref, [prompt], 0, force=[story + [tok.eos_token_id]])
    assert rec.span_tokens == story
    return rec


def relay_prompt(tok, rec, system: str) -> tuple[list[int], SpanOccurrence]:
    """B = new system prompt and template around A's span."""
    head = chat(tok, system, "Summarize this text in one sentence:\n\n")[:-5]
    tail = tok("\n\nSummary:", add_special_tokens=False).input_ids
    prompt = head + rec.span_tokens + tail
    return prompt, SpanOccurrence(len(head), rec, 0, len(rec.span_tokens))


def test_layer_loop_reproduces_hf_forward(ref, tok):
    ids = tok(STORY, add_special_tokens=False).input_ids
    forced = ids[-12:]
    ours = exact_prefill(ref, ids[:-12], forced=forced[:-1])
    with torch.no_grad():
        theirs = ref.model(torch.tensor([ids[:-1]])).logits[0].float()
    assert ours.logits.shape == (12, theirs.shape[-1])
    torch.testing.assert_close(ours.logits, theirs[-12:], atol=1e-4, rtol=0)


def test_generate_matches_hf_greedy(ref, tok):
    prompt = chat(tok, "You are a helpful assistant.", "Name three rivers in Europe.")
    (rec,) = generate(ref, [prompt, prompt[:9]], 24)[:1]
    with torch.no_grad():
        out = ref.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert rec.output == out[0, len(prompt) :].tolist()
    assert rec.k.shape == (NUM_LAYERS, 23, ref.num_kv_heads, ref.head_dim)
    assert rec.hidden.shape == (23, NUM_LAYERS, ref.hidden_size)
    # layer 0's stream is the embedding of the fed token
    torch.testing.assert_close(rec.hidden[:, 0], ref.embed(torch.tensor(rec.span_tokens)))


def test_oracle_same_position_no_recompute_equals_exact(ref, tok, upstream):
    """(i) decode KV at the same positions behind the same prefix = prefill KV."""
    tail = tok("\n\nSummary:", add_special_tokens=False).input_ids
    prompt = upstream.prompt + upstream.span_tokens + tail
    span = SpanOccurrence(len(upstream.prompt), upstream, 0, len(upstream.span_tokens))
    exact = exact_prefill(ref, prompt)
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    assert naive.reuse_rate == 1.0 and naive.selected == [0]
    rows = slice(span.prompt_start, span.prompt_start + span.length)
    torch.testing.assert_close(naive.cache.k[:, rows], exact.cache.k[:, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(naive.cache.v[:, rows], exact.cache.v[:, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(naive.logits, exact.logits, atol=1e-4, rtol=0)


def test_oracle_full_recompute_equals_exact_behind_new_prefix(ref, tok, upstream):
    """(ii) L_start = 0, every token selected through the last layer = full prefill."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    assert span.prompt_start != len(upstream.prompt)  # really moved
    exact = exact_prefill(ref, prompt)
    full = relay_prefill(ref, prompt, [span], FULL)
    assert full.selected == [span.length] and full.reuse_rate == 0.0
    torch.testing.assert_close(full.logits, exact.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(full.cache.k, exact.cache.k, atol=1e-4, rtol=0)
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    assert (naive.logits - exact.logits).abs().max() > 1e-2  # the oracle could fail


def test_oracle_rerotated_keys_equal_keys_at_new_position(ref, upstream):
    """(iii) K re-rotated by delta = K computed at the new position (fp32, 1e-5 relative)."""
    n = len(upstream.span_tokens)
    old = upstream.span_start_pos + torch.arange(n)
    for shift in (-old[0].item(), 57, 1500):
        new = old + shift
        delta = new - old
        cos, sin = delta_cos_sin(ref.cos_sin_cache(int(delta.abs().max()) + 1), delta)
        for lid in (0, NUM_LAYERS - 1):
            layer = ref.layers[lid]
            x = layer.input_layernorm(upstream.hidden[:, lid])
            with torch.no_grad():
                _, k_new, _ = ref.qkv(layer, x, new)
            moved = apply_rotation(upstream.k[lid], cos, sin)
            rel = (moved - k_new).norm() / k_new.norm()
            assert rel < 1e-5, (shift, lid, float(rel))
            assert (upstream.k[lid] - k_new).norm() / k_new.norm() > 1e-2


def test_oracle_no_recompute_keeps_the_spliced_upstream_kv(ref, tok, upstream):
    """(iv) a schedule that recomputes nothing (l_det > l_end) leaves every span row with the
    upstream decode KV, keys re-rotated to the new positions (float64 reference), in every
    layer; the naive method is such a schedule."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor.")
    rows = torch.arange(span.prompt_start, span.prompt_start + span.length)
    keys = spliced_keys(ref, upstream, span)
    for cfg in (
        RelayConfig(l_start=2, l_det=2, l_end=1),
        RelayConfig(l_start=NUM_LAYERS, l_det=NUM_LAYERS, l_end=NUM_LAYERS - 1),
        RelayConfig(method="naive"),
    ):
        none = relay_prefill(ref, prompt, [span], cfg)
        assert none.reuse_rate == 1.0
        assert rel_err(none.cache.k[:, rows], keys) < 1e-5
        torch.testing.assert_close(none.cache.v[:, rows], upstream.v, atol=0, rtol=0)


def test_relay_lies_between_naive_and_exact(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    exact = exact_prefill(ref, prompt)
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    relay = relay_prefill(ref, prompt, [span], RelayConfig(l_start=1, l_det=2, l_end=-1))
    kl_naive = first_token_kl(exact.logits[0], naive.logits[0])
    kl_relay = first_token_kl(exact.logits[0], relay.logits[0])
    assert kl_naive > 1e-4
    assert kl_relay < kl_naive, (kl_relay, kl_naive)
    assert 0 < relay.selected[0] < span.length
    assert 0.0 < relay.reuse_rate < 1.0


def test_selection_counts_and_reuse_accounting(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are an editor.")
    n = span.length
    half = SpanOccurrence(span.prompt_start, upstream, 0, n // 2)
    rest = SpanOccurrence(span.prompt_start + n // 2 + 1, upstream, n // 2 + 1, n - n // 2 - 1)
    cb = RelayConfig().for_method("cacheblend")
    res = relay_prefill(ref, prompt, [rest, half], cb)
    assert res.span_lengths == [half.length, rest.length]
    assert res.selected == [round(0.15 * half.length), round(0.15 * rest.length)]
    sched = cb.schedule(NUM_LAYERS)
    recomputed = sum(
        m * sched.dense_layers + c * sched.sparse_layers
        for m, c in zip(res.span_lengths, res.selected, strict=True)
    )
    assert res.reuse_rate == pytest.approx(1 - recomputed / (sum(res.span_lengths) * NUM_LAYERS))
    epic = relay_prefill(ref, prompt, [half, rest], RelayConfig().for_method("epic"))
    assert epic.selected == [16, 16] and epic.deviation is None
    # two spans, everything recomputed: still the exact prefill
    full = relay_prefill(ref, prompt, [half, rest], FULL)
    torch.testing.assert_close(full.logits, exact_prefill(ref, prompt).logits, atol=1e-4, rtol=0)


def test_oracle_studies_exact_kv_and_forced_selection(ref, tok, upstream):
    """The headroom oracles: exact KV for every span token = exact prefill, for none =
    naive; a forced selection equal to the rule's own reproduces the rule's relay."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    exact = exact_prefill(ref, prompt)
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    n = span.length
    every = exact_kv_prefill(ref, prompt, [span], exact, torch.ones(n, dtype=torch.bool))
    torch.testing.assert_close(every.logits, exact.logits, atol=1e-4, rtol=0)
    assert every.reuse_rate == 0.0 and every.selected == [n]
    none = exact_kv_prefill(ref, prompt, [span], exact, torch.zeros(n, dtype=torch.bool))
    torch.testing.assert_close(none.logits, naive.logits, atol=1e-5, rtol=0)

    dev = true_value_deviation(ref, [span], exact)
    assert dev.shape == (n,) and float(dev.min()) >= 0
    assert float(dev[:4].mean()) > float(dev.mean())  # the span's first tokens deviate most
    worst = torch.zeros(n, dtype=torch.bool)
    worst[dev.topk(n // 5).indices] = True
    some = exact_kv_prefill(ref, prompt, [span], exact, worst)
    assert some.reuse_rate == pytest.approx(1 - (n // 5) / n)
    kl = first_token_kl(exact.logits[0], some.logits[0])
    assert 0 < kl < first_token_kl(exact.logits[0], naive.logits[0])

    cfg = RelayConfig(l_start=1, l_det=2, l_end=-1)
    rule = relay_prefill(ref, prompt, [span], cfg)
    again = relay_prefill(ref, prompt, [span], cfg, selection=rule.selected_mask)
    torch.testing.assert_close(again.logits, rule.logits, atol=0, rtol=0)
    assert again.selected == rule.selected
    other = relay_prefill(ref, prompt, [span], cfg, selection=worst)
    assert other.selected == [n // 5]
    assert (other.logits - rule.logits).abs().max() > 0
    with pytest.raises(ValueError, match="selection must be a bool tensor"):
        relay_prefill(ref, prompt, [span], cfg, selection=torch.ones(n - 1, dtype=torch.bool))


def test_span_tokens_are_checked(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are an editor.")
    shifted = SpanOccurrence(span.prompt_start + 1, upstream, 0, span.length)
    with pytest.raises(ValueError, match="differ"):
        relay_prefill(ref, prompt, [shifted], RelayConfig())
    last = SpanOccurrence(len(prompt) - 1, upstream, 0, 1)
    with pytest.raises(ValueError, match="last prompt token"):
        relay_prefill(ref, prompt, [last], RelayConfig())


def test_teacher_forcing_and_greedy_agree_with_one_pass(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    cont = greedy_continue(ref, exact_prefill(ref, prompt), 16)
    assert len(cont) == 16
    exact_tf = exact_prefill(ref, prompt, forced=cont[:-1]).logits
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    tf = teacher_forced(ref, naive, cont)
    one_pass = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"), forced=cont[:-1])
    torch.testing.assert_close(tf, one_pass.logits, atol=1e-4, rtol=0)
    stats = fidelity(exact_tf, tf, cont)
    assert stats["first_token_kl"] == pytest.approx(first_token_kl(exact_tf[0], tf[0]))
    # free-running greedy follows the exact continuation exactly up to the first divergence
    free = greedy_continue(ref, naive, 16)
    div = stats["first_divergence"]
    if div is None:
        assert free == cont
    else:
        assert free[:div] == cont[:div] and free[div] != cont[div]
    same = fidelity(exact_tf, exact_tf, cont)
    assert same["tf_top1"] == 1.0 and same["greedy_prefix"] == 1.0
    assert same["first_token_kl"] == pytest.approx(0.0, abs=1e-12)


def test_a_chains_later_agent_decodes_over_its_relayed_prompt(ref, tok, upstream):
    """``generate(relayed=...)``: the decode of a prompt that was itself relayed (a chain's
    second hop) attends to the relayed prompt KV. Its teacher-forced decode KV equals one
    relay prefill with the same text as forced rows (a separate code path: one pass, not a
    token loop), differs from the exact decode's, and its context masses read the relayed
    prompt keys."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    cfg = RelayConfig().for_method("epic")
    text = greedy_continue(ref, exact_prefill(ref, prompt), 12)
    (chained,) = generate(ref, [prompt], 0, force=[text], relayed=[([span], cfg)])
    (exact,) = generate(ref, [prompt], 0, force=[text])
    one_pass = relay_prefill(ref, prompt, [span], cfg, forced=text[:-1]).cache
    p, n = len(prompt), len(text) - 1
    torch.testing.assert_close(chained.k, one_pass.k[:, p : p + n], atol=1e-4, rtol=0)
    torch.testing.assert_close(chained.v, one_pass.v[:, p : p + n], atol=1e-4, rtol=0)
    torch.testing.assert_close(chained.prompt_k, one_pass.k[:, :p])
    assert exact.prompt_k is None
    assert rel_err(chained.k[2], exact.k[2]) > 1e-3  # the relayed prompt's error carries on
    mass = record_context_mass(ref, chained, 2)
    chained.prompt_k = None  # the same decode read against the exact prompt keys
    chained.context.clear()
    assert not torch.allclose(mass, record_context_mass(ref, chained, 2), atol=1e-4)
    with pytest.raises(ValueError, match="one entry"):
        generate(ref, [prompt], 0, force=[text], relayed=[])


def test_greedy_after_forced_equals_greedy_decoding_from_scratch(ref, tok, upstream):
    """The fidelity bench's free-running outputs come from the teacher-forced pass plus the
    steps after the first divergence; they must equal a plain greedy decode."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    n = 20
    naive = RelayConfig(method="naive")
    free = greedy_continue(ref, relay_prefill(ref, prompt, [span], naive), n)
    exact_cont = greedy_continue(ref, exact_prefill(ref, prompt), n)
    # forced: the exact continuation, and one that leaves the method's path at step 4
    bent = free[:4] + [(free[4] + 1) % tok.vocab_size] + free[5:]
    for forced in (exact_cont, bent, free):
        res = relay_prefill(ref, prompt, [span], naive, forced=forced[:-1])
        assert greedy_after_forced(ref, res, forced, n) == free
    # a stop token ends it, also when the forced text goes on
    stop = free[6]
    res = relay_prefill(ref, prompt, [span], naive, forced=bent[:-1])
    want = free[: free.index(stop) + 1]
    assert greedy_after_forced(ref, res, bent, n, stop_ids=[stop]) == want
    assert greedy_continue(ref, relay_prefill(ref, prompt, [span], naive), n, [stop]) == want


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def spliced_keys(ref, rec, span: SpanOccurrence) -> torch.Tensor:
    """Upstream keys of the span moved to its new positions: ``[L, n, H_kv, D]``."""
    new = span.prompt_start + torch.arange(span.length)
    old = rec.span_start_pos + span.span_start + torch.arange(span.length)
    cos, sin = delta_cos_sin(ref.cos_sin_cache(int((new - old).abs().max()) + 1), new - old)
    k = rec.k[:, span.span_start : span.span_start + span.length]
    return torch.stack([apply_rotation(k[lid], cos, sin) for lid in range(k.shape[0])])


def test_naive_keys_are_keys_of_the_decode_stream_at_new_positions(ref, tok, upstream):
    """Splicing re-rotates: every reused key equals the key the decode stream gives at the
    new position."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor.")
    naive = relay_prefill(ref, prompt, [span], RelayConfig(method="naive"))
    rows = torch.arange(span.prompt_start, span.prompt_start + span.length)
    for lid, layer in enumerate(ref.layers):
        with torch.no_grad():
            _, k, v = ref.qkv(layer, layer.input_layernorm(upstream.hidden[:, lid]), rows)
        rel = (naive.cache.k[lid, rows] - k).norm() / k.norm()
        assert rel < 1e-5, (lid, float(rel))
        torch.testing.assert_close(naive.cache.v[lid, rows], v, atol=1e-5, rtol=0)


def test_relay_kv_follows_the_schedule(ref, tok, upstream):
    """Which rows were recomputed in which layer: reused below l_start and (unselected)
    above l_det; fresh at l_det for all; selected rows = select_tokens(deviation)."""
    from sglang_relay.core.selection import kv_deviation

    cfg = RelayConfig(l_start=2, l_det=3, l_end=-1, tau_dev=1.2, l_suf=3)
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    res = relay_prefill(ref, prompt, [span], cfg)
    rows = torch.arange(span.prompt_start, span.prompt_start + span.length)
    keys = spliced_keys(ref, upstream, span)
    k, v = res.cache.k[:, rows], res.cache.v[:, rows]
    assert rel_err(k[:2], keys[:2]) < 1e-5  # never recomputed
    torch.testing.assert_close(v[:2], upstream.v[:2], atol=0, rtol=0)
    assert rel_err(k[2], keys[2]) < 1e-5  # recomputed from the same stored input
    assert (v[3] - upstream.v[3]).abs().amax(dim=(1, 2)).min() > 0  # fresh for every row
    torch.testing.assert_close(kv_deviation(v[3], upstream.v[3]), res.deviation)
    want = res.deviation >= 1.2 * res.deviation.mean()  # the rule, written out by hand
    want[-3:] = True  # l_suf
    assert torch.equal(res.selected_mask, want) and 0 < int(want.sum()) < span.length
    for lid in range(4, NUM_LAYERS):
        torch.testing.assert_close(v[lid, ~want], upstream.v[lid, ~want], atol=0, rtol=0)
        assert (v[lid, want] - upstream.v[lid, want]).abs().amax(dim=(1, 2)).min() > 1e-6


def test_packaged_workloads_and_profile():
    """The bench and profiler inputs: valid cases, disjoint calibration, a loadable profile
    whose cap guarantees the reuse it was chosen for."""
    from sglang_relay.bench.evaluation import shipped_profile_path
    from sglang_relay.bench.workload import load_workload
    from sglang_relay.core.config import load_profile
    from sglang_relay.core.operating import reuse_cap

    evaluation = load_workload()
    calibration = load_workload(name="calibration_workload.jsonl")
    calibration += load_workload(name="calibration_loops_workload.jsonl")
    assert len(evaluation) >= 40 and len(calibration) >= 80
    assert not {c.task for c in evaluation} & {c.task for c in calibration}
    assert {c.kind for c in evaluation[:8]} == {"code", "math", "know", "plan"}
    for case in evaluation + calibration:
        names = {"task": case.task} | {a.name: "x" for a in case.upstream}
        for agent in (*case.upstream, case.downstream):
            agent.template.format(**names)  # every field is known
        assert all("{" + a.name + "}" in case.downstream.template for a in case.upstream)

    path = shipped_profile_path("/somewhere/SmolLM2-135M-Instruct")
    cfg, data = load_profile(path)
    sched = cfg.schedule(30)
    for n in (32, 128, 255, 511):
        chosen = min(n, max(1, int(cfg.max_ratio * n)))
        assert sched.reuse_rate(n, chosen) >= data["min_reuse"]
    assert len(data["curves"]["value_cos"]) == 30 and data["search"]
    cap = reuse_cap(RelayConfig(l_start=0, l_det=1, l_end=-1), 30, 0.8)
    assert cap == pytest.approx(5 / 29, abs=1e-3) and cap <= 5 / 29
    assert reuse_cap(RelayConfig(l_start=0, l_det=7, l_end=-1), 30, 0.8) is None


def test_influence_is_the_attention_mass_from_decode_queries(ref, upstream):
    """``influence[j, l]`` = sum over the fed tokens t >= j and the query heads of the
    attention probability of t on j at layer l (recomputed here from a prefill)."""
    prompt_len, n = len(upstream.prompt), len(upstream.span_tokens)
    exact = exact_prefill(ref, upstream.prompt + upstream.span_tokens + [upstream.output[-1]])
    pos = prompt_len + torch.arange(n)
    for lid in (0, 3, NUM_LAYERS - 1):
        layer = ref.layers[lid]
        with torch.no_grad():
            q, _, _ = ref.qkv(layer, layer.input_layernorm(upstream.hidden[:, lid]), pos)
        keys = exact.cache.k[lid, : prompt_len + n].repeat_interleave(
            ref.num_heads // ref.num_kv_heads, dim=1
        )  # [T, Hq, D]
        scores = torch.einsum("nhd,thd->nht", q, keys) * ref.scale
        causal = torch.arange(prompt_len + n)[None, None, :] <= pos[:, None, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        want = probs.sum(dim=(0, 1))[prompt_len:]
        torch.testing.assert_close(upstream.influence[:, lid], want, atol=1e-4, rtol=1e-4)
    assert upstream.influence.shape == (n, NUM_LAYERS)
    # every fed query spreads mass 1 per head; the span keeps what is not on the prompt
    total = n * ref.num_heads
    assert 0 < float(upstream.influence[:, 3].sum()) < total


def test_influence_threshold_selects_like_the_rule(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    cfg = RelayConfig(l_start=2, l_det=3, l_end=-1, tau_dev=50.0, tau_inf=1.45, l_suf=0)
    res = relay_prefill(ref, prompt, [span], cfg)
    influence = upstream.influence[:, 3]
    by_dev = res.deviation >= 50.0 * res.deviation.mean()  # the rule, written out by hand
    want = by_dev | (influence >= 1.45 * influence.mean())
    assert torch.equal(res.selected_mask, want)
    assert int(want.sum()) > int(by_dev.sum())  # influence adds tokens
    without = relay_prefill(ref, prompt, [span], replace(cfg, tau_inf=None))
    assert torch.equal(without.selected_mask, by_dev)


def test_context_mass_is_hf_attention_on_the_upstream_prompt(ref, upstream):
    """The context mass of span token j at layer l = the attention probability its decode
    query puts on prompt positions 1..P-1, averaged over heads, here read from Hugging
    Face's own eager attention weights of one forward over prompt + span."""
    prompt_len, n = len(upstream.prompt), len(upstream.span_tokens)
    ids = torch.tensor([upstream.prompt + upstream.span_tokens])
    with torch.no_grad():
        att = ref.model(ids, output_attentions=True).attentions  # L x [1, H, T, T]
    for lid in (0, 2, NUM_LAYERS - 1):
        want = att[lid][0, :, prompt_len:, 1:prompt_len].sum(-1).mean(0)
        got = record_context_mass(ref, upstream, lid)
        torch.testing.assert_close(got, want.float(), atol=2e-4, rtol=0)
    got = record_context_mass(ref, upstream, 2)
    assert got.shape == (n,) and float(got.min()) >= 0 and float(got.max()) <= 1
    assert float(got[:8].mean()) > float(got[-8:].mean())  # early tokens look back more


def test_context_rule_keeps_the_highest_context_mass(ref, tok, upstream):
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    cfg = RelayConfig(
        l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
        first_k=4, max_ratio=0.2,
    )  # fmt: skip
    res = relay_prefill(ref, prompt, [span], cfg)
    mass = record_context_mass(ref, upstream, 2)
    n = span.length
    cap = int(0.2 * n)
    rest = mass.clone()
    rest[:4] = float("-inf")  # the 4 forced first tokens, then the highest masses
    want = torch.zeros(n, dtype=torch.bool)
    want[:4] = True
    want[rest.topk(cap - 4).indices] = True
    assert torch.equal(res.selected_mask, want)
    assert res.reuse_rate == pytest.approx(1 - cap / n)
    with pytest.raises(ValueError, match="l_ctx"):
        RelayConfig(signal="context")


def test_last_row_probe_is_hf_attention_without_the_rows_between(ref, tok, upstream):
    """The probe's attention from the last prompt row = Hugging Face's eager attention of
    that row in a forward over only the rows the probe knows (the context before the span,
    the span, the last row) at their real positions: the span behind its own upstream
    prompt, so its spliced decode KV is the exact KV there, and the rows between the span
    and the last row (``mid``) are absent, as the probe leaves them out."""
    mid = tok("\n\nWhat does this say about the city? Answer:", add_special_tokens=False).input_ids
    head, span_ids = upstream.prompt, upstream.span_tokens
    prompt = head + span_ids + mid + [tok.eos_token_id]
    occ = SpanOccurrence(len(head), upstream, 0, len(span_ids))
    got = last_row_probe(ref, prompt, [occ])  # [L, S]

    known = head + span_ids + [prompt[-1]]
    pos = list(range(len(head) + len(span_ids))) + [len(prompt) - 1]
    with torch.no_grad():
        att = ref.model(
            torch.tensor([known]), position_ids=torch.tensor([pos]), output_attentions=True
        ).attentions  # L x [1, H, T, T]
    rows = slice(len(head), len(head) + len(span_ids))
    want = torch.stack([a[0, :, -1, rows].mean(0) for a in att]).float()
    assert got.shape == want.shape == (NUM_LAYERS, len(span_ids))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    # the rows between matter: a probe that saw them would differ
    with torch.no_grad():
        full = ref.model(torch.tensor([prompt]), output_attentions=True).attentions
    seen = torch.stack([a[0, :, -1, rows].mean(0) for a in full]).float()
    assert (seen - got).abs().max() > 1e-3


def test_probed_context_rule_charges_its_row_and_ranks_mass_times_attention(ref, tok, upstream):
    """``probe``: the highest ``mass * a ** probe`` (brute force from the context mass and
    the probe's attention over the upper half of the layers), one token fewer than the
    cap (the probe row is charged), and the reuse counts that row's layers."""
    prompt, span = relay_prompt(tok, upstream, "You are a terse editor who writes summaries.")
    base = RelayConfig(
        l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
        max_ratio=0.2, budget="request",
    )  # fmt: skip
    cfg = replace(base, probe=0.25)
    res = relay_prefill(ref, prompt, [span], cfg)
    n = span.length
    cap = int(0.2 * n)
    mass = record_context_mass(ref, upstream, 2)
    att = last_row_probe(ref, prompt, [span])[NUM_LAYERS // 2 :].mean(0)
    want = torch.zeros(n, dtype=torch.bool)
    want[(mass * att**0.25).topk(cap - 1).indices] = True
    assert torch.equal(res.selected_mask, want)
    assert res.reuse_rate == pytest.approx(
        1 - ((cap - 1) * NUM_LAYERS + NUM_LAYERS) / (n * NUM_LAYERS)
    )
    plain = relay_prefill(ref, prompt, [span], base)
    assert not torch.equal(plain.selected_mask, want)  # the probe changes the choice
    # a cap of one token leaves the probe no choice: it does not run, nothing is charged
    one = replace(cfg, max_ratio=1.5 / n)
    alone = relay_prefill(ref, prompt, [span], replace(one, probe=None))
    small = relay_prefill(ref, prompt, [span], one)
    assert small.selected == alone.selected == [1]
    assert torch.equal(small.selected_mask, alone.selected_mask)
    assert small.reuse_rate == alone.reuse_rate == pytest.approx(1 - 1 / n)
    assert RelayConfig.from_dict(cfg.to_dict()) == cfg and "probe" not in base.to_dict()
    for bad in (replace(base, budget="span"), replace(base, signal="value", l_ctx=None)):
        with pytest.raises(ValueError, match="probe"):
            replace(bad, probe=0.25)


def test_batched_decode_equals_single(ref, upstream):
    """A request that finishes early in a batch keeps exactly what it would get alone."""
    short = upstream.output[:20]
    alone = generate(ref, [upstream.prompt], 0, force=[short])[0]
    both = generate(ref, [upstream.prompt, upstream.prompt[:-3]], 0, force=[short, upstream.output])
    assert both[0].output == short and len(both[1].output) == len(upstream.output)
    for name in ("k", "v", "hidden", "influence"):
        torch.testing.assert_close(
            getattr(both[0], name), getattr(alone, name), atol=1e-4, rtol=1e-5
        )
