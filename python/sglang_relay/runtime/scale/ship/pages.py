"""Where a span's KV sits in a relay host pool, as byte ranges a transfer engine moves.

A host pool of SGLang's MHA class keeps K and V in one buffer ``kv_buffer``:
``layer_first`` ``[2, L, size, H, D]`` or ``page_first`` ``[2, size, L, H, D]``. Every
address is computed from the pool's own base pointer, strides and ``size`` (each server's
pool has its own), never copied from a peer. Consecutive host slots on both sides are
moved as one range: a fresh pool hands out runs, so a span is a few ranges per layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

LAYOUTS = ("layer_first", "page_first")


@dataclass(frozen=True, slots=True)
class Geometry:
    """What two servers must share for one's host pages to be the other's KV."""

    layout: str
    layer_num: int
    head_num: int
    head_dim: int
    dtype: str
    page_size: int
    hidden: int  # the stored hidden row's width (0: none stored)
    hidden_dtype: str
    model: str  # digest of the model's configuration (weights: the operator pairs them)
    # where the side rows come from (-1: none): the stored hidden row's layer, the
    # influence scores' and the context masses' (two servers of other relay settings
    # would read each other's rows as their own)
    capture_layer: int = -1
    influence_layer: int = -1
    context_layer: int = -1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pool_geometry(
    host_pool: Any, *, hidden: torch.Tensor | None, model: str, layers: dict[str, int | None]
) -> Geometry:
    """The geometry of ``host_pool`` (ValueError for a layout or pool shipping cannot read)."""
    layout = str(host_pool.layout)
    buf = host_pool.kv_buffer
    if layout not in LAYOUTS or not isinstance(buf, torch.Tensor) or buf.dim() != 5:
        raise ValueError(
            f"span shipping reads MHA host pools of layout {' or '.join(LAYOUTS)}; this "
            f"server's relay host pool is {type(host_pool).__name__} ({layout})"
        )
    if getattr(host_pool, "v_head_dim", host_pool.head_dim) != host_pool.head_dim:
        raise ValueError("span shipping needs K and V of one head width")
    return Geometry(
        layout=layout,
        layer_num=int(host_pool.layer_num),
        head_num=int(host_pool.head_num),
        head_dim=int(host_pool.head_dim),
        dtype=str(host_pool.dtype),
        page_size=int(host_pool.page_size),
        hidden=0 if hidden is None else int(hidden.shape[1]),
        hidden_dtype="" if hidden is None else str(hidden.dtype),
        model=model,
        **{k: -1 if v is None else int(v) for k, v in layers.items()},
    )


def model_digest(hf_config: Any) -> str:
    """A digest of the served model's configuration (its path excluded)."""
    conf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    conf = {k: v for k, v in conf.items() if k not in ("_name_or_path", "transformers_version")}
    text = repr(sorted((k, repr(v)) for k, v in conf.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of the maximal runs of consecutive values in ``idx``, in order."""
    values = idx.to(torch.int64).tolist()
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def paired_runs(a: torch.Tensor, b: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(a_start, b_start, length)``: runs consecutive in both ``a`` and ``b`` (same length)."""
    out: list[tuple[int, int, int]] = []
    for x, y in zip(a.to(torch.int64).tolist(), b.to(torch.int64).tolist(), strict=True):
        if out and out[-1][0] + out[-1][2] == x and out[-1][1] + out[-1][2] == y:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((x, y, 1))
    return out


@dataclass(frozen=True, slots=True)
class PoolAddress:
    """Byte addresses in one server's host pool buffer (``base``: its data pointer)."""

    layout: str
    base: int
    size: int  # slots
    layer_num: int
    row_bytes: int  # one token's K (or V) in one layer: H * D * itemsize

    @classmethod
    def of(cls, host_pool: Any) -> PoolAddress:
        buf = host_pool.kv_buffer
        return cls(
            layout=str(host_pool.layout),
            base=int(buf.data_ptr()),
            size=int(host_pool.size),
            layer_num=int(host_pool.layer_num),
            row_bytes=int(host_pool.head_num * host_pool.head_dim * buf.element_size()),
        )

    @property
    def nbytes(self) -> int:
        return 2 * self.layer_num * self.size * self.row_bytes

    def ranges(self, start: int, length: int) -> list[tuple[int, int]]:
        """``(address, bytes)`` of slots ``start .. start+length`` in every layer, K then V."""
        if start < 0 or start + length > self.size:
            raise ValueError(f"slots {start}..{start + length} outside a pool of {self.size}")
        L, r = self.layer_num, self.row_bytes
        if self.layout == "layer_first":  # [2, L, size, H, D]
            return [
                (self.base + ((kv * L + layer) * self.size + start) * r, length * r)
                for kv in range(2)
                for layer in range(L)
            ]
        # page_first [2, size, L, H, D]: a run of slots holds every layer
        return [(self.base + (kv * self.size + start) * L * r, length * L * r) for kv in range(2)]


def transfer_lists(
    local: PoolAddress, local_idx: torch.Tensor, remote: PoolAddress, remote_idx: torch.Tensor
) -> tuple[list[int], list[int], list[int]]:
    """Local pointers, remote pointers and lengths moving ``remote_idx``'s slots into
    ``local_idx``'s (same order, same layout and row width on both sides)."""
    if local.layout != remote.layout or local.row_bytes != remote.row_bytes:
        raise ValueError("host pools of different layouts or row widths")
    lp: list[int] = []
    rp: list[int] = []
    ln: list[int] = []
    for a, b, n in paired_runs(local_idx, remote_idx):
        for (la, lb), (ra, _) in zip(local.ranges(a, n), remote.ranges(b, n), strict=True):
            lp.append(la)
            rp.append(ra)
            ln.append(lb)
    return lp, rp, ln
