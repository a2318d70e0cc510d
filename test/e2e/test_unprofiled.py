"""A model without a relay profile: the server says so (log, get_server_info), stores no
hidden state, and relays with the unprofiled rule at reuse >= 0.80, computing what the
reference executor computes with that rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from relay_helpers import assert_matches_reference, relay_info, relay_one_upstream, running_server

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import UNPROFILED, UNPROFILED_REUSE, settings_from_env

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

        ref = R.load_model(str(other))
        cfg = settings.point(UNPROFILED_REUSE, ref.num_layers).config
        assert (cfg.l_start, cfg.l_det, cfg.first_k) == (0, 1, UNPROFILED.first_k)
        upstreams: dict = {}  # one upstream decode for both relays
        served, result, _ = relay_one_upstream(server.url, ref, cfg, None, upstreams)
        relay = served["meta_info"]["relay"]
        assert relay["reuse_rate"] >= UNPROFILED_REUSE
        assert relay["operating_point"]["rule"] == "deviation"
        assert_matches_reference(served, result)

        # a request for 0.95: the dense layer 0 would take two thirds of the budget, so the
        # server recomputes each span's first tokens instead, as the reference does
        fast = settings.point(0.95, ref.num_layers).config
        assert fast.signal == "none" and fast.l_det == 0
        served, result, span = relay_one_upstream(server.url, ref, fast, {"reuse": 0.95}, upstreams)
        relay = served["meta_info"]["relay"]
        assert relay["operating_point"]["rule"] == "first_k" and relay["reuse_rate"] >= 0.95
        assert relay["selected_tokens"] == int(fast.max_ratio * len(span)) == sum(result.selected)
        assert_matches_reference(served, result)
