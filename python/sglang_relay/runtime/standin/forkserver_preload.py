"""The last module the CPU stand-in's forkserver imports (``runtime/standin/cpu.py:
FORKSERVER_PRELOAD``): importing it loads SGLang's plug-ins and applies their hooks in the
forkserver, after it imported the scheduler and detokenizer modules, so the children it
forks start with them applied (SGLang's ``load_plugins`` then returns at once in each) instead
of each running every plug-in's ``register`` and walking every loaded module once per hook
target (~1.5 s of one core per process here).

The forkserver is a fresh interpreter started after SGLang and relay set the environment, and
the plug-ins installed only read that environment (``runtime/sglang/server.py:
ENV_ONLY_PLUGINS``); with any other plug-in installed nothing is loaded here and each child
loads the plug-ins itself, as SGLang does."""

from sglang_relay.runtime.import_gc import freeze_and_resume
from sglang_relay.runtime.sglang.server import (
    installed_general_plugins,
    load_sglang_plugins,
    plugins_load_once_for_children,
)

if plugins_load_once_for_children(installed_general_plugins()):
    load_sglang_plugins()
freeze_and_resume()  # the imports frozen, the collector on (forkserver_first paused it)
