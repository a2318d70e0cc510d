"""Which platform this process serves on: whether CUDA is there, and whether relay's CPU
stand-in (:mod:`sglang_relay.runtime.standin`) set this process up.

A leaf module (nothing of relay's imported): product code asks it (a refusal that only
applies on a CPU host) without importing the stand-in itself.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    if os.environ.get("SGLANG_RELAY_FORCE_CPU") == "1":
        return False
    import torch

    return bool(torch.cuda.is_available())


# set by ``sglang_relay.cpu_setup.activate`` (``sglang-relay serve``, the tests): the
# stand-in's hooks are on
CPU_STANDIN_ENV = "SGLANG_RELAY_CPU_STANDIN"


def cpu_engine_active() -> bool:
    """Whether this process serves on the CPU as relay's stand-in set it up (set by
    ``sglang_relay.cpu_setup.activate``, inherited by the processes SGLang spawns). SGLang's own
    ``SGLANG_USE_CPU_ENGINE=1`` alone is not enough: a plain SGLang server on a CPU host
    with the package installed keeps SGLang's behaviour, untouched."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and os.environ.get(CPU_STANDIN_ENV) == "1"
