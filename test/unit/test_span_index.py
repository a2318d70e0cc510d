"""SpanIndex: exact unit cases plus a property test against a brute-force greedy matcher."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_relay.core import span_index as span_index_module
from sglang_relay.core.span_index import SpanIndex, SpanMatch

VOCAB = 49152


def rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def fresh(k: int, n: int) -> list[int]:
    """``n`` token ids outside the random vocabulary (never equal to any stored token)."""
    return [VOCAB + 1000 * k + i for i in range(n)]


def reference_find(
    stored: Sequence[tuple[int, Sequence[int], Hashable]],
    prompt: Sequence[int],
    namespace: Hashable,
    min_match: int,
    start: int = 0,
    end: int | None = None,
) -> list[SpanMatch]:
    """Brute force: ``stored`` is in add order; greedy left to right, longest match at each
    position, ties to the most recently added span, then the smallest offset in the span."""
    stop = len(prompt) if end is None else min(end, len(prompt))
    cands = [
        (order, sid, list(toks)) for order, (sid, toks, ns) in enumerate(stored) if ns == namespace
    ]
    out: list[SpanMatch] = []
    p = start
    while p < stop:
        best = None  # ((length, order, -offset), span_id)
        for order, sid, toks in cands:
            for s in range(len(toks)):
                n = 0
                while p + n < stop and s + n < len(toks) and prompt[p + n] == toks[s + n]:
                    n += 1
                if n >= min_match and (best is None or (n, order, -s) > best[0]):
                    best = ((n, order, -s), sid)
        if best is None:
            p += 1
            continue
        (n, _, neg_s), sid = best
        out.append(SpanMatch(p, sid, -neg_s, n))
        p += n
    return out


def assert_valid(index: SpanIndex, prompt: Sequence[int], matches: list[SpanMatch]) -> None:
    """Every match is verified token by token, long enough, sorted and non-overlapping."""
    prev_end = -1
    for m in matches:
        assert m.length >= index.min_match
        assert m.prompt_start >= prev_end
        span = index.tokens(m.span_id)
        assert 0 <= m.span_start and m.span_start + m.length <= len(span)
        got = list(prompt[m.prompt_start : m.prompt_start + m.length])
        assert got == span[m.span_start : m.span_start + m.length].tolist()
        prev_end = m.prompt_start + m.length


def total_bucket_entries(index: SpanIndex) -> int:
    """Entries actually held by the private hash tables (to check that num_entries is honest)."""
    return sum(
        1 if isinstance(v, int) else len(v)
        for table in index._tables.values()
        for v in table.values()
    )


# --------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("min_match", "anchor"),
    [(16, 0), (16, -1), (14, 8), (1, 2), (0, 1), (30, 16)],
)
def test_bad_constructor_args(min_match: int, anchor: int) -> None:
    with pytest.raises(ValueError, match="anchor|min_match"):
        SpanIndex(min_match=min_match, anchor=anchor)


@pytest.mark.parametrize(("min_match", "anchor"), [(16.0, 8), (16, 8.0), (True, 1), ("16", 8)])
def test_non_int_constructor_args(min_match: object, anchor: object) -> None:
    with pytest.raises(TypeError):
        SpanIndex(min_match=min_match, anchor=anchor)  # type: ignore[arg-type]


def test_boundary_constructor_args_accepted() -> None:
    ix = SpanIndex(min_match=15, anchor=8)  # 2 * anchor - 1 is the smallest lossless value
    assert (ix.min_match, ix.anchor) == (15, 8)
    assert SpanIndex(min_match=1, anchor=1).min_match == 1
    assert (SpanIndex().min_match, SpanIndex().anchor) == (16, 8)


# --------------------------------------------------------------------------- add / remove


def test_duplicate_id_and_readd() -> None:
    rng = np.random.default_rng(1)
    ix = SpanIndex()
    ix.add(7, rand_tokens(rng, 40))
    with pytest.raises(ValueError, match="already"):
        ix.add(7, rand_tokens(rng, 40))
    assert len(ix) == 1 and 7 in ix and 8 not in ix
    new = rand_tokens(rng, 40)
    assert ix.remove(7) is True
    ix.add(7, new)
    assert ix.tokens(7).tolist() == new


def test_tokens_are_a_read_only_copy() -> None:
    toks = list(range(100, 140))
    ix = SpanIndex()
    ix.add(1, toks)
    toks[0] = -5
    stored = ix.tokens(1)
    assert stored.dtype == np.int64 and stored.tolist() == list(range(100, 140))
    with pytest.raises(ValueError):
        stored[0] = 3
    with pytest.raises(KeyError):
        ix.tokens(2)


def test_bad_tokens_rejected_without_side_effects() -> None:
    ix = SpanIndex()
    with pytest.raises(ValueError):
        ix.add(1, [[1, 2], [3, 4]])
    with pytest.raises(TypeError):
        ix.add(1, np.arange(20, dtype=np.float32))
    with pytest.raises(TypeError):
        ix.add(1, list(range(20)), namespace=["unhashable"])
    assert len(ix) == 0 and ix.num_entries == 0


def test_remove_makes_unfindable_and_frees_entries() -> None:
    rng = np.random.default_rng(2)
    ix = SpanIndex(min_match=16, anchor=8)
    a, b = rand_tokens(rng, 100), rand_tokens(rng, 64)
    ix.add(1, a)
    ix.add(2, b, namespace="ns")
    assert ix.num_entries == 100 // 8 + 64 // 8 == total_bucket_entries(ix)
    prompt = fresh(0, 5) + a + fresh(1, 5)
    assert ix.find(prompt) == [SpanMatch(5, 1, 0, 100)]

    assert ix.remove(1) is True
    assert ix.remove(1) is False
    assert 1 not in ix and len(ix) == 1
    assert ix.find(prompt) == []
    assert ix.num_entries == 64 // 8 == total_bucket_entries(ix)
    assert None not in ix._tables  # the emptied namespace table is dropped

    assert ix.remove(2) is True
    assert ix.num_entries == 0 == total_bucket_entries(ix)
    assert ix._tables == {}


def test_remove_one_of_two_identical_spans_keeps_the_other() -> None:
    """Identical spans share every hash bucket; removing one must leave the other intact."""
    rng = np.random.default_rng(3)
    toks = rand_tokens(rng, 48)
    ix = SpanIndex()
    ix.add(1, toks)
    ix.add(2, toks)
    prompt = fresh(0, 3) + toks
    assert ix.find(prompt) == [SpanMatch(3, 2, 0, 48)]  # tie: the most recent span
    ix.remove(2)
    assert ix.find(prompt) == [SpanMatch(3, 1, 0, 48)]
    assert ix.num_entries == 48 // 8 == total_bucket_entries(ix)
    ix.add(2, toks)
    ix.remove(1)
    ix.add(1, toks)  # now 1 is the most recent again
    assert ix.find(prompt) == [SpanMatch(3, 1, 0, 48)]


def test_short_spans_are_stored_but_never_match() -> None:
    ix = SpanIndex(min_match=16, anchor=8)
    short = list(range(1000, 1015))  # 15 < min_match
    ix.add(1, short)
    assert 1 in ix and ix.tokens(1).tolist() == short
    assert ix.num_entries == 0
    assert ix.find(short * 3) == []
    assert ix.remove(1) is True and len(ix) == 0


# --------------------------------------------------------------------------- find


def test_exact_occurrences_at_known_positions() -> None:
    rng = np.random.default_rng(4)
    span = rand_tokens(rng, 256)
    ix = SpanIndex()
    ix.add(42, span)
    assert ix.find(span) == [SpanMatch(0, 42, 0, 256)]  # whole prompt
    prompt = fresh(0, 37) + span + fresh(1, 11)  # span starting mid-prompt
    assert ix.find(prompt) == [SpanMatch(37, 42, 0, 256)]
    assert ix.find(tuple(prompt)) == ix.find(np.array(prompt)) == ix.find(prompt)
    assert ix.find(prompt + span[:16]) == [SpanMatch(37, 42, 0, 256), SpanMatch(304, 42, 0, 16)]


def test_two_spans_same_span_twice_and_adjacent() -> None:
    rng = np.random.default_rng(5)
    a, b = rand_tokens(rng, 120), rand_tokens(rng, 90)
    ix = SpanIndex()
    ix.add(1, a)
    ix.add(2, b)
    prompt = fresh(0, 10) + a + fresh(1, 20) + b + fresh(2, 5)
    assert ix.find(prompt) == [SpanMatch(10, 1, 0, 120), SpanMatch(150, 2, 0, 90)]
    prompt = fresh(0, 10) + a + fresh(1, 3) + a
    assert ix.find(prompt) == [SpanMatch(10, 1, 0, 120), SpanMatch(133, 1, 0, 120)]
    prompt = fresh(0, 4) + a + b + a + a
    assert ix.find(prompt) == [
        SpanMatch(4, 1, 0, 120),
        SpanMatch(124, 2, 0, 90),
        SpanMatch(214, 1, 0, 120),
        SpanMatch(334, 1, 0, 120),
    ]


def test_edge_tokens_altered_interior_still_matched() -> None:
    """A pasted span whose first 2 and last 2 tokens re-tokenized differently."""
    rng = np.random.default_rng(6)
    spans = {i: rand_tokens(rng, 64 + 17 * i) for i in range(3)}
    ix = SpanIndex()
    for sid, toks in spans.items():
        ix.add(sid, toks)
    prompt: list[int] = fresh(9, 13)
    expected = []
    for sid in (2, 0, 1):
        toks = spans[sid]
        altered = fresh(sid, 2) + toks[2:-2] + fresh(sid + 3, 2)
        expected.append(SpanMatch(len(prompt) + 2, sid, 2, len(toks) - 4))
        prompt += altered
    assert ix.find(prompt) == expected


def test_longest_match_wins_over_recency() -> None:
    rng = np.random.default_rng(7)
    x, y = rand_tokens(rng, 30), rand_tokens(rng, 30)
    ix = SpanIndex()
    ix.add(1, x + y)
    ix.add(2, x)  # more recent but shorter
    ix.add(3, fresh(5, 3) + x[4:])  # a match that starts later inside the prompt
    assert ix.find(fresh(0, 2) + x + y) == [SpanMatch(2, 1, 0, 60)]
    assert ix.find(fresh(0, 2) + x + fresh(1, 2)) == [SpanMatch(2, 2, 0, 30)]


def test_min_match_respected_at_every_offset() -> None:
    """Every run of exactly min_match tokens is found, wherever it sits relative to anchors;
    a run of min_match - 1 tokens never is."""
    rng = np.random.default_rng(8)
    for min_match, anchor in ((16, 8), (15, 8), (7, 4), (1, 1), (20, 3)):
        span = rand_tokens(rng, 50)
        ix = SpanIndex(min_match=min_match, anchor=anchor)
        ix.add(3, span)
        for s in range(len(span) - min_match + 1):
            hit = fresh(0, 5) + span[s : s + min_match] + fresh(1, 5)
            assert ix.find(hit) == [SpanMatch(5, 3, s, min_match)], (min_match, anchor, s)
            if min_match > 1:
                miss = fresh(0, 5) + span[s : s + min_match - 1] + fresh(1, 5)
                assert ix.find(miss) == [], (min_match, anchor, s)


def test_span_of_exactly_min_match_tokens() -> None:
    """The shortest indexable span: its only anchors must still be indexed."""
    for min_match, anchor in ((16, 8), (15, 8), (17, 8), (5, 3), (1, 1)):
        ix = SpanIndex(min_match=min_match, anchor=anchor)
        span = fresh(1, min_match)
        ix.add(1, span)
        assert ix.num_entries == (min_match - anchor) // anchor + 1
        assert ix.find(fresh(0, 3) + span) == [SpanMatch(3, 1, 0, min_match)]
        assert ix.find(fresh(0, 3) + span[1:]) == []


def test_namespace_isolation() -> None:
    rng = np.random.default_rng(9)
    toks = rand_tokens(rng, 64)
    ix = SpanIndex()
    ix.add(1, toks, namespace="tenant-a")
    ix.add(2, toks, namespace=("tenant", "b"))
    prompt = fresh(0, 8) + toks
    assert ix.find(prompt, "tenant-a") == [SpanMatch(8, 1, 0, 64)]
    assert ix.find(prompt, ("tenant", "b")) == [SpanMatch(8, 2, 0, 64)]
    assert ix.find(prompt) == []  # None is its own namespace
    assert ix.find(prompt, "tenant-c") == []
    ix.add(3, toks)
    assert ix.find(prompt) == [SpanMatch(8, 3, 0, 64)]
    assert ix.find(prompt, "tenant-a") == [SpanMatch(8, 1, 0, 64)]


def test_start_end_window() -> None:
    rng = np.random.default_rng(10)
    a, b = rand_tokens(rng, 64), rand_tokens(rng, 64)
    ix = SpanIndex()
    ix.add(1, a)
    ix.add(2, b)
    prompt = fresh(0, 10) + a + fresh(1, 10) + b + fresh(2, 10)  # a at 10, b at 84
    assert ix.find(prompt, start=74) == [SpanMatch(84, 2, 0, 64)]  # a is before the window
    assert ix.find(prompt, start=40) == [SpanMatch(40, 1, 30, 34), SpanMatch(84, 2, 0, 64)]
    assert ix.find(prompt, start=60) == [SpanMatch(84, 2, 0, 64)]  # 14 left of a < 16
    assert ix.find(prompt, end=84) == [SpanMatch(10, 1, 0, 64)]
    assert ix.find(prompt, end=120) == [SpanMatch(10, 1, 0, 64), SpanMatch(84, 2, 0, 36)]
    assert ix.find(prompt, start=20, end=50) == [SpanMatch(20, 1, 10, 30)]
    assert ix.find(prompt, end=10_000) == ix.find(prompt)
    assert ix.find(prompt, start=len(prompt)) == []
    assert ix.find(prompt, start=50, end=40) == []
    with pytest.raises(ValueError):
        ix.find(prompt, start=-1)
    with pytest.raises(ValueError):
        ix.find(prompt, end=-1)


def test_hash_collisions_never_produce_wrong_matches() -> None:
    """With a hash that maps every gram to one of 2 values, every look-up collides (so
    much work that only the unbounded index gives the exact result)."""
    rng = np.random.default_rng(11)
    orig = span_index_module.gram_hashes
    spans = [rand_tokens(rng, 40) for _ in range(20)]
    with mock.patch.object(
        span_index_module, "gram_hashes", lambda t, g: orig(t, g) % np.uint64(2)
    ):
        ix = SpanIndex(work_per_token=None)
        for i, s in enumerate(spans):
            ix.add(i, s)
        prompt = rand_tokens(rng, 30) + spans[4] + spans[17][5:] + rand_tokens(rng, 30)
        assert ix.find(prompt) == [SpanMatch(30, 4, 0, 40), SpanMatch(70, 17, 5, 35)]
        assert ix.find(rand_tokens(rng, 200)) == []
        for i in range(20):
            assert ix.remove(i)
        assert ix.num_entries == 0 and ix._tables == {}


def test_lookup_work_does_not_scale_with_stored_spans() -> None:
    """With many unrelated spans stored, only the pasted spans' diagonals are ever verified."""
    rng = np.random.default_rng(12)
    ix = SpanIndex()
    spans = [rand_tokens(rng, 64) for _ in range(2000)]
    for i, toks in enumerate(spans):
        ix.add(i, toks)
    assert ix.find(rand_tokens(rng, 1024)) == []
    assert ix.last_find_candidates == 0
    prompt = rand_tokens(rng, 100) + spans[1500] + rand_tokens(rng, 50) + spans[7][3:]
    assert ix.find(prompt) == [SpanMatch(100, 1500, 0, 64), SpanMatch(214, 7, 3, 61)]
    assert ix.last_find_candidates == 2  # one per pasted span, not per stored span


