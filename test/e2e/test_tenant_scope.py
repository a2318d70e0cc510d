"""A relay server whose tenants come from the operator's header (``--relay-scope
header:X-Tenant``) and whose clients see no relay field (``--relay-meta off``): two tenants
sending the same body key never share a span, a request without the header neither stores
nor reuses, and no response carries ``meta_info.relay``. The oracle is the server's own
relayed-token counter (``/get_server_info``), which a client of this server cannot read
from its responses."""

from __future__ import annotations

import pytest
from relay_helpers import SCOPE_UP_IDS, SCOPE_UP_TOKENS, generate_ids, relay_info, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.model]

KEY = {"method": "relay", "key": "team"}  # the same body key for every tenant


def test_tenants_from_the_operator_header_never_meet(model_dir):
    env = {"SGLANG_RELAY_SCOPE": "header:X-Tenant", "SGLANG_RELAY_META": "off"}
    with running_server(["--model-path", str(model_dir)], env=env) as server:
        url = server.url

        def ask(ids, n, tenant):
            headers = {"X-Tenant": tenant} if tenant else None
            out = generate_ids(url, ids, n, KEY, headers=headers, return_logprob=True)
            assert "relay" not in out["meta_info"], out["meta_info"]  # --relay-meta off
            return out

        def relayed():
            return relay_info(url).get("relayed_tokens", 0)

        span = ask(SCOPE_UP_IDS, SCOPE_UP_TOKENS, "acme")["output_ids"][:-1]

        def prompt(tag):  # a first token of its own: no prefix-cache hit between the asks
            return [2000 + tag, *range(2001, 2020), *span, *range(3000, 3009)]

        before = relayed()
        other = ask(prompt(1), 4, "globex")  # same body key, another tenant: nothing reused
        assert relayed() == before
        ask(prompt(2), 4, None)  # no header: no tenant, no spans
        assert relayed() == before
        ask(prompt(3), 4, "acme")  # the tenant that decoded it relays it
        assert relayed() == before + len(span)
        std = generate_ids(url, prompt(1), 4, "standard", headers={"X-Tenant": "globex"})
        assert other["output_ids"] == std["output_ids"]
        info = relay_info(url)  # the only fallbacks: requests without a tenant
        assert info.get("fallbacks", 0) == info.get("fallback_no_relay_key", 0)
