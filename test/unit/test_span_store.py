"""What the span store reports it keeps beside the KV (runtime/cache/span_store.py:
``span_meta_bytes`` in ``/get_server_info``), against a count by hand of the arrays a
recorded span holds per token: slots, positions, stamps (int64), context masses (float32,
when recorded), the index's copy of the tokens (int64), and a re-homed span's own pages."""

from __future__ import annotations

import torch

from sglang_relay.runtime.cache.span_store import SpanStore

INT64, FLOAT32 = 8, 4


def _store() -> SpanStore:
    return SpanStore(min_match=32, max_tokens=10_000, release_slots=lambda slots: None)


def _add(store: SpanStore, first: int, n: int, **kwargs) -> int | None:
    slots = torch.arange(first, first + n, dtype=torch.int64)
    return store.add(
        list(range(first, first + n)),
        slots,
        torch.arange(n, dtype=torch.int64) + 100,
        torch.full((n,), 7, dtype=torch.int64),
        None,
        **kwargs,
    )


def test_span_meta_bytes_count_every_array_a_span_keeps_per_token():
    store = _store()
    assert store.stats()["span_meta_bytes"] == 0
    assert _add(store, 1000, 40) is not None  # slots, positions, stamps, tokens
    plain = 40 * 4 * INT64
    assert store.stats()["span_meta_bytes"] == plain
    assert store.stats()["span_meta_bytes_per_token"] == 4 * INT64
    context = torch.rand(50)  # float32 masses
    owned = _add(store, 2000, 50, owned=True, context=context, held=64)  # held: a view
    assert owned is not None
    with_context = 50 * (4 * INT64 + FLOAT32)
    assert store.stats()["span_meta_bytes"] == plain + with_context
    pages = torch.arange(5000, 5064, dtype=torch.int64)  # re-homed into whole pages of its own
    store.rehome(owned, pages[:50], torch.full((50,), 9, dtype=torch.int64), pages)
    stats = store.stats()  # its slots now a view of its 64 pages: counted once, as 64
    assert stats["span_meta_bytes"] == plain + with_context - 50 * INT64 + 64 * INT64
    assert stats["span_meta_bytes_per_token"] == round(stats["span_meta_bytes"] / 90, 2)
    assert _add(store, 3000, 20) is None  # too short to match: not recorded, not counted
    assert store.release_owned(64) == 64  # the owned span dropped for room: back to plain
    assert store.stats()["span_meta_bytes"] == plain
    assert _add(store, 4000, 40) is not None and store.drop(1) == 0
    assert store.stats()["span_meta_bytes"] == plain  # the first span's gone, the new one's kept
    store.clear()
    assert store.stats()["span_meta_bytes"] == 0 and store.stats()["span_tokens"] == 0