def test_shared_preamble_and_max_bucket() -> None:
    """Many spans sharing a preamble: exact mode verifies one candidate per span; with
    max_bucket the common grams are skipped and the pasted span is still found whole."""
    rng = np.random.default_rng(13)
    preamble = rand_tokens(rng, 24)
    spans = [preamble + rand_tokens(rng, 40) for _ in range(300)]
    exact, capped = SpanIndex(work_per_token=None), SpanIndex(max_bucket=4)
    for i, toks in enumerate(spans):
        exact.add(i, toks)
        capped.add(i, toks)
    prompt = fresh(0, 10) + spans[123] + fresh(1, 10)
    assert exact.find(prompt) == capped.find(prompt) == [SpanMatch(10, 123, 0, 64)]
    assert exact.last_find_candidates >= 300
    assert capped.last_find_candidates == 1
    # Only the preamble pasted: exact mode reports it (tie -> newest span), capped mode
    # skips it (the documented loss of exactness).
    only_preamble = fresh(0, 10) + preamble + fresh(1, 10)
    assert exact.find(only_preamble) == [SpanMatch(10, 299, 0, 24)]
    assert capped.find(only_preamble) == []


def periodic_case(period: int, n_spans: int, span_len: int, prompt_len: int):
    """Spans of period-``period`` text at every phase, and a prompt of the same text: every
    prompt position hits about ``n_spans * (span_len / anchor) / period`` genuine entries."""
    rng = np.random.default_rng(period)
    base = rng.integers(0, 50_000, period)
    spans = [base[(np.arange(span_len) + i) % period].tolist() for i in range(n_spans)]
    prompt = base[np.arange(prompt_len) % period].tolist()
    return spans, prompt


