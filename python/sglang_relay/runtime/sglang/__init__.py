"""The one place that names SGLang internals, checked against the pinned version at import.

This package is the whole contract between sglang-relay and SGLang 0.5.23; every ``sglang``
import and every attribute of an SGLang object the plug-in reads is named in it, each
module one job:

* :mod:`.targets`: the dotted hook targets (what relay wraps in SGLang);
* :mod:`.hooks`: registering those hooks and proving at start-up that each is in place;
* :mod:`.views`: one typed view per SGLang object relay reads (``Req``, ``ForwardBatch``,
  the model runner, ...), checked where an instance first appears;
* :mod:`.server`: the launcher and the options as SGLang resolved them;
* :mod:`.model`: the served model (its decoder stack, TP group, graph state);
* :mod:`.scheduling`: requests as the scheduler, the tokenizer manager and the DP
  controller hold them.

The decoder modules each supported architecture has, and the attributes read off them,
are the other half of the contract (``runtime/models/anatomy.py`` and the adapters). At start-up
:func:`.hooks.check_hooks_installed` verifies that every hook is really in place and
:func:`.model.check_model_anatomy` that the served model has the modules the relay loops
call; either fails loudly instead of serving "nothing relayed, no error".

The plug-in replaces no attribute of an SGLang object. It adds two to the served model,
the runtime reference and the decode capture (:mod:`.model`, installed before SGLang
captures decode graphs), so the model-forward hook reaches them without a module-level
registry. On a CPU-only machine the stand-in (``runtime/standin/``) also re-registers the
``torch_native`` attention backend factory for servers that compile their decode forwards.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED_SGLANG = ("0.5.23",)

try:
    SGLANG_VERSION = version("sglang")
except PackageNotFoundError as exc:  # pragma: no cover - packaging error
    raise ImportError("sglang-relay needs SGLang installed (pip install sglang==0.5.23)") from exc

if SGLANG_VERSION not in SUPPORTED_SGLANG:
    raise ImportError(
        f"sglang-relay supports SGLang {', '.join(SUPPORTED_SGLANG)}; found {SGLANG_VERSION}. "
        "Install the supported release or upgrade sglang-relay."
    )
