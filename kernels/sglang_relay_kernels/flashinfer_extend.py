"""The relay extend's attention on FlashInfer: non-contiguous query rows over each request's
whole context, causal by absolute position, as one paged prefill with a custom mask.

The layout is a pure function (:func:`build_extend_plan`, tested on CPU against the
torch_native semantics of :func:`sglang_relay.core.attention.positional_causal_attention`
through :func:`attend_with_plan_ref`, which reads the plan exactly as FlashInfer does).
Only :class:`FlashInferExtend` touches the GPU library:

* page size 1, so a request's page table is its slot list (``req_to_token[r, :seq_len]``);
* ``qo_indptr``: the request's active rows (rows of the batch, grouped by request);
* ``custom_mask``: for each request, ``[rows, seq_len]`` row-major, flattened,
  ``mask[i, j] = j <= q_pos[i]``: a row sees every position up to its own, whichever rows
  are active in this layer (their KV was written before the attention call).

The active rows change from one layer group to the next (all span rows in ``[l_start,
l_det)``, the selected ones in ``[l_det, l_end]``, new tokens only elsewhere), so a forward
plans at most three times and runs every layer with the plan of its group (a model with
sliding-window layers: once per group and window, the window in the mask:
``q_pos[i] - window < j <= q_pos[i]``).

Sinks (gpt-oss: one logit per query head joining the softmax with no value) are not left
to the wrapper's ``sinks`` argument, which only some of FlashInfer's backends read: the
run asks for the log-sum-exp and rescales, ``out * sigmoid(lse - sink[h])`` (the sink-free
output times the keys' share of the denominator; :func:`sink_rescale`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_relay.core.attention import sink_rescale, visible


@dataclass(frozen=True)
class ExtendPlan:
    """FlashInfer's CSR description of one relay-extend attention call."""

    qo_indptr: torch.Tensor  # [B + 1] int32, rows per request
    kv_indptr: torch.Tensor  # [B + 1] int32, pages (= slots) per request
    kv_indices: torch.Tensor  # [sum seq_len] int32 slots
    kv_last_page_len: torch.Tensor  # [B] int32, all ones (page size 1)
    custom_mask: torch.Tensor  # [sum rows_r * seq_len_r] bool
    mask_indptr: torch.Tensor  # [B + 1] int64 offsets of each request's mask block


def build_extend_plan(
    row_counts: Sequence[int],
    q_positions: torch.Tensor,
    seq_lens: Sequence[int],
    slots: Sequence[torch.Tensor],
    window: int = 0,
) -> ExtendPlan:
    """Plan for ``B`` requests; request ``r`` has ``row_counts[r]`` active query rows (the
    next rows of ``q_positions``, absolute positions) over ``seq_lens[r]`` context slots
    ``slots[r]`` (its positions ``0..seq_len-1``). Requests with no active row are kept
    (zero rows) so indices line up with the batch. ``window``: keys a row sees, itself
    included (0: all earlier ones)."""
    if not (len(row_counts) == len(seq_lens) == len(slots)):
        raise ValueError("row_counts, seq_lens and slots must have one entry per request")
    if sum(row_counts) != q_positions.numel():
        raise ValueError(f"{sum(row_counts)} rows counted, {q_positions.numel()} positions given")
    masks, offsets, start = [], [0], 0
    for n, t, s in zip(row_counts, seq_lens, slots, strict=True):
        if s.numel() != t:
            raise ValueError(f"a request has {s.numel()} slots for seq_len {t}")
        pos = q_positions[start : start + n].long().cpu()
        if n and int(pos.max()) >= t:
            raise ValueError(f"query position {int(pos.max())} is outside seq_len {t}")
        masks.append(visible(pos, t, window).flatten())
        offsets.append(offsets[-1] + n * t)
        start += n
    i32 = dict(dtype=torch.int32)
    return ExtendPlan(
        qo_indptr=torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()], **i32),
        kv_indptr=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], **i32),
        kv_indices=torch.cat([s.to(torch.int32).cpu() for s in slots]) if slots else
        torch.zeros(0, **i32),
        kv_last_page_len=torch.ones(len(seq_lens), **i32),
        custom_mask=torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool),
        mask_indptr=torch.tensor(offsets, dtype=torch.int64),
    )  # fmt: skip


