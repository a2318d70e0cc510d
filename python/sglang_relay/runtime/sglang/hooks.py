"""Registering relay's hooks on SGLang's hook registry, and proving they are in place."""

from __future__ import annotations

from sglang_relay.runtime.state import STATE


def hook_registry():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return HookRegistry, HookType


def resolve(target: str):
    """The object a dotted ``module.attr[.attr...]`` names (the longest importable module
    prefix, then attributes)."""
    import importlib

    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(target)


def hook_installed(target: str, hook) -> bool:
    """Whether ``hook`` wraps ``target`` now (walks the hook registry's wrapper chain)."""
    fn = resolve(target)
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is hook for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def register_hook(target: str, hook, kind: str) -> None:
    """Register ``hook`` on ``target`` (``before``/``after``/``around``) and remember it for
    :func:`check_hooks_installed`."""
    registry, hook_type = hook_registry()
    registry.register(target, hook, getattr(hook_type, kind.upper()))
    STATE.hooks.append((target, hook))


def check_hooks_installed() -> None:
    """Raise unless every hook the plug-in registered wraps its target in this process."""
    missing = [t for t, h in STATE.hooks if not hook_installed(t, h)]
    if not STATE.hooks or missing:
        raise RuntimeError(
            "sglang-relay hooks are not installed"
            + (f" ({', '.join(missing)})" if missing else " (register() never ran)")
            + "; is the plug-in loaded (pip show sglang-relay, SGLANG_PLUGINS)?"
        )
    from sglang_relay.runtime.platform import cpu_engine_active

    if cpu_engine_active() and not STATE.standin_registered:
        raise RuntimeError(
            "sglang-relay: this CPU server was set up for relay's CPU stand-in, but its plug-in "
            "(relay-cpu) did not run; add it to SGLANG_PLUGINS (relay,relay-cpu)"
        )
