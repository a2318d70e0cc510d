"""Everything relay keeps per process outside a :class:`~.runtime.RelayRuntime`, in one
object (:data:`STATE`): what was registered, what was looked up once, what is in flight.

SGLang runs relay's hooks in several processes (engine, tokenizer manager, schedulers, DP
controller), each with its own copy; nothing here is shared between processes. A leaf
module: it imports nothing of relay's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProcessState:
    # plug-in: register() ran here (plugin.py); the hooks it registered, for the start-up
    # proof that each wraps its target (sglang/hooks.py)
    plugin_registered: bool = False
    # the CPU stand-in's register() ran here (standin/__init__.py)
    standin_registered: bool = False
    hooks: list[tuple[str, object]] = field(default_factory=list)
    # looked up once: this process's TP group (None under tp 1; sglang/model.py), the
    # early-stop guard's policy (None: not a relay server; plugin.py), the server settings
    # per model path and SGLANG_RELAY_* environment (settings.py)
    tp_group: Any | None = None
    tp_group_known: bool = False
    guard_policy: Any | None = None
    guard_policy_known: bool = False
    settings: dict[tuple, Any] = field(default_factory=dict)
    # the DP controller's router, at most one (dp_routing.py)
    dp_router: Any | None = None
    # rid of a request -> rid of its early-stop redo in flight, so an abort reaches both
    # (guard.py)
    live_redos: dict[str, str] = field(default_factory=dict)
    # side memory the KV-budget hook reserved, per KVCacheConfigurator, found by identity (a
    # slots dataclass: no attribute can be added, no weak reference taken, not hashable;
    # the model runner keeps its configurator for the life of the process; budget.py)
    reserved: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    # the torch.library fragment defining the CPU graph runner's placeholder ops
    # (standin/cpu_graph.py)
    cpu_graph_library: Any | None = None


STATE = ProcessState()
