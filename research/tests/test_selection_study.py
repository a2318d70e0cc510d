"""research/studies/selection_study.py's KL oracle: its differentiable forward must be the exact-KV
oracle of the reference executor (and the full prefill with every token exact), and its
greedy choice must spend exactly its budget and pick a token that brute force ranks among
the best. Its probe-variant table's baseline row must be the probe rule the reference
(and so the server) runs. First 6 layers of the embedded model, fp32."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.core.operating import at_target
from sglang_relay.core.reference import (
    SpanOccurrence,
    exact_kv_prefill,
    exact_prefill,
    fidelity,
    first_token_kl,
    generate,
    load_model,
    relay_prefill,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
import selection_study as study  # noqa: E402

pytestmark = pytest.mark.model

TEXT = (
    "The bridge was finished in the spring, after four years of work by two hundred men. "
    "Its stone arches carried the road over the river, and the toll paid for its upkeep."
)


@pytest.fixture(scope="module")
def case(model_dir):
    from transformers import AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = load_model(str(model_dir), num_layers=6)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        story = ids(TEXT)
        upstream = ids("Write about the old bridge.\n")
        (rec,) = generate(ref, [upstream], 0, force=[story + [tok.eos_token_id]])
        head, tail = ids("Review the following report.\n\n"), ids("\n\nWhat is wrong?")
        prompt = head + story + tail
        span = SpanOccurrence(len(head), rec, 0, len(story))
        with torch.inference_mode():
            exact = exact_prefill(ref, prompt)
        yield ref, prompt, [span], exact
    finally:
        torch.set_num_threads(threads)


def test_mixed_forward_is_the_exact_kv_oracle_at_0_1_mixes(case):
    ref, prompt, spans, exact = case
    n = spans[0].length
    gen = torch.Generator().manual_seed(0)
    rows = torch.arange(spans[0].prompt_start, spans[0].prompt_start + n)
    with torch.inference_mode():
        cache = study.ref_exec.KVCache.empty(ref, len(prompt))
        study.ref_exec._splice(ref, cache, spans, rows)
        base = (cache.k[:, rows], cache.v[:, rows])
        target = (exact.cache.k[:, rows], exact.cache.v[:, rows])
        for sel in (torch.zeros(n, dtype=torch.bool), torch.rand(n, generator=gen) < 0.3):
            want = exact_kv_prefill(ref, prompt, spans, exact, sel).logits[0]
            mix = sel.float().to(ref.device)
            got = study.mixed_first_logits(ref, prompt, rows, base, target, mix)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # every span token exact: the full prefill itself
        every = torch.ones(n, device=ref.device)
        got = study.mixed_first_logits(ref, prompt, rows, base, target, every)
        torch.testing.assert_close(got, exact.logits[0], atol=1e-4, rtol=0)


def test_greedy_choice_spends_the_budget_and_brute_force_ranks_its_token_high(case):
    ref, prompt, spans, exact = case
    n = spans[0].length

    def kl(sel: torch.Tensor) -> float:
        fixed = exact_kv_prefill(ref, prompt, spans, exact, sel)
        return first_token_kl(exact.logits[0], fixed.logits[0])

    with torch.inference_mode():
        for count in (1, 5):
            chosen = study.kl_oracle_selection(ref, prompt, spans, exact, count, rounds=3)
            assert chosen.dtype == torch.bool and int(chosen.sum()) == count
        # one token: every single-token choice by brute force; the gradient's pick must be
        # among the best tenth (a first-order choice, so not always the very best)
        pick = study.kl_oracle_selection(ref, prompt, spans, exact, 1, rounds=1)
        singles = torch.tensor([kl(torch.arange(n) == i) for i in range(n)])
        better = int((singles < kl(pick) - 1e-12).sum())
        assert better <= max(1, n // 10), (better, n)


def test_probe_variants_baseline_row_is_the_probe_rule_the_reference_runs(case):
    """The table's "shipped" row scores, caps and recomputes as ``relay_prefill`` does with
    the probe rule at the target: same first-token KL; a rule without the probe differs."""
    ref, prompt, spans, exact = case
    cfg = RelayConfig(
        l_start=0, l_det=0, l_end=-1, tau_dev=0.0, l_suf=0, first_k=0, signal="context",
        l_ctx=3, budget="request", max_ratio=0.2, probe=0.25,
    )  # fmt: skip
    cont = exact.logits[0].argmax().reshape(1).tolist()  # one forced-free token: KL only
    relay = SimpleNamespace(prompt=prompt, spans=spans, continuation=cont)
    with torch.inference_mode():
        rows = study.probe_variants(ref, relay, [0.8], cfg)

        def kl(rule: RelayConfig) -> float:
            got = relay_prefill(ref, prompt, spans, at_target(rule, ref.num_layers, 0.8))
            return fidelity(exact.logits, got.logits, cont)["first_token_kl"]

        want = kl(cfg)
        without = kl(RelayConfig(**{**cfg.to_dict(), "probe": None}))
    assert rows["0.80|probe^0.25 (shipped)"] == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert abs(without - want) > 1e-6  # the probe changes the choice here: the check can tell
