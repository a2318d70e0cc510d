"""EAGLE speculative decoding on the CPU stand-in: the sgl-kernel CPU ops EAGLE's draft
path calls (beyond NGRAM's, ``cpu_spec``) in pure torch, and a draft-extend attention
backend for ``torch_native``.

SGLang 0.5.23's EAGLE worker (``eagle_worker_v2``) on a CPU builds the verify tree with
``build_tree_kernel_efficient_cpu`` and places draft tokens with
``assign_draft_cache_locs_contiguous_cpu``, both from sgl-kernel's CPU build (not on the
package index); its draft backend factory has no ``torch_native`` entry, although the draft's
extend forwards (``DRAFT_EXTEND_V2``: causal over the window after the request's prefix)
are what ``TorchNativeAttnBackend.forward_extend`` computes. Each op keeps the contract of
SGLang's Triton kernel of the same job (``kernels/ops/speculative/spec_tree.py:
sgl_build_tree_kernel_efficient_triton``, ``cache_locs.py: assign_draft_cache_locs_contiguous``);
test/unit/test_cpu_eagle.py runs those kernels under the Triton interpreter as the
reference. Multi-step draft decode (``--speculative-num-steps`` > 1) gets a per-step
container of ``TorchNativeAttnBackend``s for one draft token per step (topk 1): step i's
query, the draft token written at the request's slot ``seq + i``, sees the request's slots
up to it, which is SGLang's decode over ``seq_lens + i + 1``; a draft tree (topk > 1) keeps
the factory's own refusal. Only the CPU stand-in uses this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch, ModelRunner

# what the stand-in ``sgl_kernel`` resolves here
OPS = ("assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu")


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
) -> None:
    """``out_cache_loc[b*n:(b+1)*n] = req_to_token[req_b, seq_b : seq_b + n]``, n = topk *
    num_cols: each request's draft slots, already allocated after its committed tokens."""
    n = int(topk) * int(num_cols)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    for b, (row, start) in enumerate(zip(rows, lens, strict=True)):
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[row, start : start + n].to(
            out_cache_loc.dtype
        )


def _index_of(values: list[int], token: int) -> int | None:
    return values.index(token) if token in values else None


def _parent_slot(chosen: list[int], parents: list[int], node: int, topk: int) -> int | None:
    """Index in ``chosen`` of the parent of draft ``node`` (None: the root, or not found)."""
    tb = chosen[node] // topk
    return None if tb == 0 else _index_of(chosen, parents[tb])


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """The draft tree of each request as SGLang's Triton kernel builds it: node 0 is the
    request's last verified token, node i > 0 the draft ``selected_index[b, i-1]`` whose
    parent is found through ``parent_list``. Writes each node's position (its depth after
    the prefix), ``retrieve_index`` / ``next_token`` (first child) / ``next_sibling``, and
    the tree mask (``FULL_MASK``: the rows' draft part after the prefix; ``QLEN_ONLY``:
    ``[bs, N, N]``): a node sees itself and its ancestors. The ``retrieve_next_*`` outputs
    come in filled with -1, as SGLang allocates them."""
    n, topk, mode = int(draft_token_num), int(topk), int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError("QLEN_ONLY_BITPACKING tree masks (as in SGLang's Triton)")
    for t in (tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling):
        if not t.is_contiguous():
            raise ValueError("the tree outputs must be contiguous (written in place)")
    seq = [int(s) for s in verified_seq_len.tolist()]
    bs = len(seq)
    parents = parent_list.reshape(bs, -1).tolist()
    sel = selected_index.reshape(bs, -1).tolist()
    mask, pos = tree_mask.view(-1), positions.view(-1)
    r_index, r_next, r_sibling = (
        retrieve_index.view(-1),
        retrieve_next_token.view(-1),
        retrieve_next_sibling.view(-1),
    )
    drafts = n - 1
    prefix = 0
    for b in range(bs):
        base = b * n
        chosen = sel[b][:drafts]

        pos[base] = seq[b]
        for i in range(n - 1, 0, -1):
            r_index[base + i] = base + i
            tb = chosen[i - 1] // topk
            if tb == 0:
                parent = 0
            else:
                found = _index_of(chosen, parents[b][tb])
                if found is None:
                    continue
                parent = found + 1
            first = int(r_next[base + parent])
            r_next[base + parent] = i
            if first != -1:
                r_sibling[base + i] = first
        r_index[base] = base
        for x in range(n):
            if mode == 0:
                at = n * n * b + prefix * n + (seq[b] + n) * x + seq[b] + 1
            else:
                at = n * n * b + n * x + 1
            mask[at - 1] = 1
            mask[at : at + n - 1] = 0
            if x == 0:
                continue
            cur, depth_of = x - 1, 0
            for _ in range(int(depth)):
                depth_of += 1
                mask[at + cur] = 1
                up = _parent_slot(chosen, parents[b], cur, topk)
                if up is None:
                    break
                cur = up
            pos[base + x] = depth_of + seq[b]
        prefix += seq[b]


def draft_extend_on_torch_native(original, factory, *args, **kwargs):
    """Around-hook of ``DraftBackendFactory.create_draft_extend_backend`` on the CPU
    stand-in: where SGLang has no draft-extend backend for ``torch_native`` (it raises),
    SGLang's own ``TorchNativeAttnBackend`` serves the draft's extends; anything else is
    SGLang's answer."""
    try:
        return original(factory, *args, **kwargs)
    except ValueError as exc:
        if "torch_native" not in str(exc):
            raise
    from sglang_relay.runtime.sglang.server import torch_native_backend_class

    backend = torch_native_backend_class()(factory.draft_model_runner)
    backend.prefill_attention_backend_str = "torch_native"
    backend.decode_attention_backend_str = "torch_native"
    return backend


def _draft_step_backend(runner: ModelRunner, step: int):
    """SGLang's ``TorchNativeAttnBackend`` for draft step ``step`` (one token per request):
    its decode sees the committed tokens and the drafts written up to this step."""
    from sglang_relay.runtime.sglang.server import torch_native_backend_class

    class DraftStep(torch_native_backend_class()):
        def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
            pass

        def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
            committed = forward_batch.seq_lens
            forward_batch.seq_lens = committed + (step + 1)
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = committed

    backend = DraftStep(runner)
    backend.prefill_attention_backend_str = "torch_native"
    backend.decode_attention_backend_str = "torch_native"
    return backend


class TorchNativeMultiStepDraft:
    """The per-step container EAGLE's worker drives (``attn_backends[i]`` for draft step
    i, ``init_forward_metadata`` once per draft), for topk 1."""

    def __init__(self, runner: ModelRunner, topk: int, steps: int) -> None:
        self.topk, self.speculative_num_steps = topk, steps
        self.attn_backends = [_draft_step_backend(runner, i) for i in range(steps - 1)]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass


def draft_decode_on_torch_native(original, factory, *args, **kwargs):
    """Around-hook of ``DraftBackendFactory.create_decode_backend`` on the CPU stand-in:
    where SGLang has no multi-step draft backend for ``torch_native`` (it raises), one draft
    token per step (topk 1) gets :class:`TorchNativeMultiStepDraft`; a draft tree keeps
    SGLang's error."""
    try:
        return original(factory, *args, **kwargs)
    except ValueError as exc:
        if "torch_native" not in str(exc) or int(factory.topk) != 1:
            raise
    return TorchNativeMultiStepDraft(
        factory.draft_model_runner, int(factory.topk), int(factory.speculative_num_steps)
    )
