"""Opting out and relay keys on the default (``shared``) scope; scope ``key`` is tested in
test_key_scope_server.py."""

from __future__ import annotations

import pytest
from relay_helpers import scoped_downstream as _down
from relay_helpers import scoped_upstream as _up

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_opt_out_stores_nothing_unless_asked_and_scopes_are_isolated(server):
    """Default scope: an opted-out upstream stores no span (unless ``store: true``), and a
    request's relayed output is bit-identical whether or not another namespace stored the
    same text."""
    url = server.url
    out = _up(url, "optout", "off")
    assert _down(url, out[:-1], "optout", None, 1)["meta_info"]["relay"]["reused_tokens"] == 0
    out = _up(url, "optout", {"method": "off", "store": True})
    assert _down(url, out[:-1], "optout", None, 2)["meta_info"]["relay"]["reused_tokens"] > 0

    out = _up(url, None, {"key": "team-a"})
    _down(url, out[:-1], None, {"key": "team-a"}, 3)  # warm the prompt's exact prefix
    first = _down(url, out[:-1], None, {"key": "team-a"}, 3)
    assert first["meta_info"]["relay"]["reused_tokens"] > 0
    # team b stored nothing yet (another prompt: a plain prefill of this one would put its
    # exact KV in SGLang's radix tree, which relay keys do not partition; cache_salt does)
    assert (
        _down(url, out[:-1], None, {"key": "team-b"}, 4)["meta_info"]["relay"]["reused_tokens"] == 0
    )
    _up(url, None, {"key": "team-b"})  # now team b stores the same text
    again = _down(url, out[:-1], None, {"key": "team-a"}, 3)

    def relay_of(out):  # all but the server's timing
        return {k: v for k, v in out["meta_info"]["relay"].items() if k != "ttft_s"}

    assert relay_of(again) == relay_of(first)
    assert again["output_ids"] == first["output_ids"]
    lp = [x[0] for x in again["meta_info"]["output_token_logprobs"]]
    assert lp == [x[0] for x in first["meta_info"]["output_token_logprobs"]]
