"""Relay counters, mirrored to Prometheus when SGLang runs with ``--enable-metrics``.

SGLang exports every process's prometheus_client metrics through its multiprocess
directory (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the scheduler starts),
so a Counter created in the scheduler appears on the server's ``/metrics`` as
``sglang_relay:events_total{event="..."}``.
"""

from __future__ import annotations

import contextlib
import re
import time
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


class PhaseClock:
    """Wall time relay's own work takes, per phase, summed over the server's life (a
    benchmark's breakdown: ``bench ttft`` reads it around each request). Off unless
    ``SGLANG_RELAY_PHASE_TIMES=1``; on CUDA a timed phase synchronizes the device at both
    ends, so its time is its work's and timing costs a sync per phase: a measuring
    setting, not a serving one. Phases: ``match`` (a request's spans found and planned),
    ``plan_batch`` (a batch's plan, host copies back included), ``prepare`` (memory bound,
    stamps, splice), ``probe``, ``layers`` (the layer loop), ``context`` (a finished
    output's context masses, after its answer)."""

    ENV = "SGLANG_RELAY_PHASE_TIMES"

    def __init__(self, enabled: bool, device: str = "cpu") -> None:
        self.enabled = enabled
        self.cuda = str(device).startswith("cuda")
        self.ms: Counter[str] = Counter()
        self.n: Counter[str] = Counter()

    @classmethod
    def from_env(cls, device: str = "cpu") -> PhaseClock:
        import os

        return cls(os.environ.get(cls.ENV) == "1", device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.ms[phase] += 1000 * (time.perf_counter() - t0)
            self.n[phase] += 1

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def stats(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {f"phase_{k}_ms": round(v, 3) for k, v in self.ms.items()} | {
            f"phase_{k}_n": v for k, v in self.n.items()
        }
