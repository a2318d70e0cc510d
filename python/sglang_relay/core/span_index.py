"""Find stored token spans inside a new prompt, so that their KV cache can be reused.

In a multi-agent pipeline the output tokens of a finished request (a *span*) are pasted into
later prompts. :class:`SpanIndex` stores such spans and, given a prompt, returns every place
where a long enough run of prompt tokens equals a run of tokens of a stored span.

Semantics (what :meth:`SpanIndex.find` returns)
-----------------------------------------------
A *match* at prompt position ``x`` is a pair (span, offset ``s``) with
``prompt[x:x + L] == span[s:s + L]`` and ``L >= min_match``. ``find`` scans the window
``prompt[start:end]`` left to right: at the first position ``x`` (not before the end of the
previous match) where a match exists it takes the *longest* match starting at ``x``; ties
go to the most recently added span, then to the smallest offset ``s`` inside that span. It
then continues at ``x + L``. The result is therefore sorted, non-overlapping, and exactly the
output of the brute-force greedy matcher (the tests compare against one), unless the
opt-in ``max_bucket`` is set (see :class:`SpanIndex`). A match may start
anywhere inside a span (``s > 0``) and may end before the span ends, which makes matching
tolerant to edges that re-tokenize differently once the text is pasted into a new template.

Algorithm
---------
*Anchors.* Only every ``anchor``-th offset of a span (``0, a, 2a, ...`` with the whole
``a``-gram inside the span) is indexed, under a 64-bit hash of the ``a``-gram starting there:
``hash -> entry`` (one packed int, or a list of them when several anchors share the hash:
equal grams or a collision), one dict per namespace. A match of length ``L >= 2a - 1``
covering span offsets ``[s, s + L)`` always contains a whole anchored ``a``-gram (the first
multiple of ``a`` not below ``s`` is at most ``s + a - 1``, and its gram ends at most at
``s + 2a - 1 <= s + L``), so requiring ``min_match >= 2 * anchor - 1`` makes the anchor
sampling lossless: no match is ever missed.

*Scan.* The hashes of all ``a``-grams of the prompt window are computed at once with numpy
(each token is scrambled with a splitmix64 finalizer, then combined with a polynomial hash
modulo 2**64). Each window position is looked up in the namespace dict. A hit
``(q, span, off)`` defines a diagonal ``off - q`` of that span; the first hit on a diagonal is
verified and extended token by token (vectorised) forwards and backwards to the maximal
equal run inside the window. Hash collisions fail the verification of the ``a``-gram itself
and are dropped, so they cost time but can never produce a wrong match. Later hits that fall
inside a run already computed on their diagonal are skipped, so each run is compared once.

*Greedy selection.* The maximal runs of length ``>= min_match`` are swept by start position
with a heap keyed on (run end, recency, diagonal); at the current position ``p`` the best
active run gives the longest match starting at ``p`` (a match starting inside a run extends
exactly to the run's end). If none qualifies, ``p`` jumps to the next run start.

Complexity
----------
``find`` costs ``O(n * a)`` vectorised work for the hashes, ``n`` dict look-ups, ``O(1)`` per
anchor hit, and ``O(length)`` per distinct maximal run (the comparison), plus
``O(R log R)`` for ``R`` runs. It does not depend on the number of stored spans except
through hash-bucket collisions and genuinely shared grams: if ``k`` stored spans contain the
same anchored gram (a common preamble, say), each occurrence of that gram in the prompt
costs ``k`` candidate checks. ``max_bucket`` bounds that cost by skipping such grams, at the
price of exactness in the rare case where a match consists of common grams only.
``add``/``remove`` cost ``O(len(span))`` (a bucket shared by many anchors is an insertion-ordered
dict, so removing one entry is ``O(1)`` however common the gram). Memory: the tokens
themselves (8 bytes each) plus about ``len(span) / anchor`` dict entries per span.

*Work bound.* A crafted prompt can still make every position hit many entries that are all
genuine (periodic text against periodic spans, many near-copies of one text): up to
``max_bucket`` candidates per prompt token, each compared token by token. ``find`` therefore
keeps a work account (1 per candidate examined, plus 16 and 1 per 64 compared tokens for
each verification: measured, a verification costs about 20 examined candidates) and paces
it: before examining a bucket at window position ``i`` the account may not exceed
``work_per_token * (i + 1) + work_slack``; a bucket that would overrun the pace is skipped
like a stop-gram. Total work is therefore at most ``work_per_token * n + work_slack`` plus
one verification's cost for an ``n``-token window, plus one dict look-up per position
(verifications compare in blocks growing 4x from 64 tokens, so their cost follows the run
found, not the span's length). Skipping never produces a wrong match (every match is still
verified); it can only miss or shorten matches, and only in prompts whose buckets are dense
enough to overrun the pace (``last_find_truncated`` tells).
``work_per_token=None`` disables the bound (exact greedy result always).

The index is not thread-safe; callers serialise ``add``/``remove``/``find``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from sglang_relay.core.grams import as_tokens, equal_run, gram_hashes

__all__ = ["SpanIndex", "SpanMatch"]


# An index entry packs (span sequence number, anchored offset) into one Python int.
_OFF_BITS = 32


_OFF_MASK = (1 << _OFF_BITS) - 1


class SpanMatch(NamedTuple):
    """One matched run: ``prompt[prompt_start:prompt_start + length]`` equals
    ``tokens(span_id)[span_start:span_start + length]``, and ``length >= min_match``."""

    prompt_start: int
    """Index in the prompt where the matched run begins."""
    span_id: int
    """The id given to :meth:`SpanIndex.add`."""
    span_start: int
    """Offset inside the stored span where the matched run begins."""
    length: int
    """Number of matched tokens."""


class SpanIndex:
    """Index of token spans; :meth:`find` locates runs of stored spans inside a prompt.

    Args:
        min_match: shortest run reported by :meth:`find`.
        anchor: sampling stride of the index (and length of the hashed grams). Larger values
            use less memory (about ``len(span) / anchor`` entries per span) and fewer look-up
            hits, but require a larger ``min_match``.
        max_bucket: ``None`` (default) for exact results. Otherwise, during :meth:`find`,
            grams indexed at more than ``max_bucket`` places of the namespace are skipped
            ("stop-grams"). Use it when many stored spans share boilerplate (a common
            preamble indexed in every span makes each occurrence of it in a prompt verify
            one candidate per span). Results stay correct (every match is verified,
            sorted, non-overlapping, ``>= min_match``) and a pasted span is still found
            through its other anchors (the match extends back over the common part), but
            a match whose every anchored gram is common is no longer guaranteed to be found,
            so the output may then differ from the exact greedy result.
        work_per_token: pace of :meth:`find`'s work account per window token (see the
            module docstring, "Work bound"); ``None`` disables the bound. The default (4)
            is about 10x what a prompt made entirely of pasted spans uses (0.35 per token).
        work_slack: work allowed ahead of the pace (lets a short prompt verify its few
            candidates whatever their number).

    Raises:
        ValueError: unless ``anchor >= 1`` and ``min_match >= 2 * anchor - 1``. This is the
            exact condition under which every run of ``min_match`` tokens contains a whole
            anchored gram, i.e. under which anchor sampling never misses a match. Also if
            ``max_bucket < 1``, ``work_per_token <= 0`` or ``work_slack < 0``.
        TypeError: if an argument is not an ``int``.
    """

    def __init__(
        self,
        min_match: int = 16,
        anchor: int = 8,
        *,
        max_bucket: int | None = None,
        work_per_token: float | None = 4.0,
        work_slack: int = 4096,
    ) -> None:
        for name, value in (("min_match", min_match), ("anchor", anchor)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int; got {value!r}")
        if max_bucket is not None:
            if isinstance(max_bucket, bool) or not isinstance(max_bucket, (int, np.integer)):
                raise TypeError(f"max_bucket must be an int or None; got {max_bucket!r}")
            if max_bucket < 1:
                raise ValueError(f"max_bucket must be >= 1 or None; got {max_bucket}")
            max_bucket = int(max_bucket)
        if work_per_token is not None and not work_per_token > 0:
            raise ValueError(f"work_per_token must be > 0 or None; got {work_per_token}")
        if work_slack < 0:
            raise ValueError(f"work_slack must be >= 0; got {work_slack}")
        min_match, anchor = int(min_match), int(anchor)
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1; got {anchor}")
        if min_match < 2 * anchor - 1:
            raise ValueError(
                f"min_match must be >= 2 * anchor - 1 = {2 * anchor - 1} for anchor={anchor} "
                f"(otherwise a match could fall between anchors and be missed); got {min_match}"
            )
        self._min_match = min_match
        self._anchor = anchor
        self._max_bucket = max_bucket
        self._work_per_token = None if work_per_token is None else float(work_per_token)
        self._work_slack = int(work_slack)
        self._last_candidates = 0
        self._last_work = 0
        self._last_truncated = False
        self._next_seq = 0
        self._seq_of: dict[int, int] = {}  # span_id -> sequence number (= add order)
        self._spans: dict[int, tuple[int, np.ndarray, Hashable]] = {}  # seq -> (id, toks, ns)
        self._tables: dict[Hashable, dict[int, int | list[int]]] = {}  # ns -> hash -> entries
        self._num_entries = 0

    # ------------------------------------------------------------------ properties

    @property
    def min_match(self) -> int:
        """Shortest run that :meth:`find` reports."""
        return self._min_match

    @property
    def anchor(self) -> int:
        """Sampling stride / gram length of the index."""
        return self._anchor

    @property
    def max_bucket(self) -> int | None:
        """Bucket size above which a gram is skipped by :meth:`find` (``None``: never)."""
        return self._max_bucket

    @property
    def work_per_token(self) -> float | None:
        """Pace of :meth:`find`'s work bound (``None``: unbounded)."""
        return self._work_per_token

    @property
    def last_find_work(self) -> int:
        """Diagnostic: the work account of the last :meth:`find` (see "Work bound")."""
        return self._last_work

    @property
    def last_find_truncated(self) -> bool:
        """Whether the last :meth:`find` skipped a bucket to keep its work bound (its result
        is then valid but may miss or shorten matches)."""
        return self._last_truncated

    @property
    def last_find_candidates(self) -> int:
        """Diagnostic: (span, offset) candidates the last :meth:`find` compared token by token.

        Each distinct diagonal hit by an anchor is compared once; for a prompt with ``k``
        pasted spans and no shared text with other spans this is about ``k``, whatever the
        number of stored spans.
        """
        return self._last_candidates

    @property
    def num_entries(self) -> int:
        """Number of anchor entries currently in the hash tables (all namespaces)."""
        return self._num_entries

    def __len__(self) -> int:
        """Number of stored spans (including those too short to ever match)."""
        return len(self._seq_of)

    def __contains__(self, span_id: object) -> bool:
        """Whether a span with this id is stored."""
        try:
            return span_id in self._seq_of
        except TypeError:  # unhashable
            return False

    def __repr__(self) -> str:
        return (
            f"SpanIndex(min_match={self._min_match}, anchor={self._anchor}, "
            f"max_bucket={self._max_bucket}, spans={len(self)}, entries={self._num_entries})"
        )

    # ------------------------------------------------------------------ mutation

    def _anchor_hashes(self, toks: np.ndarray) -> list[int]:
        """Hashes of the anchored grams of a stored span (empty if it can never match)."""
        if len(toks) < self._min_match:
            return []
        return gram_hashes(toks, self._anchor)[:: self._anchor].tolist()

    def add(self, span_id: int, tokens: Sequence[int], namespace: Hashable = None) -> None:
        """Store ``tokens`` under ``span_id`` in ``namespace``.

        The tokens are copied (later changes to the caller's list do not affect the index).
        Spans shorter than ``min_match`` are accepted and stored (:meth:`tokens` returns
        them, ``len`` counts them) but can never match, so they get no index entries.

        Raises:
            ValueError: if ``span_id`` is already stored (remove it first), or ``tokens`` is
                not 1-D (or longer than 2**32 - 1).
            TypeError: if ``namespace`` is unhashable or the tokens are not integers.
        """
        if span_id in self._seq_of:
            raise ValueError(f"span id {span_id!r} is already in the index")
        hash(namespace)  # fail before any mutation
        toks = as_tokens(tokens, copy=True)
        if len(toks) > _OFF_MASK:
            raise ValueError(f"spans are limited to {_OFF_MASK} tokens; got {len(toks)}")
        toks.flags.writeable = False
        hashes = self._anchor_hashes(toks)

        seq = self._next_seq
        self._next_seq += 1
        self._seq_of[span_id] = seq
        self._spans[seq] = (span_id, toks, namespace)
        if not hashes:
            return
        table = self._tables.setdefault(namespace, {})
        base = seq << _OFF_BITS
        a = self._anchor
        for i, h in enumerate(hashes):
            entry = base | (i * a)
            cur = table.get(h)
            if cur is None:
                table[h] = entry
            elif type(cur) is int:
                table[h] = {cur: None, entry: None}  # ordered, O(1) removal
            else:
                cur[entry] = None
        self._num_entries += len(hashes)

    def remove(self, span_id: int) -> bool:
        """Remove a span and free its index entries. Returns ``True`` if it was present."""
        seq = self._seq_of.pop(span_id, None)
        if seq is None:
            return False
        _, toks, namespace = self._spans.pop(seq)
        hashes = self._anchor_hashes(toks)
        if not hashes:
            return True
        table = self._tables[namespace]
        base = seq << _OFF_BITS
        a = self._anchor
        for i, h in enumerate(hashes):
            entry = base | (i * a)
            cur = table[h]
            if type(cur) is int:
                del table[h]
            else:
                del cur[entry]
                if len(cur) == 1:
                    table[h] = next(iter(cur))
        self._num_entries -= len(hashes)
        if not table:
            del self._tables[namespace]
        return True

    def tokens(self, span_id: int) -> np.ndarray:
        """The stored tokens of ``span_id`` as a read-only int64 array (raises ``KeyError``)."""
        return self._spans[self._seq_of[span_id]][1]

    # ------------------------------------------------------------------ lookup

    def find(
        self,
        prompt: Sequence[int],
        namespace: Hashable = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> list[SpanMatch]:
        """All greedy, non-overlapping matches of stored spans inside ``prompt[start:end]``.

        Only spans added with an equal ``namespace`` are considered (``None`` is a namespace
        of its own). Matches lie entirely inside ``[start, end)``, are sorted by
        ``prompt_start``, do not overlap, and each has ``length >= min_match``. Selection is
        greedy left to right: at the first position where any match begins, the longest match
        starting there wins (ties: most recently added span, then smallest ``span_start``).
        See the module docstring for the exact definition.

        Args:
            prompt: token ids (list, tuple or 1-D integer array).
            namespace: only spans of this namespace can match.
            start: first prompt index to search (e.g. where the cached prefix ends).
            end: one past the last index to search; ``None`` or values beyond the prompt mean
                the prompt's end.

        Raises:
            ValueError: if ``start`` or ``end`` is negative.
        """
        if start < 0 or (end is not None and end < 0):
            raise ValueError(f"start and end must be >= 0; got start={start}, end={end}")
        self._last_candidates = self._last_work = 0
        self._last_truncated = False
        table = self._tables.get(namespace)
        if not table:
            return []
        arr = as_tokens(prompt, copy=False)
        stop = len(arr) if end is None else min(end, len(arr))
        min_match, a = self._min_match, self._anchor
        if stop - start < min_match:
            return []

        # 1) look every a-gram of the window up; extend each new diagonal to its maximal run.
        hashes = gram_hashes(arr[start:stop], a).tolist()
        spans = self._spans
        max_bucket = self._max_bucket
        pace, slack = self._work_per_token, self._work_slack
        work = checked = 0
        truncated = False
        covered: dict[tuple[int, int], int] = {}  # (seq, off - q) -> end of its computed run
        runs: list[tuple[int, int, int, int]] = []  # (run start, run end, seq, off - q)
        for i, cur in enumerate(map(table.get, hashes)):
            if cur is None:
                continue
            if type(cur) is int:
                cur = (cur,)
            elif max_bucket is not None and len(cur) > max_bucket:
                continue  # stop-gram (opt-in): too common to be worth verifying
            if pace is not None and work + len(cur) > pace * (i + 1) + slack:
                truncated = True  # over the work pace: skip this bucket (never wrong)
                continue
            work += len(cur)
            q = start + i
            for entry in cur:
                seq = entry >> _OFF_BITS
                off = entry & _OFF_MASK
                diag = off - q
                key = (seq, diag)
                if covered.get(key, -1) > q:
                    continue  # inside a run already computed on this diagonal
                if pace is not None and work > pace * (i + 1) + slack:
                    truncated = True
                    break
                checked += 1
                toks = spans[seq][1]
                fwd, cost = equal_run(arr, q, toks, off, min(stop - q, len(toks) - off), 1)
                work += 16 + cost // 64
                if fwd < a:
                    continue  # hash collision: the anchored gram itself differs
                back, cost = equal_run(arr, q - 1, toks, off - 1, min(q - start, off), -1)
                work += cost // 64
                covered[key] = q + fwd
                if fwd + back >= min_match:
                    runs.append((q - back, q + fwd, seq, diag))
        self._last_candidates, self._last_work, self._last_truncated = checked, work, truncated
        if not runs:
            return []

        # 2) greedy sweep: at position p the active run with the largest end gives the
        #    longest match starting at p (ties: newest span, then smallest span offset).
        runs.sort()
        out: list[SpanMatch] = []
        heap: list[tuple[int, int, int]] = []
        p, i, n_runs = start, 0, len(runs)
        while True:
            while i < n_runs and runs[i][0] <= p:
                _, run_end, seq, diag = runs[i]
                heapq.heappush(heap, (-run_end, -seq, diag))
                i += 1
            if heap and -heap[0][0] - p >= min_match:
                neg_end, neg_seq, diag = heap[0]
                out.append(SpanMatch(p, spans[-neg_seq][0], p + diag, -neg_end - p))
                p = -neg_end
            elif i >= n_runs:
                break
            else:
                p = runs[i][0]  # nothing active can reach min_match: jump to the next run
            heap.clear()  # every active run ends at or before the new p
        return out
