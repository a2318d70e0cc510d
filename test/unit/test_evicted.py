"""Spans the store dropped for room are remembered (runtime/cache/evicted.py): a prompt that
pastes one is told so. Checked against a brute-force rule on token tuples (a prompt hits
exactly when it holds, in the same namespace, one of the 32-token windows a dropped span
publishes: every 16th and its last), and through the span store's budget."""

from __future__ import annotations

import random

import torch

from sglang_relay.runtime.cache.evicted import EvictedSpans
from sglang_relay.runtime.cache.span_store import SpanStore

W, STRIDE = 32, 16


def _published(tokens: list[int]) -> set[tuple[int, ...]]:
    starts = set(range(0, len(tokens) - W + 1, STRIDE)) | {len(tokens) - W}
    return {tuple(tokens[s : s + W]) for s in starts}


def _holds(prompt: list[int], windows: set[tuple[int, ...]]) -> bool:
    return any(tuple(prompt[i : i + W]) in windows for i in range(len(prompt) - W + 1))


def test_a_prompt_hits_exactly_when_it_holds_a_published_window_of_its_namespace():
    rng = random.Random(0)
    spans = [[rng.randrange(1000) for _ in range(rng.randrange(40, 200))] for _ in range(6)]
    evicted = EvictedSpans()
    published: set[tuple[int, ...]] = set()
    for span in spans[:4]:
        evicted.add(span, ("ns", None))
        published |= _published(span)
    for trial in range(300):
        span = spans[trial % len(spans)]
        a = rng.randrange(len(span))
        b = rng.randrange(a, len(span) + 1)
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(0, 40))] + span[a:b]
        prompt += [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
        want = _holds(prompt, published)
        assert evicted.pasted(prompt, ("ns", None)) == want, (trial, a, b)
        assert not evicted.pasted(prompt, ("other", None))  # another tenant's never hit
    whole = spans[0]
    assert evicted.pasted([7, 8, *whole, 9], ("ns", None))  # a whole paste always hits
    assert not evicted.pasted(spans[5], ("ns", None)) or _holds(spans[5], published)


def test_the_memory_is_bounded_oldest_first_and_flushed_with_the_store():
    evicted = EvictedSpans(max_windows=8)
    old, new = list(range(100, 196)), list(range(500, 596))  # 96 tokens: 5 windows each
    evicted.add(old, None)
    assert not evicted.pasted(new, None)  # checked before `new` is added...
    evicted.add(new, None)  # ...and again after: the sorted copy is made anew
    assert len(evicted.windows) == 8 and evicted.pasted(new, None)
    assert not evicted.pasted(old[:48], None)  # its first windows were forgotten first
    store = SpanStore(min_match=W, max_tokens=100, release_slots=lambda s: None)

    def add(tokens):
        n = len(tokens)
        return store.add(
            tokens, torch.arange(n), torch.arange(n), torch.zeros(n, dtype=torch.int64), None
        )

    first = list(range(1000, 1060))
    add(first)
    add(list(range(2000, 2060)))  # over the budget: the first span is dropped for room
    assert len(store.spans) == 1 and store.evicted.pasted([1, *first, 2], None)
    assert store.stats()["evicted_spans_remembered"] == 1
    store.clear()  # flush_cache: forgotten too
    assert not store.evicted.pasted([1, *first, 2], None)


def test_the_sorted_copy_follows_every_add_and_forgetting_between_checks():
    """Spans added and forgotten in bursts of every size between checks (merged into the
    sorted copy, or sorted anew after more churn than the bound): a prompt hits exactly
    when it holds a window an LRU of window tuples, kept by hand, still holds."""
    rng = random.Random(1)
    evicted = EvictedSpans(max_windows=12)
    lru: dict[tuple[int, ...], None] = {}  # insertion-ordered: oldest first
    spans: list[list[int]] = []
    for step in range(400):
        for _ in range(rng.choice([0, 1, 1, 2, 5, 9])):
            span = rng.choice(spans) if spans and rng.random() < 0.3 else None
            span = span or [rng.randrange(50) for _ in range(rng.randrange(32, 90))]
            spans.append(span)
            evicted.add(span, None)
            starts = [*range(0, len(span) - W + 1, STRIDE)]
            starts += [len(span) - W] if (len(span) - W) % STRIDE else []
            for s in starts:
                lru.pop(tuple(span[s : s + W]), None)
                lru[tuple(span[s : s + W])] = None
            while len(lru) > 12:
                del lru[next(iter(lru))]
        span = rng.choice(spans) if spans else [0] * 40
        a = rng.randrange(len(span))
        prompt = [rng.randrange(50) for _ in range(3)] + span[a : a + rng.randrange(20, 90)]
        assert evicted.pasted(prompt, None) == _holds(prompt, set(lru)), step