def test_crafted_prompt_work_is_bounded_and_results_stay_valid() -> None:
    """Periodic text against periodic spans: unbounded, the work grows with the entries per
    position; bounded, it stays within the pace (an independent count: the stated bound)
    while what is returned is still verified, and most of the prompt is still matched."""
    spans, prompt = periodic_case(257, 40, 1024, 6000)
    stored = [(i, t, None) for i, t in enumerate(spans)]
    exact = SpanIndex(min_match=32, anchor=16, max_bucket=64, work_per_token=None)
    bounded = SpanIndex(min_match=32, anchor=16, max_bucket=64, work_per_token=4.0, work_slack=0)
    for sid, toks, _ in stored:
        exact.add(sid, toks)
        bounded.add(sid, toks)
    want = reference_find(stored, prompt, None, 32, 0, None)
    assert exact.find(prompt) == want
    assert not exact.last_find_truncated
    got = bounded.find(prompt)
    assert bounded.last_find_truncated
    assert_valid(bounded, prompt, got)
    assert bounded.last_find_work <= 4.0 * len(prompt) + work_overrun(stored)
    assert exact.last_find_work > 3 * bounded.last_find_work  # the bound did something
    assert sum(m.length for m in got) >= 0.9 * sum(m.length for m in want)


def test_default_bound_leaves_pasted_prompts_exact() -> None:
    """A prompt made entirely of pieces of stored spans (the relay case at its densest)
    stays far under the default pace: no bucket is skipped, the result is exact."""
    rng = np.random.default_rng(21)
    spans = [rand_tokens(rng, 512) for _ in range(150)]
    stored = [(i, t, None) for i, t in enumerate(spans)]
    ix = SpanIndex(min_match=32, anchor=16, max_bucket=64)  # the runtime's settings
    for sid, toks, _ in stored:
        ix.add(sid, toks)
    prompt: list[int] = []
    while len(prompt) < 3000:
        toks = spans[int(rng.integers(0, len(spans)))]
        i = int(rng.integers(0, 400))
        prompt += toks[i : i + int(rng.integers(32, 112))]
    got = ix.find(prompt)
    assert not ix.last_find_truncated
    assert ix.last_find_work < 4.0 * len(prompt) / 4  # >= 4x headroom under the pace
    assert got == reference_find(stored, prompt, None, 32, 0, None)


