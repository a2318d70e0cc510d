"""Relay counters, mirrored to Prometheus when SGLang runs with ``--enable-metrics``.

SGLang exports every process's prometheus_client metrics through its multiprocess
directory (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the scheduler starts),
so a Counter created in the scheduler appears on the server's ``/metrics`` as
``sglang_relay:events_total{event="..."}``.
"""

from __future__ import annotations

import re
from collections import Counter

# Event names are code-made (fallback reasons, forward modes, routing decisions); these
# bounds hold the counters and the Prometheus label set finite whatever reaches them.
MAX_EVENTS = 512
OVERFLOW_EVENT = "events_over_limit"
_EVENT_NAME = re.compile(r"[a-z0-9_]{1,64}")


class RelayCounters(Counter):
    """A ``collections.Counter`` whose increments also go to a Prometheus counter. At most
    :data:`MAX_EVENTS` distinct events; an event name that is not ``[a-z0-9_]{1,64}`` or
    would exceed the bound is counted as :data:`OVERFLOW_EVENT` instead."""

    def __init__(self, *, prometheus: bool = False) -> None:
        super().__init__()
        self._prom = None
        if prometheus:
            from prometheus_client import Counter as PromCounter

            self._prom = PromCounter(
                name="sglang_relay:events",
                documentation="sglang-relay events: relay extends, relayed tokens, "
                "spans matched, fallbacks by reason.",
                labelnames=["event"],
            )

    def _bounded(self, key) -> str:
        if key in self:
            return key
        ok = isinstance(key, str) and _EVENT_NAME.fullmatch(key) is not None
        return key if ok and len(self) < MAX_EVENTS - 1 else OVERFLOW_EVENT

    def __setitem__(self, key: str, value: int) -> None:
        bounded = self._bounded(key)
        if bounded != key:  # counted under the overflow event, by the increment
            value = self.get(bounded, 0) + max(0, value - self.get(key, 0))
            key = bounded
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if self._prom is not None and delta > 0:
            self._prom.labels(event=key).inc(delta)

    def fallback(self, reason: str) -> None:
        """One request fell back to standard prefill for ``reason`` (``kind: detail``):
        counted overall and under its kind."""
        self["fallbacks"] += 1
        self[f"fallback_{reason.split(':')[0]}"] += 1
