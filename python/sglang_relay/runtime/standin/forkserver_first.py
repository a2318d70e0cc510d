"""The first module the CPU stand-in's forkserver imports (``runtime/standin/cpu.py:
FORKSERVER_PRELOAD``): the collector stays off while the SGLang modules after it are
imported, and comes back on in every child at its fork (``runtime/import_gc.py``);
``forkserver_preload``, the last, freezes what they made and turns it on again."""

from sglang_relay.runtime.import_gc import pause_until_fork

pause_until_fork()
