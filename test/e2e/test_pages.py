"""Pages of more than one token (``--page-size 16`` and ``64``): SGLang's paged allocator
frees whole pages, so the span store owns the whole pages a relayed request's output is
in (its first page's prompt tail and its last page's rest come along), and the last
partial page of any other stored output (the tree keeps whole pages only).

On each page size, with chunked prefill (256-token chunks: the relayed prompts fit one, as
the reference executor prefills them; the 260-token fillers are cut in two; at page 64
also ``--enable-mixed-chunk``, with a decode running while the fillers prefill): the relay of
an upstream equals the reference executor's; the relayed request's own output becomes an
owned span holding whole pages (the pool's accounting adds up to its total while it is
held); that owned span relays into a third prompt (its all-selected oracle equals
standard prefill); then unrelated requests fill the pool until SGLang needs the owned
pages back: they are released first, nothing leaks, and the server keeps serving correct
output (the oracle again, after the eviction)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from relay_helpers import (
    assert_all_selected_equals_standard,
    assert_matches_reference,
    generate_ids,
    relay_info,
    relay_one_upstream,
    running_server,
)

from sglang_relay.core import reference as R
from sglang_relay.runtime.config.settings import settings_from_env

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def _pool_adds_up(url: str) -> dict:
    info = relay_info(url)
    pool = info["pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["total"], pool
    return info


@pytest.mark.parametrize(
    "page, chunk, mixed",
    [pytest.param(16, 256, False, marks=pytest.mark.full), (64, 256, True)],  # 64: CI tier
)
def test_relay_with_pages_owns_whole_pages(page, chunk, mixed, model_dir):
    args = ["--model-path", str(model_dir), "--page-size", str(page), "--max-total-tokens", "2048"]
    args += ["--chunked-prefill-size", str(chunk), "--relay-span-tokens", "1024"]
    args += ["--enable-mixed-chunk"] if mixed else []
    with running_server(args) as s:
        ref = R.load_model(str(model_dir))
        settings = settings_from_env(str(model_dir), {})
        assert settings.reuse_target is None  # the shipped profile's own config, as served
        cfg = settings.config
        # the upstream's output is in the tree but for its last partial page, which the
        # store holds: the span relays whole (relay_one_upstream checks it)
        served, result, span = relay_one_upstream(s.url, ref, cfg)
        assert_matches_reference(served, result)
        before = _pool_adds_up(s.url)["owned_span_tokens"]
        assert 0 < before <= page and relay_info(s.url)["held_tail_pages"] >= 1

        # a relayed request with a long output: its output is owned, in whole pages
        prompt = list(range(2000, 2021)) + span + list(range(3000, 3013))
        down = generate_ids(s.url, prompt, 70)
        assert down["meta_info"]["relay"]["reused_tokens"] == len(span)
        info = _pool_adds_up(s.url)
        owned = info["owned_span_tokens"]
        start, stored = len(prompt), 69  # the last sampled token has no KV
        lo, hi = start // page * page, -(-(start + stored) // page) * page
        assert owned - before == hi - lo > stored  # whole pages: more slots than tokens

        # the owned span relays; with every token recomputed it equals standard prefill
        assert_all_selected_equals_standard(s.url, down["output_ids"][:stored], n=6)

        # unrelated prompts fill the pool: SGLang needs room, owned pages go back first (with
        # mixed chunk, a decode runs during the first half: the fillers' chunks carry its
        # rows; its own stored tail page is then given back by the second half)
        with cf.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(generate_ids, s.url, list(range(9000, 9040)), 240) if mixed else None
            time.sleep(1.0 if mixed else 0.0)
            assert busy is None or not busy.done(), "the decode ended before the fillers began"
            for i in range(12):
                generate_ids(s.url, list(range(5000 + 300 * i, 5000 + 300 * i + 260)), 4)
                if i == 5 and busy is not None:
                    busy.result()
        info = _pool_adds_up(s.url)
        assert (info.get("mixed_batches", 0) > 0) == mixed  # mixing really happened
        assert info["owned_spans_released_for_room"] >= 1
        assert info["owned_span_tokens"] == 0
        # still correct after the pages were given back and reused
        assert_all_selected_equals_standard(s.url, span, n=6, relayed=False)
        _pool_adds_up(s.url)
