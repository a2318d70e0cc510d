"""One adapter per architecture, one file each: a module here defines ``ADAPTERS``, the
:class:`~sglang_relay.runtime.models.anatomy.Anatomy` entries it registers (an architecture
SGLang serves with another's classes, such as Mistral with Llama's, is its own file too).

Adding an architecture: write ``<name>.py`` here with its ``ADAPTERS`` (the decoder forward
to hook, the attention modules its q/k/v preparation uses, how it prepares q/k/v, its MLP
blocks) and add it to :data:`ADAPTERS` below; add a small random config of it to
``sglang_relay.bench.models.ARCHITECTURES`` and its name to
``test/e2e/test_architectures.py``. The start-up check refuses any served layer that holds
something the adapter does not name (``anatomy.anatomy_problems``).
"""

from __future__ import annotations

from sglang_relay.runtime.models.adapters import (
    deepseek_v2,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)

# every adapter, in module-name order (test_anatomy checks this list against the folder)
MODULES = (
    deepseek_v2,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
ADAPTERS = tuple(adapter for module in MODULES for adapter in module.ADAPTERS)
