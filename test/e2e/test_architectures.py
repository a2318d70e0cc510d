"""Architectures beyond the embedded Llama, served end to end on random weights (no
checkpoint of them runs here; ``sglang_relay.bench.models.random_model``): one test per
adapter file in ``runtime/models/adapters``. Qwen2 (q/k/v biases, no native prepare), Qwen3
(per-head q/k norms, a head dim other than hidden / heads, its own decoder forward), Mistral
(SGLang's Llama classes under another architecture name) and Phi-3 (the same classes
loading fused qkv / gate_up checkpoint weights), and Qwen3-MoE (Qwen3's attention through
SGLang's unfused q/k-norm + RoPE sequence, a sparse block of 8 experts, top 2, in every
layer; also under ``--tp 2``, where each rank holds half of every expert and the loop sums
the experts' partial outputs), Qwen2-MoE (Qwen2's attention with a routed block plus a
sigmoid-gated shared expert), Mixtral (Mistral's attention, the sparse block under
``block_sparse_moe``, called without the forward batch) and GLM-4.5 (partial rotary: half
of each 64-dim head rotates, under YaRN; a sigmoid-routed block with a shared expert after
a dense first layer), MiniMax-M2 (partial rotary, 64 of 128 dims; one q/k RMSNorm over all
heads, its sums reduced across tensor-parallel ranks; sigmoid routing with a correction
bias), gpt-oss (sliding windows and sinks), Gemma 3 (local and global RoPE tables, four
norms), DeepSeek-V3 and Kimi-K2 (MLA: one latent KV row a token, attended absorbed; only
its rotary part moves in a splice; under YaRN; grouped sigmoid routing with shared
experts).

On each: the server's greedy upstream equals the Hugging Face reference executor's (SGLang
serves the random model as Hugging Face computes it); the relay of its output computes
what the reference computes with the server's rule (context masses at layer 2 from a
stream captured in decode, last-row probe) and with a per-request deviation rule (fresh
K/V at layer 3 from the stored stream); the all-selected oracle equals standard prefill."""

from __future__ import annotations

import json

import pytest
from relay_helpers import (
    CONTEXT_RULE_AT_2,
    DEVIATION_AT_3,
    assert_all_selected_equals_standard,
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
)

from sglang_relay.core import reference as R
from sglang_relay.core.config import RelayConfig
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

# gpt-oss: SGLang's hybrid SWA pool off (relay refuses it: it frees window layers' KV) and
# its Triton fused-MoE path (SGLang picks triton_kernel where available, whose weight
# layout the CPU's native MoE does not read)
ARCH_ARGS = {"gpt_oss": ["--disable-hybrid-swa-memory", "--moe-runner-backend", "triton"]}


@pytest.mark.parametrize(
    "arch, tp",
    [
        # CI (`make test`) serves four MoE adapters (Qwen3-MoE: Qwen3's per-head q/k norms
        # and a head dim other than hidden / heads, router, top-k, fused experts; GLM-4.5:
        # partial rotary under YaRN, q/k norms, a shared expert, a dense first layer;
        # gpt-oss: windows and sinks; DeepSeek-V3: MLA); dense Llama is every other e2e
        # test's, TP is test_tp.py's. The full tier runs every adapter: dense Qwen3 (its own
        # decoder forward; in the full tier since CI's time passed 25 minutes), Qwen3-MoE,
        # GLM-4.5 and MiniMax-M2 (its q/k norm's sums all-reduced) at tp 2, Qwen2,
        # Qwen2-MoE (shared expert), Mixtral, Mistral and Phi-3. Each adapter's reference
        # executor == its Hugging Face forward in CI (test_anatomy.py).
        pytest.param("qwen2", 1, marks=pytest.mark.full),
        pytest.param("qwen3", 1, marks=pytest.mark.full),
        ("qwen3_moe", 1),
        ("glm4_moe", 1),
        pytest.param("glm4_moe", 2, marks=pytest.mark.full),
        pytest.param("minimax_m2", 1, marks=pytest.mark.full),
        ("gpt_oss", 1),
        pytest.param("gemma3", 1, marks=pytest.mark.full),
        ("deepseek_v3", 1),
        pytest.param("deepseek_v3", 2, marks=pytest.mark.full),
        pytest.param("kimi_k2", 1, marks=pytest.mark.full),
        pytest.param("kimi_k2", 2, marks=pytest.mark.full),
        pytest.param("gpt_oss", 2, marks=pytest.mark.full),
        pytest.param("minimax_m2", 2, marks=pytest.mark.full),
        pytest.param("qwen3_moe", 2, marks=pytest.mark.full),
        pytest.param("qwen2_moe", 1, marks=pytest.mark.full),
        pytest.param("mixtral", 1, marks=pytest.mark.full),
        pytest.param("mistral", 1, marks=pytest.mark.full),
        pytest.param("phi3", 1, marks=pytest.mark.full),
    ],
)
def test_relay_on_another_architecture_computes_what_the_reference_computes(
    arch, tp, model_dir, tmp_path_factory
):
    from sglang_relay.bench.models import random_model

    path = random_model(arch, tmp_path_factory.mktemp(arch) / f"Random-{arch}", model_dir)
    env = {"SGLANG_RELAY_CONFIG": json.dumps(CONTEXT_RULE_AT_2)}
    settings = settings_from_env(str(path), env)
    args = ["--model-path", str(path), "--max-total-tokens", "8192", "--tp", str(tp)]
    args += ARCH_ARGS.get(arch, [])
    with running_server(args, env=env) as s:
        assert relay_info(s.url)["capture_layer"] == 2
        assert relay_info(s.url)["tp_size"] == tp
        ref = R.load_model(str(path))
        point = settings.point(settings.reuse_target, ref.num_layers)
        served, result, span = relay_one_upstream(s.url, ref, point.config)
        assert served["meta_info"]["relay"]["probe"] == "last_row"
        assert_matches_reference(served, result)
        assert R.greedy_continue(ref, result, 4) == served["output_ids"]

        head, tail = list(range(2100, 2117)), list(range(3000, 3011))
        prompt = head + span + tail
        option = {"method": "relay", "config": DEVIATION_AT_3}
        down = generate_ids(s.url, prompt, 2, option, return_logprob=True, top_logprobs_num=5)
        assert down["meta_info"]["relay"]["reused_tokens"] == len(span)
        (record,) = R.generate(ref, [list(range(1000, 1040))], 96)  # relay_one_upstream's
        assert record.span_tokens == span
        occ = R.SpanOccurrence(len(head), record, 0, len(span))
        deviation = RelayConfig.from_dict({**point.config.to_dict(), **DEVIATION_AT_3})
        assert_matches_reference(down, R.relay_prefill(ref, prompt, [occ], deviation))

        assert_all_selected_equals_standard(s.url, span)
        info = relay_info(s.url)
        assert info.get("fallbacks", 0) == 0
        if tp > 1:  # the ranks agreed on every plan (the experts' partial sums all-reduced)
            assert info["tp_plan_checks"] >= 3 and info.get("tp_plan_mismatches", 0) == 0
        pool = info["pool"]
        assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"]
