"""SGLang's imports without Python's cyclic garbage collector.

Importing SGLang allocates millions of long-lived objects; the collector's generation
thresholds make it walk all of them again and again while they are created (a third of
the import's CPU here: ``import sglang.srt.entrypoints.http_server`` ~16 s with it, ~10-13
s without; ``research/log.md``). ``serve`` imports SGLang with the collector paused; the
CPU stand-in's forkserver imports its preload with it paused and re-enables it in every
child at the fork. After the imports the objects are frozen (``gc.freeze``: the collector
never walks them again, and forked children do not copy their pages to update them) and
the collector runs as before. Nothing else changes: garbage made while paused is collected
at the next run (or, if frozen with the imports, kept, as the modules themselves are).
SGLang's graph capture (``freeze_gc``) unfreezes everything when it is done: from then on
that process collects as if nothing had been frozen.

``SGLANG_RELAY_IMPORT_GC=1`` keeps the collector on throughout (the comparison)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

IMPORT_GC_ENV = "SGLANG_RELAY_IMPORT_GC"


def _pausing() -> bool:
    return os.environ.get(IMPORT_GC_ENV) != "1" and gc.isenabled()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside; then the surviving objects frozen and it back on."""
    if not _pausing():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def pause_until_fork() -> None:
    """The forkserver's first preload: the collector off for the imports that follow, and
    on again in every child it forks (whatever happens to the later preloads)."""
    if _pausing():
        gc.disable()
        os.register_at_fork(after_in_child=gc.enable)


def freeze_and_resume() -> None:
    """The forkserver's last preload: the imports frozen, the collector on again."""
    if not gc.isenabled() and os.environ.get(IMPORT_GC_ENV) != "1":
        gc.freeze()
        gc.enable()


def collector_state() -> dict:
    """What the server info reports for this process (the scheduler's)."""
    return {"enabled": gc.isenabled(), "frozen_objects": gc.get_freeze_count()}
