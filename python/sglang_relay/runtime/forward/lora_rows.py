"""LoRA batch info for a subset of a batch's token rows.

SGLang prepares its LoRA batch info once per forward, for every token row of the batch:
segments of consecutive rows under one adapter slot (``seg_lens`` / ``seg_indptr``, the
slot of each in ``weight_indices``). Every LoRA-wrapped layer reads it from its backend
(``backend.batch_info``) and walks the rows it is given segment by segment, without
checking that they add up. Relay recomputes *subsets* of rows through SGLang's layers
(the selected rows of a phase, the rows at the detection layer, the probe's row, a
finished request's context pass), so under LoRA each such call needs the info of its own
rows, or the adapters land on the wrong rows, silently (``research/lora-study.md``).

:func:`rows_info` derives that info from the full batch's: the slot of each selected row
is the slot of the full segment holding it, run-length encoded over the selected rows in
their order (sorted or not). :func:`rows_swapped` installs it on the backend around a call
and restores the full batch's after. SGLang's torch_native backend (the one that runs on a
CPU) reads only the host copies (``*_cpu``); the device fields get the same values.
Relay's extend (``extend.py``: each phase's rows, the detection layer's rows, the probe's
rows; each row set's info built once, not per layer) runs its layers inside
:func:`installed`; the context pass of a finished request
(``runtime.span_context``), which runs outside any batch, runs on the base weights
(:func:`base_only`): its masses only rank tokens for recompute."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def row_slots(info: Any, rows: torch.Tensor) -> torch.Tensor:
    """The adapter slot of each of ``rows`` (indices into the full batch's token rows)."""
    rows = rows.to("cpu", torch.int64)
    ends = info.seg_indptr_cpu[1 : info.num_segments + 1].to(torch.int64)
    total = int(ends[-1]) if len(ends) else 0
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= total):
        raise ValueError(f"rows outside the batch's {total} LoRA rows")
    segment = torch.searchsorted(ends, rows, right=True)
    return info.weight_indices_cpu[: info.num_segments].to(torch.int64)[segment]


def rows_info(info: Any, rows: torch.Tensor) -> Any:
    """A copy of the full batch's LoRA info ``info`` describing only ``rows``, in order."""
    slots = row_slots(info, rows)
    n = slots.numel()
    if n == 0:
        starts = torch.zeros(0, dtype=torch.int64)
    else:
        change = torch.ones(n, dtype=torch.bool)
        change[1:] = slots[1:] != slots[:-1]
        starts = torch.nonzero(change).flatten()
    lens = torch.diff(torch.cat([starts, torch.tensor([n])])).to(torch.int32)
    weights = slots[starts].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    device = info.seg_lens.device if info.seg_lens is not None else torch.device("cpu")
    return dataclasses.replace(
        info,
        bs=len(lens),
        num_segments=len(lens),
        max_len=int(lens.max()) if len(lens) else 0,
        seg_lens=lens.to(device),
        seg_indptr=indptr.to(device),
        weight_indices=weights.to(device),
        seg_lens_cpu=lens,
        seg_indptr_cpu=indptr,
        weight_indices_cpu=weights,
        expected_tokens=n,
        permutation=None,
    )


def info_for(backend: Any, rows: torch.Tensor) -> Any:
    """The info of ``rows`` on a LoRA server's ``backend`` (None: no backend, or no LoRA
    in this forward). Built once per row set; :func:`installed` swaps it in per call."""
    full = None if backend is None else backend.batch_info
    return None if full is None else rows_info(full, rows)


@contextmanager
def installed(backend: Any, info: Any) -> Iterator[None]:
    """Within the block ``backend``'s LoRA layers read ``info`` (from :func:`info_for`);
    the full batch's info is back afterwards, also if the block raises. ``info`` None
    leaves the backend alone."""
    if info is None:
        yield
        return
    full = backend.batch_info
    backend.batch_info = info
    try:
        yield
    finally:
        backend.batch_info = full


def rows_swapped(backend: Any, rows: torch.Tensor):
    """:func:`installed` with the info of ``rows`` built for this one call."""
    return installed(backend, info_for(backend, rows))


@contextmanager
def base_only(backend: Any) -> Iterator[None]:
    """Within the block ``backend``'s LoRA layers add nothing (SGLang's layers skip LoRA
    when their backend has no batch info)."""
    if backend is None:
        yield
        return
    full = backend.batch_info
    backend.batch_info = None
    try:
        yield
    finally:
        backend.batch_info = full
