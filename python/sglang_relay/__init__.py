"""sglang-relay: RelayCaching for SGLang (reuse decoded KV of upstream agents downstream).

Importing this package is cheap: it does not import torch or sglang. The runtime plug-in
lives in :mod:`sglang_relay.runtime`, the pure-torch algorithms in :mod:`sglang_relay.core`.
"""

from __future__ import annotations

__version__ = "0.1.0"
