"""A test-only SGLang plug-in that injects faults into a relay server, so the tests prove that
relay's safety nets catch what they are meant to catch. The product never calls it: a test
puts this folder on the server's ``PYTHONPATH`` (:data:`PLUGIN_DIR`), where SGLang's plug-in
loader finds its entry point (``relay_test_faults-0.dist-info``) in every server process,
and names the faults in ``SGLANG_RELAY_FAULTS`` (comma-separated):

- ``bypass_forward@N``: the N-th model forward that reaches a scheduler's relay runtime
  runs SGLang's forward instead, unstamped, as an unclassified option that replaced the
  forward would; the runtime invariant must turn relay off (``RelayRuntime.check_forward``).
- ``plan_error@rankR[:T]``: planning a relay extend raises on TP rank R (for batches
  holding token id T only, if given); every rank must fall back together (no rank left
  waiting in a collective).
- ``scratch_full@rankR:T``: on TP rank R, a relay extend of a batch holding token id T
  finds no memory free for relay's own buffers; every rank must fall back together,
  before the forward (reason ``memory``).
- ``prepare_error@rankR:T``: on TP rank R, preparing a relay extend of a batch holding
  token id T raises (as an out-of-memory splicing its spans would); every rank must fall
  back together.
- ``record_error``: computing a finished output's context masses raises (as an out-of-memory
  copying a long row's keys would) inside SGLang's ``cache_finished_req``; the span must be
  dropped and counted, the server must keep serving.

Each fault wraps one method of relay's classes when the plug-in registers; without
``SGLANG_RELAY_FAULTS`` it registers nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ENV_FAULTS = "SGLANG_RELAY_FAULTS"
PLUGIN_DIR = str(Path(__file__).resolve().parent)


_registered = False


class InjectedFault(RuntimeError):
    """Raised where a test asked for a failure."""


def faults(env: dict[str, str] | None = None) -> dict[str, str]:
    """``SGLANG_RELAY_FAULTS`` as ``{name: argument}``."""
    out = {}
    for item in (os.environ if env is None else env).get(ENV_FAULTS, "").split(","):
        name, _, arg = item.strip().partition("@")
        if name:
            out[name] = arg
    return out


def server_env(spec: str) -> dict[str, str]:
    """The environment a test server needs for the faults ``spec`` names."""
    path = [PLUGIN_DIR, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {ENV_FAULTS: spec, "PYTHONPATH": os.pathsep.join(path)}


def _bypass_forward(n: int) -> None:
    from sglang_relay.runtime.runtime import RelayRuntime

    relay_forward = RelayRuntime.forward
    seen = [0]

    @functools.wraps(relay_forward)
    def forward(self, original, model, input_ids, positions, fb, *args, **kwargs):
        seen[0] += 1
        if seen[0] == n:
            return original(model, input_ids, positions, fb, *args, **kwargs)
        return relay_forward(self, original, model, input_ids, positions, fb, *args, **kwargs)

    RelayRuntime.forward = forward


def _marked(arg: str, tp, input_ids) -> bool:
    """Whether a fault ``rankR[:T]`` applies on this rank (``tp``) to a batch of ``input_ids``."""
    rank, _, token = arg.partition(":")
    if f"rank{tp.rank if tp is not None else 0}" != rank:
        return False
    return not token or bool((input_ids == int(token)).any())


def _plan_error(arg: str) -> None:
    from sglang_relay.runtime.sched.planner import Planner

    plan_batch = Planner.plan_batch

    @functools.wraps(plan_batch)
    def planned(self, fb, *args, **kwargs):
        if _marked(arg, self.tp, fb.input_ids):
            raise InjectedFault(f"injected plan failure on TP {arg}")
        return plan_batch(self, fb, *args, **kwargs)

    Planner.plan_batch = planned


def _extend_faults(asked: dict[str, str]) -> None:
    import sglang_relay.runtime.runtime as rt

    relay, prepare = rt.RelayRuntime._relay, rt.relay_prepare

    def failing_prepare(*args, **kwargs):
        raise InjectedFault("injected failure preparing a relay extend")

    @functools.wraps(relay)
    def wrapped(self, original, model, input_ids, *args, **kwargs):
        full = "scratch_full" in asked and _marked(asked["scratch_full"], self.tp, input_ids)
        fail = "prepare_error" in asked and _marked(asked["prepare_error"], self.tp, input_ids)
        if full:
            self.scratch_free = lambda: 0
        if fail:
            rt.relay_prepare = failing_prepare
        try:
            return relay(self, original, model, input_ids, *args, **kwargs)
        finally:
            self.__dict__.pop("scratch_free", None)
            rt.relay_prepare = prepare

    rt.RelayRuntime._relay = wrapped


def _record_error() -> None:
    from sglang_relay.runtime.runtime import RelayRuntime

    def span_context(self, *args, **kwargs):
        raise InjectedFault("injected failure recording a span")

    RelayRuntime.span_context = span_context


def register() -> None:
    """SGLang's plug-in entry point: wrap what ``SGLANG_RELAY_FAULTS`` names (once)."""
    global _registered
    asked = faults()
    if not asked or _registered:  # a forked child has its parent's wrapped classes
        return
    _registered = True
    if "bypass_forward" in asked:
        _bypass_forward(int(asked["bypass_forward"]))
    if "plan_error" in asked:
        _plan_error(asked["plan_error"])
    if "record_error" in asked:
        _record_error()
    if "scratch_full" in asked or "prepare_error" in asked:
        _extend_faults(asked)
