"""CPU stand-in for ``sgl_kernel`` (put on sys.path by sglang_relay.cpu_setup only).

The PyPI wheel of sgl-kernel needs libcuda and its CPU build is not on PyPI, yet SGLang
imports a few of its names at start-up even when it never calls them on the CPU. Every
top-level name resolves to a function that raises a clear error if it is ever called, so
a code path that really needs a kernel fails loudly instead of computing something wrong.
The exceptions are the ops NGRAM and EAGLE speculative decoding need on a CPU
(``sglang_relay.runtime.standin.cpu_spec.OPS``, ``cpu_eagle.OPS``): those resolve to pure-torch
versions of the same contract. Other submodules (``sgl_kernel.scalar_type``...) do not
exist: SGLang guards those imports with ``except ImportError`` and picks its fallbacks;
``sgl_kernel.speculative`` holds NGRAM's tree-mask op only.
"""

from __future__ import annotations

SGL_RELAY_CPU_SHIM = True


class SglKernelUnavailable(RuntimeError):
    pass


def _missing(qualname: str):
    def kernel(*args, **kwargs):
        raise SglKernelUnavailable(
            f"sgl_kernel.{qualname} was called, but this CPU-only machine runs SGLang with "
            "sglang-relay's stand-in for sgl-kernel (no CPU build of sgl-kernel is on PyPI). "
            "This code path needs a GPU or a CPU build of sgl-kernel."
        )

    kernel.__name__ = kernel.__qualname__ = qualname.rsplit(".", 1)[-1]
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from sglang_relay.runtime.standin import cpu_eagle, cpu_spec

    for ops in (cpu_spec, cpu_eagle):
        if name in ops.OPS:
            return getattr(ops, name)
    return _missing(name)
