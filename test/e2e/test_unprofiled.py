"""A model without a relay profile: the server says so (log, get_server_info), stores no
hidden state, and relays with the unprofiled rule at reuse >= 0.80, computing what the
reference executor computes with that rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from relay_helpers import generate_ids, relay_info, running_server

from sglang_relay.core import reference as R
from sglang_relay.runtime.settings import UNPROFILED, UNPROFILED_REUSE, settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_unprofiled_model(model_dir, tmp_path):
    other = tmp_path / "Unprofiled-Llama-135M"  # the same weights under a name with no profile
    other.mkdir()
    for f in Path(model_dir).iterdir():
        (other / f.name).symlink_to(f)
    settings = settings_from_env(str(other), {})
    assert not settings.profiled
    with running_server(["--model-path", str(other), "--max-total-tokens", "8192"]) as server:
        info = relay_info(server.url)
        assert info["profiled"] is False and info["profile"] is None
        assert info["reuse_target"] == UNPROFILED_REUSE and info["capture_layer"] is None
        assert info["side_bytes"] < 1024 * 1024  # stamps only, no hidden-state store
        assert "no relay profile for" in Path(server.log_path).read_text()

        up_ids = list(range(1000, 1040))
        upstream = generate_ids(server.url, up_ids, 96)
        ref = R.load_model(str(other))
        record = R.generate(ref, [up_ids], len(upstream["output_ids"]))[0]
        assert record.output == upstream["output_ids"]
        span = record.span_tokens
        head, tail = list(range(2000, 2023)), list(range(3000, 3011))
        prompt = head + span + tail
        served = generate_ids(server.url, prompt, 4, return_logprob=True, top_logprobs_num=5)
        relay = served["meta_info"]["relay"]
        assert relay["reused_tokens"] == len(span) and relay["reuse_rate"] >= UNPROFILED_REUSE
        assert relay["operating_point"]["rule"] == "deviation"

        cfg = settings.point(UNPROFILED_REUSE, ref.num_layers).config
        assert (cfg.l_start, cfg.l_det, cfg.first_k) == (0, 1, UNPROFILED.first_k)
        occ = R.SpanOccurrence(len(head), record, 0, len(span))
        result = R.relay_prefill(ref, prompt, [occ], cfg)
        assert sum(result.selected) == pytest.approx(relay["selected_tokens"], abs=1)
        ref_lp = result.logits[-1].double().log_softmax(-1)
        for lp, tid, _ in served["meta_info"]["output_top_logprobs"][0]:
            assert math.isclose(lp, float(ref_lp[tid]), abs_tol=2e-3), (tid, lp)
