"""EAGLE's CPU ops (``runtime/standin/cpu_eagle.py``) against SGLang's own Triton kernels of the
same jobs, run under the Triton interpreter on CPU tensors in one subprocess
(``TRITON_INTERPRET=1`` must be set before triton loads; relay's stand-in ``sgl_kernel``
goes first on its path): ``spec_tree.py``'s tree build (positions, retrieve links, the tree
mask in both layouts SGLang uses) and ``cache_locs.py``'s draft cache locations. Inputs
are EAGLE-shaped (a root, ``topk`` candidates per step, parents found or not found among
the selected drafts) and random over many shapes."""

from __future__ import annotations

import pytest
import torch
from triton_reference import triton_outputs

from sglang_relay.runtime.standin import cpu_eagle

_REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous
from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton


def tree(c):
    sgl_build_tree_kernel_triton(
        c["parent_list"], c["selected_index"], c["verified_seq_len"], c["tree_mask"],
        c["positions"], c["retrieve_index"], c["retrieve_next_token"],
        c["retrieve_next_sibling"], c["topk"], c["depth"], c["draft_token_num"], c["mode"],
    )


def locs(c):
    bs = c["seq_lens"].numel()
    assign_draft_cache_locs_contiguous[(bs,)](
        c["req_pool_indices"], c["req_to_token"], c["seq_lens"], c["out_cache_loc"],
        c["req_to_token"].shape[1], c["topk"], c["num_cols"],
    )


