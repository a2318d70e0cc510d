"""LoRA under relay, end to end: a server with two random rank-8 adapters on every linear
of the embedded model (SGLang's torch_native LoRA backend, through the CPU pinning
stand-in ``SGLANG_RELAY_CPU_LORA=1``). The independent reference is the reference executor
on a copy of the model with adapter ``a`` merged into its weights (W + s B A).

Under adapter ``a``: the upstream equals the merged model's greedy decode; its relay,
batched with a request under adapter ``b``, computes what the reference computes (relay's
row subsets get each row's own adapter, ``runtime/forward/lora_rows.py``); the all-selected oracle
equals standard prefill. The span decoded under ``a`` is not reused under ``b`` or the base
model (per-adapter namespaces, the default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from relay_helpers import (
    ALL_SELECTED,
    CONTEXT_RULE_AT_2,
    DEVIATION_AT_3,
    assert_matches_reference,
    generate_ids,
    relay_info,
    running_server,
)

from sglang_relay.bench.models import LORA_TARGETS, merged_lora_model, random_lora_adapter
from sglang_relay.core import reference as R
from sglang_relay.core.config import RelayConfig
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

RANK = 8


@pytest.fixture(scope="module")
def lora_setup(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "Base-135M"  # the embedded weights under a name with no relay profile:
    base.mkdir()  # the server's rule is the test's (stream stored at layer 2)
    for f in Path(model_dir).iterdir():
        (base / f.name).symlink_to(f)
    model_dir = base
    pairs = {n: random_lora_adapter(model_dir, root / n, seed=s) for n, s in (("a", 1), ("b", 2))}
    merged = {n: merged_lora_model(model_dir, root / f"merged-{n}", p) for n, p in pairs.items()}
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192", "--enable-lora"]
    args += ["--lora-paths", f"a={root / 'a'}", f"b={root / 'b'}", "--lora-backend"]
    args += ["torch_native", "--max-loras-per-batch", "2", "--max-lora-rank", str(RANK)]
    args += ["--lora-target-modules", *LORA_TARGETS]
    env = {"SGLANG_RELAY_CPU_LORA": "1", "SGLANG_RELAY_CONFIG": json.dumps(CONTEXT_RULE_AT_2)}
    with running_server(args, env=env) as server:
        refs = {name: R.load_model(str(path)) for name, path in merged.items()}
        yield server, refs, settings_from_env(str(model_dir), env)


def test_relay_under_an_adapter_computes_what_the_merged_model_computes(lora_setup):
    server, refs, settings = lora_setup
    url = server.url
    head, tail = list(range(2000, 2023)), list(range(3000, 3011))
    runs = {}
    for name, first in (("a", 1000), ("b", 1100)):  # one upstream under each adapter
        up_ids = list(range(first, first + 40))
        upstream = generate_ids(url, up_ids, 96, lora_path=name)
        (record,) = R.generate(refs[name], [up_ids], len(upstream["output_ids"]))
        assert record.output == upstream["output_ids"]  # SGLang's LoRA == the merged weights
        runs[name] = (record, head + record.span_tokens + tail)

    # both relays in one extend batch (one batch request: the scheduler admits relaying
    # requests together). Each computes a subset of its own rows in most layers, so under
    # the full batch's LoRA info adapter a's segment would run on into b's rows
    option = {"method": "relay", "config": DEVIATION_AT_3}
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    body = {
        "input_ids": [runs["a"][1], runs["b"][1]],
        "lora_path": ["a", "b"],
        "sampling_params": [{**params, "custom_params": {"relay": option}}] * 2,
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    resp = requests.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    point = settings.point(settings.reuse_target, refs["a"].num_layers)  # the server's default
    cfg = RelayConfig.from_dict({**point.config.to_dict(), **DEVIATION_AT_3})
    for name, down in zip("ab", resp.json(), strict=True):
        record, prompt = runs[name]
        span = record.span_tokens
        assert down["meta_info"]["relay"]["fallback"] is None
        assert down["meta_info"]["relay"]["reused_tokens"] == len(span)  # its own adapter's
        occ = R.SpanOccurrence(len(head), record, 0, len(span))
        assert_matches_reference(down, R.relay_prefill(refs[name], prompt, [occ], cfg))
    span = runs["a"][0].span_tokens

    # the all-selected oracle under the adapter == standard prefill under the adapter
    every = {"method": "relay", "config": ALL_SELECTED}
    oracle_prompt = list(range(4000, 4017)) + span + list(range(3000, 3011))
    oracle = generate_ids(url, oracle_prompt, 6, every, return_logprob=True, lora_path="a")
    std = generate_ids(url, oracle_prompt, 6, "standard", return_logprob=True, lora_path="a")
    assert oracle["meta_info"]["relay"]["reused_tokens"] == len(span)
    assert oracle["output_ids"] == std["output_ids"]
    got = [x[0] for x in oracle["meta_info"]["output_token_logprobs"]]
    want = [x[0] for x in std["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)

    # the span was decoded under adapter a: neither b nor the base model reuses it
    for lora in ("b", None):
        extra = {"lora_path": lora} if lora else {}
        out = generate_ids(url, list(range(6000, 6010)) + span + tail, 2, **extra)
        assert out["meta_info"]["relay"]["reused_tokens"] == 0, (lora, out["meta_info"])
    info = relay_info(url)
    assert info.get("fallbacks", 0) == 0, info
