"""Relay counters, mirrored to Prometheus when SGLang runs with ``--enable-metrics``.

SGLang exports every process's prometheus_client metrics through its multiprocess
directory (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the scheduler starts),
so a Counter created in the scheduler appears on the server's ``/metrics`` as
``sglang_relay:events_total{event="..."}``.
"""

from __future__ import annotations

from collections import Counter


class RelayCounters(Counter):
    """A ``collections.Counter`` whose increments also go to a Prometheus counter."""

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

    def __setitem__(self, key: str, value: int) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if self._prom is not None and delta > 0:
            self._prom.labels(event=key).inc(delta)