def attend_with_plan_ref(
    plan: ExtendPlan,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What FlashInfer computes from ``plan``, in float32 torch (``q``: ``[rows, Hq, D]``,
    buffers ``[slots, Hkv, D]``), then the run's sink rescale from the log-sum-exp it
    returns: the CPU oracle for the plan's layout and the rescale."""
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=torch.float32)
    group = q.shape[1] // k_buffer.shape[1]
    for r in range(plan.qo_indptr.numel() - 1):
        q0, q1 = int(plan.qo_indptr[r]), int(plan.qo_indptr[r + 1])
        k0, k1 = int(plan.kv_indptr[r]), int(plan.kv_indptr[r + 1])
        if q0 == q1:
            continue
        idx = plan.kv_indices[k0:k1].long()
        k = k_buffer[idx].float().repeat_interleave(group, dim=1)  # [T, Hq, D]
        v = v_buffer[idx].float().repeat_interleave(group, dim=1)
        m0, m1 = int(plan.mask_indptr[r]), int(plan.mask_indptr[r + 1])
        mask = plan.custom_mask[m0:m1].view(q1 - q0, k1 - k0)
        logits = torch.einsum("nhd,thd->hnt", q[q0:q1].float(), k) * scale
        logits = logits.masked_fill(~mask[None], -math.inf)
        o = torch.einsum("hnt,thd->nhd", logits.softmax(-1).nan_to_num(0.0), v)
        lse = logits.logsumexp(-1).transpose(0, 1)  # [n, Hq], natural log, as lse_base="ln"
        out[q0:q1] = o if sinks is None else sink_rescale(o, lse, sinks)
    return out


class FlashInferExtend:  # pragma: no cover - needs a CUDA device
    """GPU path: one ``BatchPrefillWithPagedKVCacheWrapper`` per active-row set of a batch.
    Wrappers are kept and reused across batches (each owns device and pinned host buffers)."""

    def __init__(self, device: torch.device, workspace_bytes: int = 128 << 20) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._pool: list[object] = []  # wrappers, reused batch after batch
        self._wrappers: dict[object, object] = {}  # this batch: row-set key -> wrapper

    def plan(
        self, key, plan: ExtendPlan, heads: tuple[int, int, int, int], scale: float, dtype, kv_dtype
    ):
        """``heads``: (q heads, kv heads, qk head dim, vo head dim); ``scale``: softmax scale
        of the model's attention layers; ``dtype`` / ``kv_dtype``: of queries / KV pool."""
        hq, hkv, d, dv = heads
        if len(self._wrappers) == len(self._pool):
            self._pool.append(
                self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            )
        w = self._pool[len(self._wrappers)]
        dev = self._workspace.device
        w.plan(
            plan.qo_indptr.to(dev),
            plan.kv_indptr.to(dev),
            plan.kv_indices.to(dev),
            plan.kv_last_page_len.to(dev),
            hq,
            hkv,
            d,
            1,
            head_dim_vo=dv,
            custom_mask=plan.custom_mask.to(dev),
            sm_scale=scale,
            q_data_type=dtype,
            kv_data_type=kv_dtype,
        )
        self._wrappers[key] = w

    def run(self, key, q, k_buffer, v_buffer, sinks=None) -> torch.Tensor:
        """``q``: ``[rows, Hq, D]``; buffers: SGLang's ``[slots, Hkv, D]`` (one page each);
        ``sinks``: ``[Hq]`` sink logits (None: no sinks)."""
        paged = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))
        if sinks is None:
            return self._wrappers[key].run(q, paged)
        out, lse = self._wrappers[key].run(q, paged, return_lse=True, lse_base="ln")
        return sink_rescale(out, lse, sinks)

    def reset(self) -> None:
        self._wrappers.clear()
