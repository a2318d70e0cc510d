"""Relay on a server that decodes speculatively (``--speculative-algorithm NGRAM`` and
``EAGLE``).

NGRAM drafts from an n-gram corpus and verifies the drafts in one target forward per step
(``TARGET_VERIFY``: tree attention over the drafts); the accepted tokens' KV is compacted to
the front of each verify window by the KV pool's ``move_kv_cache``, outside any forward.
On the CPU, SGLang runs it with the stand-in's torch versions of sgl-kernel's CPU ops and
tree-verify attention (runtime/standin/cpu_spec.py). Here, on a real server:

* greedy speculative decoding gives what the reference executor's plain greedy decode
  gives, with drafts really accepted and moved;
* an output decoded speculatively relays whole into the next prompt, and the relay equals
  the reference executor's relay of that prompt (its span's hidden rows and stamps came
  from verify forwards and were carried by the moves: a row left behind by a move would
  change the selection and the logprobs);
* EAGLE (three draft steps of one token each, a one-layer draft with random weights:
  SGLang's ``--speculative-draft-load-format dummy``): its draft prefills every row of a
  relay extend from the hidden rows relay returns and drafts each step (the stand-in's
  multi-step draft decode, runtime/standin/cpu_eagle.py); greedy tokens are the reference
  executor's, and a span it decoded relays as the reference computes. A random draft's
  drafts are rejected (acceptance 0): accepted drafts are what the NGRAM tests cover, with
  the same verify forward; with one draft token per step there is no KV move;
* the options relay does not serve with speculation are refused (unit:
  test/unit/test_server_options.py, test/unit/test_launch.py)."""

from __future__ import annotations

import pytest
from relay_helpers import (
    assert_matches_reference,
    chat,
    generate_ids,
    relay_info,
    running_server,
    server_fixture,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]

HEAD, TAIL = list(range(2100, 2123)), list(range(3100, 3111))


spec_server = server_fixture("--speculative-algorithm", "NGRAM")


@pytest.fixture(scope="module")
def eagle_server(model_dir, tmp_path_factory):
    import json

    draft = tmp_path_factory.mktemp("eagle-draft")
    config = json.loads((model_dir / "config.json").read_text())
    # SGLang's EAGLE draft for Llama: one decoder layer over [embedding, target hidden]; it
    # shares the target's embedding and head (a tied head would have no weight of its own)
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    config["tie_word_embeddings"] = False
    (draft / "config.json").write_text(json.dumps(config))
    args = ["--model-path", str(model_dir), "--max-total-tokens", "8192"]
    eagle = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
             "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    with running_server([*args, *eagle]) as server:
        yield server


def _upstream_ids(tok) -> list[int]:
    # a list the model writes with repeated n-grams: NGRAM's drafts get accepted
    text = chat(tok, "Writer.", "List the steps to bake bread, numbered, in detail.")
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_span_decoded_speculatively_relays_as_the_reference_computes(spec_server, model_dir, tok):
    model = str(model_dir)
    up_ids = _upstream_ids(tok)
    before = relay_info(spec_server.url)
    upstream = generate_ids(spec_server.url, up_ids, 128)
    meta = upstream["meta_info"]
    # drafts were verified and accepted (more than one token per verify step) ...
    assert meta["spec_verify_ct"] > 0 and meta["spec_num_correct_drafts"] > 0, meta
    assert meta["spec_accept_length"] > 1.5, meta
    after = relay_info(spec_server.url)
    # ... and the pool's compaction ran, each move followed by relay's side data
    assert after["kv_moves_followed"] and after["kv_moves"] > before.get("kv_moves", 0), after
    # some moves were real copies (a branch's draft moved to the front), not the identity
    assert after["kv_moved_slots"] > before.get("kv_moved_slots", 0), after
    _relays_as_the_reference_computes(spec_server.url, model, up_ids, upstream, 128)


def _relays_as_the_reference_computes(url, model, up_ids, upstream, tokens) -> None:
    ref = R.load_model(model)
    record = R.generate(ref, [up_ids], tokens)[0]
    assert record.output == upstream["output_ids"]  # speculation changed no token
    span = record.span_tokens
    prompt = HEAD + span + TAIL
    served = generate_ids(url, prompt, 4, return_logprob=True, top_logprobs_num=5)
    info = served["meta_info"]["relay"]
    assert info["fallback"] is None and info["reused_tokens"] == len(span), info
    cfg = settings_from_env(model, {}).config
    occ = R.SpanOccurrence(len(HEAD), record, 0, len(span))
    assert_matches_reference(served, R.relay_prefill(ref, prompt, [occ], cfg))
    # the downstream decodes speculatively too, and its greedy tokens are standard's
    std = generate_ids(url, prompt, 4, "standard")
    assert served["output_ids"] == std["output_ids"]


def test_speculative_batches_decode_what_plain_greedy_decodes(spec_server, model_dir, tok):
    """Three requests verified in one batch (windows of different committed lengths, moves
    of several requests at once) give the reference executor's greedy tokens."""
    import concurrent.futures as cf

    prompts = [_upstream_ids(tok), list(range(1100, 1140)), list(range(1500, 1517)) * 3]
    with cf.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: generate_ids(spec_server.url, p, 48), prompts))
    ref = R.load_model(str(model_dir))
    want = [r.output for r in R.generate(ref, prompts, 48)]
    assert [o["output_ids"] for o in outs] == want


def test_eagle_decodes_plain_greedy_and_its_spans_relay_as_the_reference_computes(
    eagle_server, model_dir, tok
):
    import concurrent.futures as cf

    url = eagle_server.url
    up_ids = _upstream_ids(tok)
    prompts = [up_ids, list(range(1100, 1140)), list(range(1500, 1517)) * 3]
    with cf.ThreadPoolExecutor(3) as pool:  # verified in one batch
        outs = list(pool.map(lambda p: generate_ids(url, p, 48), prompts))
    ref = R.load_model(str(model_dir))
    assert [o["output_ids"] for o in outs] == [r.output for r in R.generate(ref, prompts, 48)]
    meta = outs[0]["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_num_proposed_drafts"] > 0, meta
    upstream = generate_ids(url, up_ids, 64)
    _relays_as_the_reference_computes(url, str(model_dir), up_ids, upstream, 64)
