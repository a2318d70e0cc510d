"""What the span store dropped for room, remembered as fingerprints, so a prompt that
pastes an output whose span is gone (evicted from the device and, with a host tier, from
host too) is told so (fallback ``span_evicted``, counted) instead of looking like a prompt
that pastes nothing. An operator sizes ``--relay-span-tokens``, ``--relay-host-tokens``
and ``--relay-host-ttl`` from that count (``/get_server_info``: ``fallback_span_evicted``).

Each dropped span leaves the 32-token window hashes it would publish for routing
(:func:`~sglang_relay.core.fingerprints.span_fingerprints`: every 16th window and the last,
salted with its namespace, so one tenant's prompt never hits another's), up to
:data:`MAX_WINDOWS` in all, oldest forgotten first: ~150 bytes of host memory per 16
evicted tokens (an ordered-dict entry and its Python int, ~140 bytes under tracemalloc,
and 8 in the sorted copy), ~40 MB at the bound. A prompt hits when any of its windows is
one of them: one ``searchsorted`` of its window hashes against a sorted copy of the
remembered ones, brought up to date on the first check after a change by merging in what
was added and deleting what was forgotten since (a copy, linear; not a sort of them all).
Not thread-safe: the scheduler thread owns it (like the store).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from sglang_relay.core.fingerprints import WINDOW, namespace_salt, span_fingerprints, window_hashes

MAX_WINDOWS = 1 << 18  # ~4M evicted tokens remembered


class EvictedSpans:
    def __init__(self, max_windows: int = MAX_WINDOWS) -> None:
        self.max_windows = max_windows
        self.windows: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._sorted = np.empty(0, np.uint64)  # the windows, ascending, as of the last check
        self._delta: dict[int, int] = {}  # since then: +1 added, -1 forgotten (0: both)
        self.spans = 0  # spans remembered (over the server's life)

    def add(self, tokens: Sequence[int], namespace: Hashable) -> None:
        """Span ``tokens`` of ``namespace`` was dropped for room."""
        salt = int(namespace_salt(namespace))
        for h in span_fingerprints(tokens, salt).tolist():
            if h in self.windows:
                self.windows.move_to_end(h)
            else:
                self.windows[h] = None
                self._delta[h] = self._delta.get(h, 0) + 1
        while len(self.windows) > self.max_windows:
            h, _ = self.windows.popitem(last=False)
            self._delta[h] = self._delta.get(h, 0) - 1
        if len(self._delta) > self.max_windows:  # churn with no check between: sort anew
            self._sorted = np.sort(np.fromiter(self.windows, np.uint64, len(self.windows)))
            self._delta.clear()
        self.spans += 1

    def _synced(self) -> np.ndarray:
        """The sorted copy with the changes since the last check merged in."""
        if self._delta:
            gone = np.array([h for h, d in self._delta.items() if d < 0], np.uint64)
            new = np.sort(np.array([h for h, d in self._delta.items() if d > 0], np.uint64))
            kept = np.delete(self._sorted, np.searchsorted(self._sorted, gone))
            self._sorted = np.insert(kept, np.searchsorted(kept, new), new)
            self._delta.clear()
        return self._sorted

    def pasted(self, tokens: Sequence[int], namespace: Hashable) -> bool:
        """Whether ``tokens`` (a prompt's, of ``namespace``) hold a window of a dropped span."""
        if not self.windows or len(tokens) < WINDOW:
            return False
        hashes = window_hashes(tokens, 1, int(namespace_salt(namespace)))
        known = self._synced()
        at = np.searchsorted(known, hashes).clip(max=len(known) - 1)
        return bool((known[at] == hashes).any())

    def clear(self) -> None:
        self.windows.clear()
        self._sorted, self._delta = np.empty(0, np.uint64), {}
