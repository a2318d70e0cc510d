"""Whether a prompt's matches of a stored span are a paste of it (relay's use case) or a
coincidence: the relatedness rule (:func:`related_spans`: a share of the span, or one long
quote) and where a reasoning output's answer begins (:func:`answer_offset`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sglang_relay.core.span_index import SpanMatch

# A verbatim run this long is a deliberate quote of an output, whatever share of it.
QUOTE_TOKENS = 256


def related_spans(
    matches: Sequence[SpanMatch],
    span_length: dict[int, int] | Callable[[int], int],
    min_share: float,
    quote_tokens: int = QUOTE_TOKENS,
    answer_start: Callable[[int], int] | None = None,
) -> set[int]:
    """Ids of the spans that ``matches`` (the matches of one whole prompt) relate to.

    Relay's use case is an output pasted into a later prompt: whole, or most of it, or a
    long quote of it. A short run that merely equals part of a stored output (a license
    header, a common idiom, boilerplate that two unrelated outputs share) is not. A span
    is *related* when the prompt holds at least ``min_share`` of its tokens (all its
    matches together: a paste with an edit in the middle is two matches) or one match of
    at least ``quote_tokens`` tokens. ``min_share`` 0 relates every match.

    Reasoning outputs (``answer_start``: the offset where a span's answer begins, after
    the model's reasoning end marker; 0 for a span without one) are judged by what a
    downstream pastes: the share counts matched tokens of the answer against the answer's
    length (``span_length`` minus ``answer_start``), so an answer pasted without its longer
    reasoning relates; a reasoning quote relates only through ``quote_tokens``.
    """
    length = span_length.__getitem__ if isinstance(span_length, dict) else span_length
    total: dict[int, int] = {}
    longest: dict[int, int] = {}
    starts: dict[int, int] = {}
    for m in matches:
        sid = m.span_id
        if answer_start is None:
            start = 0
        else:
            start = starts.setdefault(sid, answer_start(sid))
        inside = max(0, m.span_start + m.length - max(m.span_start, start))
        total[sid] = total.get(sid, 0) + inside
        longest[sid] = max(longest.get(sid, 0), m.length)
    if min_share <= 0:
        return set(longest)
    return {
        sid
        for sid in longest
        if (total[sid] > 0 and total[sid] >= min_share * (length(sid) - starts.get(sid, 0)))
        or longest[sid] >= quote_tokens
    }


def answer_offset(tokens: Sequence[int], marker: Sequence[int] | None) -> int:
    """Where the answer of an output begins: just after the last occurrence of ``marker``
    (the model's reasoning end, e.g. the tokens of ``</think>``) in ``tokens``; 0 when
    there is no marker or it does not occur (the whole output is the answer)."""
    if not marker:
        return 0
    m = len(marker)
    first = marker[0]
    marker = list(marker)
    for i in range(len(tokens) - m, -1, -1):
        if tokens[i] == first and list(tokens[i : i + m]) == marker:
            return i + m
    return 0
