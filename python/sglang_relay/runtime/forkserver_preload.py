"""The last module the CPU stand-in's forkserver imports (``runtime/cpu.py:
FORKSERVER_PRELOAD``): importing it loads SGLang's plug-ins and applies their hooks in the
forkserver, after it imported the scheduler and detokenizer modules, so the children it
forks start with them applied (SGLang's ``load_plugins`` then returns at once in each) instead
of each running relay's ``register`` and walking every loaded module once per hook target
(~1.3 s of one core per process here).

The forkserver is a fresh interpreter started after SGLang and relay set the environment, so
``register`` reads the environment the children would read; it reads nothing else of the
process it runs in (``runtime/plugin.py``)."""

from sglang_relay.runtime.sglang.server import load_sglang_plugins

load_sglang_plugins()
