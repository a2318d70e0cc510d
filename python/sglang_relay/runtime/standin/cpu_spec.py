"""Speculative decoding (NGRAM) on the CPU stand-in: sgl_kernel's CPU ops in pure torch,
and a tree-verify path for the ``torch_native`` attention backend.

SGLang 0.5.23 runs NGRAM on a CPU through seven ops of sgl-kernel's CPU build (not on
PyPI; relay's stand-in ``sgl_kernel`` resolves these names here) and an attention backend
with a ``TARGET_VERIFY`` path (``torch_native`` reads a verify batch as a stale extend and
ignores its tree mask). Each op below keeps the contract of SGLang's own Triton kernel of
the same job (``kernels/ops/speculative/*.py``, ``kernels/ops/kvcache/cache_move.py``,
``srt/mem_cache/allocation.py``); test/unit/test_cpu_spec.py runs those kernels under the
Triton interpreter as the reference. Only the CPU stand-in uses this module: on a GPU,
SGLang's kernels and attention backends run.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch

logger = logging.getLogger(__name__)

# what the stand-in ``sgl_kernel`` resolves here (top level, and ``sgl_kernel.speculative``)
OPS = (
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "copy_all_layer_kv_cache_cpu",
    "reconstruct_indices_from_tree_mask",
)


def _windows(req_pool_indices, start_offset, end_offset):
    """(req_to_token row, window slice, packed slice) of each request's non-empty
    [start, end) window, packed in request order (the Triton kernels' ``sum(end - start)``
    over earlier requests)."""
    offset = 0
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    for row, s, e in zip(rows, starts, ends, strict=True):
        if e > s:
            yield row, slice(s, e), slice(offset, offset + e - s)
        offset += e - s


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``req_to_token[req_i, start_i:end_i] = out_cache_loc[packed window i]``."""
    for row, window, packed in _windows(req_pool_indices, start_offset, end_offset):
        req_to_token[row, window] = out_cache_loc[packed].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``out_cache_loc[packed window i] = req_to_token[req_i, start_i:end_i]``."""
    for row, window, packed in _windows(req_pool_indices, start_offset, end_offset):
        out_cache_loc[packed] = req_to_token[row, window].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Pack ``out_cache_loc[j]`` for every accepted node ``j`` (``accept_index != -1``, in
    row-major order) to the front of ``accept_out_cache_loc``."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """``bonus_tokens[b]`` = the last accepted token of request b (``accept_lens`` counts
    the bonus token)."""
    bs = accept_lens.numel()
    at = accept_tokens.reshape(-1)
    idx = torch.arange(bs, dtype=torch.long) * int(accept_stride) + accept_lens.long() - 1
    bonus_tokens[:bs] = at[idx].to(bonus_tokens.dtype)


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy tree verify. Per request: start at the root (node 0); at each depth take the
    first child, in sibling order, whose draft token is the target's argmax at the last
    accepted node; stop at the first depth without one. ``accept_index[b]`` gets the global
    rows of the accepted path (root first), ``accept_token_num[b]`` the accepted drafts (root
    not counted), ``predicts[row]`` the target token at each accepted row."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = _rows(retrive_index, bs, n).tolist()
    nxt = _rows(retrive_next_token, bs, n).tolist()
    sib = _rows(retrive_next_sibling, bs, n).tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.reshape(-1)
    acc = accept_index.view(bs, steps)
    for b in range(bs):
        last = ridx[b][0]
        acc[b, 0] = last
        accepted, cur = 0, 0
        for j in range(1, steps):
            cur = nxt[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            pred[last] = want
            accepted += 1
            last = ridx[b][cur]
            acc[b, j] = last
        accept_token_num[b] = accepted
        pred[last] = target[last]


def _rows(buffer: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """Request b's ``n`` entries of a per-node buffer, addressed flat from ``b * n`` as
    SGLang's kernels do (a preallocated buffer may have more rows than the batch)."""
    return buffer.view(-1)[: bs * n].view(bs, n)


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    batch_size,
    draft_token_num,
) -> None:
    """NGRAM's verify metadata from its ancestor mask (``tree_mask[b, i, j]``: node j is an
    ancestor of, or is, node i). Per node: its position (``verified_seq_len[b]`` + its number
    of strict ancestors), its global row, its first child and its next sibling (-1: none;
    the root has no sibling)."""
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).bool()
    below = torch.ones(n, n, dtype=torch.bool).tril(-1)  # j < i
    anc = mask & below  # anc[b, i, j]: j is a strict ancestor of i
    depth = anc.sum(-1)
    positions.view(-1)[: bs * n] = (
        (depth + verified_seq_len[:bs].view(bs, 1)).reshape(-1).to(positions.dtype)
    )
    rows = torch.arange(bs * n, dtype=retrieve_index.dtype).view(bs, n)
    _rows(retrieve_index, bs, n).copy_(rows)
    col = torch.arange(n)
    # parent: the deepest strict ancestor (highest index), -1 for the root
    parent = torch.where(anc.any(-1), (anc * col).amax(-1), torch.full_like(depth, -1))
    big = torch.full((bs, n, n), n, dtype=torch.long)
    # first child of t: min k > t with t a strict ancestor of k (anc[b, k, t])
    child = torch.where(anc.transpose(1, 2), col.view(1, 1, n).expand(bs, n, n), big).amin(-1)
    # next sibling of t: min k > t with parent[k] == parent[t], none for the root
    same = parent.unsqueeze(2) == parent.unsqueeze(1)  # [b, t, k]
    later = col.view(1, n) > col.view(n, 1)  # k > t
    sibling = torch.where(same & later, col.view(1, 1, n).expand(bs, n, n), big).amin(-1)
    sibling = torch.where(parent < 0, torch.full_like(sibling, n), sibling)
    none = torch.full_like(child, -1)
    _rows(retrieve_next_token, bs, n).copy_(torch.where(child < n, child, none))
    _rows(retrieve_next_sibling, bs, n).copy_(torch.where(sibling < n, sibling, none))


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every KV buffer (``data_ptrs[i]``, a slot of ``strides[i]`` bytes): slot
    ``tgt_loc[k]`` gets what slot ``src_loc[k]`` held (all sources read first)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
    if int(torch.minimum(tgt.min(), src.min())) < 0:
        raise IndexError("copy_all_layer_kv_cache_cpu: a negative slot index")
    # the raw views reach only as far as the largest index (SGLang's move_kv_cache checks
    # indices against the pool with SGLANG_ENABLE_ASYNC_ASSERT; its callers pass pool slots)
    slots = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (slots * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(slots, int(stride))
        view[tgt] = view[src]


def verify_attention(backend, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
    """``torch_native`` attention for a ``TARGET_VERIFY`` batch: request b's ``N`` draft
    rows (``out_cache_loc[b*N:(b+1)*N]``, written first) attend to its committed prefix
    (``req_to_token[req, :seq_len]``) and to the draft rows the tree mask
    (``spec_info.custom_mask``, ``[bs, N, N]`` flattened) marks as ancestors or self."""
    spec = forward_batch.spec_info
    n = int(spec.draft_token_num)
    bs = forward_batch.batch_size
    loc = forward_batch.out_cache_loc
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        where = KVWriteLoc(loc, getattr(backend, "swa_out_cache_loc", None))
        pool.set_kv_buffer(layer, where, k, v)
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    qh, kh = layer.tp_q_head_num, layer.tp_k_head_num
    q_ = q.view(-1, qh, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], qh * layer.v_head_dim))
    o_ = out.view(-1, qh, layer.v_head_dim)
    tree = spec.custom_mask.reshape(-1)[: bs * n * n].view(bs, n, n).bool()
    req_to_token = backend.req_to_token_pool.req_to_token
    reqs = forward_batch.req_pool_indices.tolist()
    lens = forward_batch.seq_lens.tolist()
    for b in range(bs):
        prefix = req_to_token[reqs[b], : lens[b]].long()
        slots = torch.cat([prefix, loc[b * n : (b + 1) * n].long()])
        mask = torch.cat([torch.ones(n, lens[b], dtype=torch.bool), tree[b]], dim=1)
        keys = k_cache[slots].movedim(0, 1).to(q.dtype)  # [kh, L, d]
        vals = v_cache[slots].movedim(0, 1).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q_[b * n : (b + 1) * n].movedim(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            vals.unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=qh != kh,
        )
        o_[b * n : (b + 1) * n] = o.squeeze(0).movedim(1, 0)
    return out


