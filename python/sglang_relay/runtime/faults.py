"""Fault points for tests: ``SGLANG_RELAY_FAULTS`` (read once per process) names faults
to inject, comma-separated. Unset on every real server; the tests that set it prove that
relay's safety nets catch what they are meant to catch.

- ``bypass_forward@N``: the N-th model forward of a scheduler skips relay's hook (runs
  SGLang's forward unstamped), as an unclassified option that replaced the forward would;
  the runtime invariant must turn relay off (:meth:`RelayRuntime.check_forward`).
- ``plan_error@rankR``: planning a relay extend raises on TP rank R; every rank must fall
  back together (no rank left waiting in a collective).
"""

from __future__ import annotations

import functools
import os

ENV_FAULTS = "SGLANG_RELAY_FAULTS"


class InjectedFault(RuntimeError):
    """Raised where a test asked for a failure."""


@functools.cache
def _faults() -> dict[str, str]:
    out = {}
    for item in os.environ.get(ENV_FAULTS, "").split(","):
        name, _, arg = item.strip().partition("@")
        if name:
            out[name] = arg
    return out


_forwards = [0]


def bypass_this_forward() -> bool:
    """Whether the current model forward must skip relay's hook (``bypass_forward@N``)."""
    arg = _faults().get("bypass_forward")
    if arg is None:
        return False
    _forwards[0] += 1
    return _forwards[0] == int(arg)


def plan_error(tp_rank: int) -> None:
    """Raise :class:`InjectedFault` on the TP rank ``plan_error@rankR`` names."""
    arg = _faults().get("plan_error")
    if arg is not None and arg == f"rank{tp_rank}":
        raise InjectedFault(f"injected plan failure on TP rank {tp_rank}")
