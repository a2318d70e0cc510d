"""Token rows of a host KV pool of SGLang's MHA class, in either of its layouts: read,
written and digested the same way (``kv_buffer`` ``[2, L, size, H, D]`` for
``layer_first``, ``[2, size, L, H, D]`` for ``page_first``). The digest of a span's rows
is what span shipping checks a pulled copy against, and what the host tier checks again
before a shipped copy goes back to the device."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def read_rows(pool: Any, idx: torch.Tensor) -> torch.Tensor:
    """The K and V rows of slots ``idx`` in every layer: ``[2, L, n, H, D]``."""
    buf = pool.kv_buffer
    idx = idx.to(torch.int64).to(buf.device)
    return buf[:, :, idx] if pool.layout == "layer_first" else buf[:, idx].transpose(1, 2)


def write_rows(pool: Any, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """Put ``rows`` (``[2, L, n, H, D]``, as :func:`read_rows` gives them) at slots ``idx``."""
    buf = pool.kv_buffer
    idx = idx.to(torch.int64).to(buf.device)
    rows = rows.to(buf.device, buf.dtype)
    if pool.layout == "layer_first":
        buf[:, :, idx] = rows
    else:
        buf[:, idx] = rows.transpose(1, 2)


def digest(pool: Any, idx: torch.Tensor) -> str:
    """blake2b of the KV bytes of ``idx``'s slots (K then V, layer by layer, in the slots'
    order): the same for the same KV in either layout's pool."""
    data = read_rows(pool, idx).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