def verify_attention_unsupported(layer) -> str | None:
    """Why :func:`verify_attention` cannot serve ``layer`` (None: it can)."""
    if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
        return "attention logit soft-capping"
    window = getattr(layer, "sliding_window_size", None)
    if window is not None and window > -1:
        return "sliding-window attention"
    if layer.is_cross_attention:
        return "cross-attention"
    return None


def torch_native_with_verify(
    original, backend, q, k, v, layer, forward_batch: ForwardBatch, *args, **kwargs
):
    """Around-hook of ``TorchNativeAttnBackend.forward_extend`` on the CPU stand-in: a
    ``TARGET_VERIFY`` batch takes :func:`verify_attention`, everything else SGLang's path."""
    mode = forward_batch.forward_mode
    if not (hasattr(mode, "is_target_verify") and mode.is_target_verify()):
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    why = verify_attention_unsupported(layer)
    spec, bs = forward_batch.spec_info, forward_batch.batch_size
    n = int(getattr(spec, "draft_token_num", 0) or 0)
    mask = getattr(spec, "custom_mask", None)
    if why is None and (mask is None or mask.numel() != bs * n * n):
        # NGRAM's CPU mask is [bs, N, N] over the drafts (QLEN); any other layout (a
        # prefix-wide mask, another algorithm's verify input) is not what this reads
        why = "a verify input other than NGRAM's [bs, N, N] draft mask"
    if why is not None:
        raise NotImplementedError(
            f"speculative verify on the CPU stand-in does not serve {why} (layer "
            f"{layer.layer_id}); serve this model without --speculative-algorithm"
        )
    save = kwargs.get("save_kv_cache", args[0] if args else True)
    return verify_attention(backend, q, k, v, layer, forward_batch, save)
