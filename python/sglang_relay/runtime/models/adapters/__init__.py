"""One adapter per architecture, one file each: a module here defines ``ADAPTERS``, the
:class:`~sglang_relay.runtime.models.anatomy.Anatomy` entries it registers (an architecture SGLang
serves with another's classes, such as Mistral with Llama's, is its own file too).

Adding an architecture: write ``<name>.py`` here with its ``ADAPTERS`` (the decoder forward
to hook, the attention modules its q/k/v preparation uses, how it prepares q/k/v, its MLP
blocks); add a small random config of it to ``sglang_relay.bench.models.ARCHITECTURES`` and
its name to ``test/e2e/test_architectures.py``. The start-up check refuses any served
layer that holds something the adapter does not name (``anatomy.anatomy_problems``).
"""

from __future__ import annotations

import pkgutil
from importlib import import_module


def discover() -> list:
    """Every adapter of every module of this package, in module-name order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        found.extend(import_module(f"{__name__}.{info.name}").ADAPTERS)
    return found
