"""Fuzzed relay configs (what --relay-config, profiles and per-request options carry): a
config is either valid everywhere or refused with a ValueError naming the field."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_relay.core.config import RelayConfig

FIELDS = [
    "method", "l_start", "l_det", "l_end", "tau_dev", "tau_inf", "top_ratio", "max_ratio",
    "first_k", "l_suf", "signal", "min_span", "l_ctx", "budget",
]  # fmt: skip
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.sampled_from([10**400, -(10**400), 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["relay", "epic", "naive", "cacheblend", "standard", "value", "key"]),
    st.sampled_from(["context", "none", "span", "request"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
configs = st.dictionaries(st.sampled_from(FIELDS + ["l_strat", ""]), values, max_size=6)


@settings(max_examples=400, deadline=None)
@given(configs)
def test_any_config_is_valid_or_a_value_error(data):
    try:
        cfg = RelayConfig.from_dict(data)
    except ValueError:
        return
    for method in ("naive", "cacheblend", "epic", "relay"):
        try:
            sched = cfg.for_method(method).schedule(30)
        except ValueError:
            continue
        assert 0 <= sched.l_start <= sched.l_det <= sched.l_end + 1 <= 30
        assert 0.0 <= sched.reuse_rate(100, 10) <= 1.0
