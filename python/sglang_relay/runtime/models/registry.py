"""The served architectures: every adapter of :mod:`.adapters` by its architecture name.

Imports the adapters, which import :mod:`.anatomy`; :mod:`.anatomy` imports neither, so the
lookup has no import loop.
"""

from __future__ import annotations

from sglang_relay.runtime.models.adapters import ADAPTERS
from sglang_relay.runtime.models.anatomy import Anatomy


def _by_architecture(adapters: tuple[Anatomy, ...]) -> dict[str, Anatomy]:
    found: dict[str, Anatomy] = {}
    for adapter in adapters:
        if adapter.architecture in found:
            raise ValueError(f"two adapters for {adapter.architecture}")
        found[adapter.architecture] = adapter
    return found


ANATOMIES: dict[str, Anatomy] = _by_architecture(ADAPTERS)
SUPPORTED_ARCHITECTURES = frozenset(ANATOMIES)
# the decoder forwards relay's model hook wraps (several architectures share one)
MODEL_FORWARD_TARGETS = tuple(dict.fromkeys(a.model_forward for a in ANATOMIES.values()))


def anatomy_of(architecture: str) -> Anatomy:
    """The adapter SGLang's ``architecture`` is served with (ValueError naming the served ones)."""
    try:
        return ANATOMIES[architecture]
    except KeyError:
        raise ValueError(
            f"sglang-relay has no adapter for the {architecture} architecture (supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        ) from None