RUN = {"tree": tree, "locs": locs}
"""

SENTINEL = -7


def _randint(gen, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=gen))


def _tree_case(gen, bs: int, topk: int, depth: int, mode: int) -> dict:
    """One call as EAGLE's ``build_tree_kernel_efficient`` makes it: ``parent_list`` holds
    the root's slot and each step's parents (``topk`` per step after the first), the
    ``selected_index`` the drafts chosen among all steps' candidates, sorted; a parent may
    be a chosen draft or not (then its subtree is cut)."""
    width = (depth - 1) * topk + 1
    candidates = topk + (depth - 1) * topk * topk
    n = _randint(gen, 2, min(candidates, 9) + 2)  # draft_token_num: the root + n - 1 drafts
    sel = torch.stack([torch.randperm(candidates, generator=gen)[: n - 1].sort().values
                       for _ in range(bs)])  # fmt: skip
    parents = torch.full((bs, width), -1, dtype=torch.int64)
    for b in range(bs):
        for j in range(1, width):
            pick = sel[b, _randint(gen, 0, n - 1)] if _randint(gen, 0, 4) else 10_000 + j
            parents[b, j] = int(pick)
    seq = torch.randint(1, 30, (bs,), generator=gen)
    size = bs * n * n if mode == 1 else n * n * bs + int(seq.sum()) * n
    return dict(
        parent_list=parents, selected_index=sel, verified_seq_len=seq,
        tree_mask=torch.full((size,), True), positions=torch.full((bs * n,), SENTINEL),
        retrieve_index=torch.full((bs, n), SENTINEL),
        retrieve_next_token=torch.full((bs, n), -1),
        retrieve_next_sibling=torch.full((bs, n), -1),
        topk=topk, depth=depth, draft_token_num=n, mode=mode,
    )  # fmt: skip


def _locs_case(gen, bs: int, topk: int, num_cols: int) -> dict:
    pool_len = 96
    return dict(
        req_pool_indices=torch.randperm(8, generator=gen)[:bs],
        req_to_token=torch.randint(0, 5000, (8, pool_len), generator=gen, dtype=torch.int32),
        seq_lens=torch.randint(0, pool_len - topk * num_cols, (bs,), generator=gen),
        out_cache_loc=torch.full((bs * topk * num_cols,), SENTINEL, dtype=torch.int64),
        topk=topk, num_cols=num_cols,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cases_and_reference(tmp_path_factory):
    gen = torch.Generator().manual_seed(11)
    cases = {
        "tree": [
            _tree_case(gen, _randint(gen, 1, 4), topk, depth, mode)
            for topk, depth in [(1, 1), (1, 2), (1, 4), (2, 3), (4, 2), (4, 4), (8, 3)]
            for mode in (0, 1)
            for _ in range(3)
        ],
        "locs": [_locs_case(gen, bs, k, c) for bs, k, c in [(1, 1, 1), (3, 1, 4), (2, 4, 3)]],
    }
    fresh, outputs = triton_outputs(_REFERENCE, cases, tmp_path_factory.mktemp("eagle-ops"))
    return fresh(), outputs


TREE_OUT = ("tree_mask", "positions", "retrieve_index", "retrieve_next_token",
            "retrieve_next_sibling")  # fmt: skip


def test_the_tree_build_writes_what_sglangs_triton_kernel_writes(cases_and_reference):
    inputs, want = cases_and_reference
    for c, w in zip(inputs["tree"], want["tree"], strict=True):
        cpu_eagle.build_tree_kernel_efficient_cpu(
            c["parent_list"], c["selected_index"], c["verified_seq_len"], c["tree_mask"],
            c["positions"], c["retrieve_index"], c["retrieve_next_token"],
            c["retrieve_next_sibling"], c["topk"], c["depth"], c["draft_token_num"], c["mode"],
        )  # fmt: skip
        for name in TREE_OUT:
            assert torch.equal(c[name], w[name]), (name, c["topk"], c["depth"], c["mode"])


def test_a_chain_of_drafts_is_a_causal_tree():
    """topk 1, every draft the child of the one before (what one draft step per token
    gives): positions count up from the prefix, each node sees itself and those before."""
    n, seq = 4, 9
    c = _tree_case(torch.Generator().manual_seed(0), 1, 1, n, 1)
    c.update(
        draft_token_num=n, selected_index=torch.tensor([[0, 1, 2]]),
        parent_list=torch.tensor([[-1, 0, 1, 2]]), verified_seq_len=torch.tensor([seq]),
        tree_mask=torch.full((n * n,), True), positions=torch.full((n,), SENTINEL),
        retrieve_index=torch.full((1, n), SENTINEL), retrieve_next_token=torch.full((1, n), -1),
        retrieve_next_sibling=torch.full((1, n), -1),
    )  # fmt: skip
    cpu_eagle.build_tree_kernel_efficient_cpu(*(c[k] for k in (
        "parent_list", "selected_index", "verified_seq_len", *TREE_OUT[:1], *TREE_OUT[1:])),
        1, n - 1, n, 1)  # fmt: skip
    assert c["positions"].tolist() == [seq, seq + 1, seq + 2, seq + 3]
    assert torch.equal(c["tree_mask"].view(n, n), torch.ones(n, n).tril().bool())
    assert c["retrieve_next_token"].tolist() == [[1, 2, 3, -1]]
    assert c["retrieve_next_sibling"].tolist() == [[-1, -1, -1, -1]]


def test_draft_cache_locations_are_sglangs(cases_and_reference):
    inputs, want = cases_and_reference
    for c, w in zip(inputs["locs"], want["locs"], strict=True):
        cpu_eagle.assign_draft_cache_locs_contiguous_cpu(
            c["req_pool_indices"], c["req_to_token"], c["seq_lens"], c["out_cache_loc"],
            c["req_to_token"].shape[1], c["topk"], c["num_cols"],
        )  # fmt: skip
        assert torch.equal(c["out_cache_loc"], w["out_cache_loc"])


Q_HEADS, KV_HEADS, HEAD_DIM, SCALING = 4, 2, 8, 0.3


def test_a_draft_step_attends_to_the_prefix_and_the_drafts_before_it():
    """Draft step i of one token per request (topk 1) on SGLang's CPU pool: the query of
    request b's draft written at its slot ``seq_b + i`` sees its slots ``[0, seq_b + i]``,
    float64 attention written out; the K/V go to ``out_cache_loc``."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    gen = torch.Generator().manual_seed(5)
    pool = MHATokenToKVPool(size=80, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                            head_dim=HEAD_DIM, layer_num=2, device="cpu",
                            enable_memory_saver=False)  # fmt: skip
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    steps, lens, rows = 4, [5, 11, 2], torch.tensor([2, 0, 3])
    req_to_token = torch.zeros(5, 32, dtype=torch.int32)
    slots = (torch.randperm(pool.size, generator=gen) + 1).int()
    used = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        req_to_token[row, : n + steps - 1] = slots[used : used + n + steps - 1]
        used += n + steps - 1
    tokens = SimpleNamespace(req_to_token=req_to_token)
    runner = SimpleNamespace(device="cpu", token_to_kv_pool=pool, req_to_token_pool=tokens)
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS,
                            qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, scaling=SCALING,
                            sliding_window_size=-1, is_cross_attention=False)  # fmt: skip
    draft = cpu_eagle.TorchNativeMultiStepDraft(runner, 1, steps)
    assert len(draft.attn_backends) == steps - 1
    committed = torch.tensor(lens)
    for i, backend in enumerate(draft.attn_backends):
        loc = torch.stack(
            [req_to_token[r, n + i] for r, n in zip(rows.tolist(), lens, strict=True)]
        )
        batch = SimpleNamespace(out_cache_loc=loc.long(), req_pool_indices=rows,
                                seq_lens=committed, encoder_lens=None)  # fmt: skip
        q = torch.randn(3, Q_HEADS * HEAD_DIM, generator=gen)
        k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
        out = backend.forward_decode(q, k, v, layer, batch)
        assert batch.seq_lens is committed  # the batch is left as it came
        assert torch.equal(pool.k_buffer[1][loc.long()], k)
        for b, (row, n) in enumerate(zip(rows.tolist(), lens, strict=True)):
            seen = req_to_token[row, : n + i + 1].long()
            keys = pool.k_buffer[1][seen].double().repeat_interleave(2, dim=1)  # [L, Q_HEADS, d]
            vals = pool.v_buffer[1][seen].double().repeat_interleave(2, dim=1)
            qb = q[b].double().view(Q_HEADS, HEAD_DIM)
            weights = torch.softmax(SCALING * torch.einsum("hd,lhd->hl", qb, keys), dim=-1)
            want = torch.einsum("hl,lhd->hd", weights, vals).reshape(-1)
            torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)