def test_removing_spans_that_share_one_gram_in_any_order() -> None:
    """Identical degenerate spans (one gram at every anchor) removed in random order: the
    shared bucket shrinks entry by entry and the index stays consistent."""
    rng = np.random.default_rng(22)
    ix = SpanIndex(min_match=32, anchor=16, work_per_token=None)
    stored = []
    for sid in range(40):
        toks = [7] * int(rng.integers(32, 300))
        ix.add(sid, toks)
        stored.append((sid, toks, None))
    prompt = [1] * 5 + [7] * 100 + [2] * 5
    for k, sid in enumerate(rng.permutation(40).tolist()):
        assert ix.remove(sid)
        stored = [x for x in stored if x[0] != sid]
        assert ix.num_entries == total_bucket_entries(ix)
        if k % 8 == 7:  # the brute-force reference is slow
            assert ix.find(prompt) == reference_find(stored, prompt, None, 32, 0, None)
    assert ix._tables == {}


@pytest.mark.parametrize(
    ("max_bucket", "exc"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_bad_max_bucket(max_bucket: object, exc: type) -> None:
    with pytest.raises(exc):
        SpanIndex(max_bucket=max_bucket)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- property tests


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    vocab = draw(st.integers(2, 20))
    anchor = draw(st.integers(1, 4))
    min_match = draw(st.integers(2 * anchor - 1, 2 * anchor + 4))
    tok = st.integers(0, vocab - 1)
    namespaces = [None, "x", 3]
    namespace = draw(st.sampled_from(namespaces))  # the one queried; most spans share it
    rare = st.sampled_from([False, False, False, True])

    ix = SpanIndex(min_match=min_match, anchor=anchor, work_per_token=None)  # exact
    stored: list[tuple[int, list[int], Hashable]] = []  # in add order
    n_ops = draw(st.integers(1, 9))
    next_id = 0
    for _ in range(n_ops):
        if stored and draw(st.integers(0, 3)) == 0:  # remove, maybe re-add the same id
            k = draw(st.integers(0, len(stored) - 1))
            sid, toks, ns = stored.pop(k)
            assert ix.remove(sid)
            if draw(st.booleans()):
                stored.append((sid, toks, ns))
                ix.add(sid, toks, ns)
        else:
            # Mostly long enough to match; lengths near min_match are the boundary case.
            kind = draw(st.sampled_from(["long", "long", "boundary", "any"]))
            if kind == "long":
                n = draw(st.integers(min_match, 30))
            elif kind == "boundary":
                n = draw(st.sampled_from([min_match - 1, min_match, min_match + anchor - 1]))
            else:
                n = draw(st.integers(0, 30))
            toks = draw(st.lists(tok, min_size=n, max_size=n))
            ns = draw(st.sampled_from(namespaces)) if draw(rare) else namespace
            stored.append((next_id, toks, ns))
            ix.add(next_id, toks, ns)
            next_id += 1

    # The prompt: filler alternating with pasted pieces of stored spans (mostly spans of the
    # queried namespace), each piece whole, trimmed at the edges or any slice, sometimes with
    # a token or two replaced (re-tokenized edges, edits).
    same_ns = [toks for _, toks, ns in stored if ns == namespace]
    any_ns = [toks for _, toks, _ in stored]
    prompt: list[int] = []
    for _ in range(draw(st.integers(1, 5))):
        prompt += draw(st.lists(tok, max_size=6))
        if not any_ns:
            continue
        toks = draw(st.sampled_from(same_ns if same_ns and draw(st.integers(0, 3)) else any_ns))
        mode = draw(st.integers(0, 2))
        if mode == 0:
            i, j = 0, len(toks)
        elif mode == 1:
            i, j = draw(st.integers(0, 2)), len(toks) - draw(st.integers(0, 2))
        else:
            i = draw(st.integers(0, len(toks)))
            j = draw(st.integers(i, len(toks)))
        piece = list(toks[i:j])
        for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
            if piece:
                piece[draw(st.integers(0, len(piece) - 1))] = draw(tok)
        prompt += piece
    # A window restriction in some of the cases.
    start = draw(st.integers(0, len(prompt) + 1)) if draw(rare) else 0
    end = draw(st.integers(0, len(prompt) + 2)) if draw(rare) else None
    return ix, stored, prompt, namespace, start, end


def work_overrun(stored: list) -> int:
    """What one verification may add past the pace: 16 plus its compared tokens / 64 (both
    directions, at most the longest span each)."""
    longest = max((len(toks) for _, toks, _ in stored), default=0)
    return 16 + 2 * longest // 64 + 1


def check_against_reference(scenario: tuple) -> None:
    ix, stored, prompt, namespace, start, end = scenario
    got = ix.find(prompt, namespace, start=start, end=end)
    assert got == reference_find(stored, prompt, namespace, ix.min_match, start, end)
    assert_valid(ix, prompt, got)
    stop = len(prompt) if end is None else min(end, len(prompt))
    assert all(start <= m.prompt_start and m.prompt_start + m.length <= stop for m in got)
    assert ix.num_entries == total_bucket_entries(ix)
    assert len(ix) == len(stored)
    # With stop-grams (max_bucket=1) results may differ from the reference but stay valid.
    capped = SpanIndex(min_match=ix.min_match, anchor=ix.anchor, max_bucket=1)
    for sid, toks, ns in stored:
        capped.add(sid, toks, ns)
    got = capped.find(prompt, namespace, start=start, end=end)
    assert_valid(capped, prompt, got)
    assert all(start <= m.prompt_start and m.prompt_start + m.length <= stop for m in got)
    # Under a tight work bound (no slack) results stay valid, the work stays within the
    # stated bound, and a find that skipped nothing is exact.
    for pace in (0.5, 2.0, 8.0):
        bounded = SpanIndex(
            min_match=ix.min_match, anchor=ix.anchor, work_per_token=pace, work_slack=0
        )
        for sid, toks, ns in stored:
            bounded.add(sid, toks, ns)
        got = bounded.find(prompt, namespace, start=start, end=end)
        assert_valid(bounded, prompt, got)
        assert all(start <= m.prompt_start and m.prompt_start + m.length <= stop for m in got)
        if not bounded.last_find_truncated:
            assert got == reference_find(stored, prompt, namespace, ix.min_match, start, end)
        assert bounded.last_find_work <= pace * max(0, stop - start) + work_overrun(stored)


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_find_equals_brute_force(scenario: tuple) -> None:
    check_against_reference(scenario)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_find_equals_brute_force_under_hash_collisions(scenario: tuple) -> None:
    """Same property with a 4-valued hash: almost every look-up is a collision."""
    orig = span_index_module.gram_hashes
    with mock.patch.object(
        span_index_module, "gram_hashes", lambda t, g: orig(t, g) % np.uint64(4)
    ):
        # Rebuild the index under the bad hash (entries must be hashed consistently).
        ix, stored, prompt, namespace, start, end = scenario
        bad = SpanIndex(min_match=ix.min_match, anchor=ix.anchor, work_per_token=None)
        for sid, toks, ns in stored:
            bad.add(sid, toks, ns)
        check_against_reference((bad, stored, prompt, namespace, start, end))
        for sid, _, _ in stored:
            assert bad.remove(sid)
        assert bad.num_entries == 0 and bad._tables == {}


# --------------------------------------------------------------------------- relatedness


def test_related_spans_by_share_and_by_long_quote() -> None:
    from sglang_relay.core.relatedness import related_spans

    lengths = {1: 200, 2: 200, 3: 1000, 4: 100}
    matches = [
        SpanMatch(0, 1, 60, 40),  # 20 % of span 1 only: boilerplate-like, unrelated
        SpanMatch(50, 2, 0, 60),  # span 2 pasted with an edit: 60 + 45 = 52.5 %, related
        SpanMatch(111, 2, 61, 45),
        SpanMatch(200, 3, 100, 300),  # 30 % of a long span, but a 300-token quote: related
        SpanMatch(600, 4, 0, 50),  # exactly half of span 4: related (>=)
    ]
    assert related_spans(matches, lengths, 0.5) == {2, 3, 4}
    assert related_spans(matches, lengths.__getitem__, 0.5, quote_tokens=400) == {2, 4}
    assert related_spans(matches, lengths, 0.0) == {1, 2, 3, 4}  # 0: every match
    assert related_spans(matches, lengths, 1.0) == {3}
    assert related_spans([], lengths, 0.5) == set()


def _related_brute_force(matches, lengths, starts, min_share, quote):
    """Token by token: the answer tokens each match holds (summed over matches: the same
    text pasted twice counts twice), against the answer's length; any match of ``quote``
    tokens."""
    held: dict[int, int] = {}
    longest: dict[int, int] = {}
    for m in matches:
        answer = range(starts.get(m.span_id, 0), lengths[m.span_id])
        toks = [t for t in range(m.span_start, m.span_start + m.length) if t in answer]
        held[m.span_id] = held.get(m.span_id, 0) + len(toks)
        longest[m.span_id] = max(longest.get(m.span_id, 0), m.length)
    out = set()
    for sid, n in held.items():
        size = lengths[sid] - starts.get(sid, 0)
        if min_share <= 0 or (n and n >= min_share * size) or longest[sid] >= quote:
            out.add(sid)
    return out


def test_reasoning_spans_relate_by_their_answer() -> None:
    """A reasoning output (answer from offset 300 of 400) pasted without its reasoning
    relates; a short run inside the reasoning does not (only a long quote would); spans
    without a reasoning part keep the whole-output rule. Random cases == brute force."""
    import random

    from sglang_relay.core.relatedness import related_spans

    lengths = {1: 400, 2: 400, 3: 200}
    starts = {1: 300, 2: 300}
    matches = [
        SpanMatch(10, 1, 300, 100),  # span 1's whole answer, none of its reasoning
        SpanMatch(200, 2, 20, 120),  # 120 tokens of span 2's reasoning only
        SpanMatch(400, 3, 0, 100),  # half of a plain span
    ]
    start = starts.get
    assert related_spans(matches, lengths, 0.5, answer_start=lambda s: start(s, 0)) == {1, 3}
    assert related_spans(matches, lengths, 0.5) == {3}  # whole-output lengths: 25 % of 1
    assert related_spans(matches, lengths, 0.5, 100, lambda s: start(s, 0)) == {1, 2, 3}
    rng = random.Random(3)
    for _ in range(300):
        lens = {i: rng.randint(40, 400) for i in range(4)}
        sts = {i: rng.choice([0, rng.randint(0, lens[i])]) for i in range(4)}
        ms = []
        for _ in range(rng.randint(0, 5)):
            sid = rng.randrange(4)
            a = rng.randrange(lens[sid] - 32)
            ms.append(SpanMatch(len(ms) * 500, sid, a, rng.randint(32, lens[sid] - a)))
        for share, quote in ((0.5, 256), (0.0, 256), (1.0, 100), (0.3, 10**6)):
            got = related_spans(ms, lens, share, quote, lambda s, sts=sts: sts[s])
            assert got == _related_brute_force(ms, lens, sts, share, quote)


def test_answer_offset_is_just_after_the_last_reasoning_end_marker() -> None:
    from sglang_relay.core.relatedness import answer_offset

    end = [7, 8, 9]
    assert answer_offset([1, 2, 7, 8, 9, 4, 5], end) == 5
    assert answer_offset([7, 8, 9, 1, 7, 8, 9], end) == 7  # the last one; empty answer
    assert answer_offset([1, 7, 8, 4, 9], end) == 0  # not the whole marker: no reasoning
    assert answer_offset([1, 2, 3], None) == 0 and answer_offset([1, 2], [5]) == 0
    assert answer_offset([5, 1], [5]) == 1
