"""NGRAM speculative decoding's CPU ops (``runtime/standin/cpu_spec.py``) against SGLang's own
Triton kernels of the same jobs, run under the Triton interpreter on CPU tensors in one
subprocess (``TRITON_INTERPRET=1`` must be set before triton loads; relay's stand-in
``sgl_kernel`` goes first on its path so SGLang's kernel modules import without CUDA):
``reconstruct_tree.py`` (tree-mask metadata), ``spec_tree.py`` (greedy tree verify),
``cache_locs.py`` and ``allocation.py`` (cache-loc windows), ``eagle.py`` (accepted-slot
packing, bonus tokens) and ``cache_move.py``'s tiled all-layer KV copy, the last also
against ``move_kv_cache_native`` on SGLang's real CPU pool. Trees are NGRAM-shaped
(ancestor-or-self masks, parents before children). ``verify_attention`` is checked against
tree-masked attention written out in float64, and against causal attention for a chain."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from triton_reference import triton_outputs

from sglang_relay.runtime.standin import cpu_spec

# SGLang's kernels, launched with the grids of their CUDA wrappers (the ``*_func`` wrappers
# take the stand-in's CPU ops on a CPU, so the kernels are launched here directly)
_REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs
from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
from sglang.kernels.ops.speculative.reconstruct_tree import (
    reconstruct_indices_from_tree_mask_triton,
)
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.utils import next_power_of_2


def reconstruct(c):
    reconstruct_indices_from_tree_mask_triton(
        c["tree_mask"], c["verified_seq_len"], c["positions"], c["retrieve_index"],
        c["retrieve_next_token"], c["retrieve_next_sibling"], c["batch_size"],
        c["draft_token_num"],
    )


def verify(c):
    verify_tree_greedy_triton(
        c["predicts"], c["accept_index"], c["accept_token_num"], c["candidates"],
        c["retrieve_index"], c["retrieve_next_token"], c["retrieve_next_sibling"],
        c["target_predict"],
    )


def windows(kernel, c):
    bs = c["req_pool_indices"].numel()
    kernel[(bs,)](
        c["req_pool_indices"], c["req_to_token"], c["start_offset"], c["end_offset"],
        c["out_cache_loc"], c["req_to_token"].shape[1], next_power_of_2(bs),
    )


def accept(c):
    size = c["accept_index"].numel()
    fill_accept_out_cache_loc[(size,)](
        c["accept_index"], c["out_cache_loc"], c["accept_out_cache_loc"], next_power_of_2(size)
    )


def bonus(c):
    fill_bonus_tokens[(c["accept_lens"].numel(),)](
        c["accept_tokens"], c["accept_lens"], c["bonus_tokens"], c["accept_stride"]
    )


def move(c):
    # the pool's data_ptrs / data_strides (_init_data_ptrs_and_strides) and copy config
    # (_init_kv_copy_and_warmup: 128-byte tiles below a 4 KiB slot)
    bufs = c["buffers"]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
    n = c["tgt"].numel()
    grid = (len(bufs), (int(strides.max()) + 127) // 128)
    copy_all_layer_kv_cache_tiled[grid](
        ptrs, strides, c["tgt"], c["src"], n, next_power_of_2(n), BYTES_PER_TILE=128
    )


RUN = {
    "reconstruct": reconstruct,
    "reconstruct_whole": reconstruct,
    "verify": verify,
    "extend": lambda c: windows(assign_extend_cache_locs, c),
    "assign": lambda c: windows(assign_req_to_token_pool, c),
    "accept": accept,
    "bonus": bonus,
    "move": move,
}
"""

SENTINEL = -7  # what an output buffer holds where nothing may be written


# -- trees ---------------------------------------------------------------------------------


def _parents(kind: str, n: int, gen: torch.Generator) -> list[int]:
    """Parent of each node (root 0: -1), parents before children as NGRAM orders them."""
    if kind == "chain":
        return [-1, *range(n - 1)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":  # a long spine that forks every third node
        return [-1] + [i - 1 if i % 3 else i - 2 for i in range(1, n)]
    assert kind == "random"
    return [-1] + [_randint(gen, 0, i) for i in range(1, n)]


def _mask(parents: list[int]) -> torch.Tensor:
    """``mask[i, j]``: node j is an ancestor of, or is, node i."""
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


def _links(parents: list[int]) -> tuple[list[int], list[int]]:
    """(first child, next sibling) of each node, -1 for none: children in index order."""
    n = len(parents)
    child, sibling = [-1] * n, [-1] * n
    for k in range(n - 1, 0, -1):  # from the last node, so the smallest index stays
        p = parents[k]
        sibling[k] = child[p]
        child[p] = k
    return child, sibling


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=gen))


def _kinds(gen: torch.Generator, bs: int) -> list[str]:
    names = ("chain", "star", "deep", "random", "random")
    return [names[_randint(gen, 0, len(names))] for _ in range(bs)]


# -- cases (inputs; the kernels mutate their outputs in place) ----------------------------


def _reconstruct_case(trees, seq_lens, *, lens_dtype=torch.int64, max_bs=None, whole=False):
    """One NGRAM ``reconstruct_indices_from_tree_mask`` call. ``max_bs``: the outputs are
    the worker's per-bs views (``buf[:bs]``) of buffers preallocated for ``max_bs``
    requests; ``whole``: the whole preallocated buffers are passed instead."""
    bs, n = len(trees), len(trees[0])
    rows = max_bs or bs
    mask = torch.zeros(rows * n * n, dtype=torch.bool)
    mask[: bs * n * n] = torch.stack([_mask(p) for p in trees]).reshape(-1)
    lens = torch.full((rows,), 1000, dtype=lens_dtype)
    lens[:bs] = torch.tensor(seq_lens, dtype=lens_dtype)
    positions = torch.full((rows * n,), SENTINEL, dtype=torch.int64)
    index, nxt, sib = (torch.full((rows, n), SENTINEL, dtype=torch.int64) for _ in range(3))
    case = dict(batch_size=bs, draft_token_num=n, parents=trees, buffers=[positions, index])
    case["buffers"] += [nxt, sib]
    if max_bs and not whole:  # what ngram_worker passes: views of the first bs rows
        mask, lens = mask[: bs * n * n], lens[:bs]
        positions, index, nxt, sib = positions[: bs * n], index[:bs], nxt[:bs], sib[:bs]
    case.update(tree_mask=mask, verified_seq_len=lens, positions=positions)
    case.update(retrieve_index=index, retrieve_next_token=nxt, retrieve_next_sibling=sib)
    return case


def _reconstruct_cases(gen):
    cases = [
        _reconstruct_case([_parents("chain", 8, gen)], [5]),
        _reconstruct_case([_parents("star", 10, gen)], [1]),
        _reconstruct_case([_parents("deep", 12, gen)], [37]),
        _reconstruct_case([_parents(k, 11, gen) for k in ("random", "deep", "star")], [3, 9, 0]),
        _reconstruct_case(
            [_parents("random", 9, gen) for _ in range(3)], [7, 1, 20], lens_dtype=torch.int32
        ),
        # per-bs views of buffers preallocated for more requests (and for exactly bs)
        _reconstruct_case([_parents(k, 8, gen) for k in ("deep", "chain")], [4, 6], max_bs=4),
        _reconstruct_case(
            [_parents(k, 10, gen) for k in ("star", "random", "deep")], [2, 5, 8], max_bs=3
        ),
    ]
    for _ in range(20):
        bs, n = _randint(gen, 1, 4), _randint(gen, 8, 13)
        seq = torch.randint(0, 50, (bs,), generator=gen).tolist()
        cases.append(_reconstruct_case([_parents(k, n, gen) for k in _kinds(gen, bs)], seq))
    return cases


def _whole_buffer_cases(gen):
    """The whole preallocated ``[max_bs, N]`` buffers with fewer requests: the kernels
    address ``retrieve_*`` flat (``b * N + i``), so only the first ``bs * N`` entries are
    written."""
    return [
        _reconstruct_case(
            [_parents(k, 8, gen) for k in ("deep", "random")], [4, 6], max_bs=4, whole=True
        ),
        _reconstruct_case(
            [_parents(k, 9, gen) for k in ("star", "random", "chain")],
            [1, 2, 3],
            max_bs=4,
            whole=True,
        ),
    ]


def _verify_case(trees, candidates, targets, steps, *, retrieve_rows=None):
    """One ``verify_tree_greedy`` call with SGLang's dtypes (eagle_utils: int32 predict /
    accept_index / accept_token_num; NGRAM's int64 draft tokens and retrieve buffers,
    argmax's int64 target). ``retrieve_rows``: the retrieve tensors are that many rows
    (preallocated), wider than the batch."""
    bs, n = len(trees), len(trees[0])
    rows = retrieve_rows or bs
    links = [_links(p) for p in trees]
    nxt = torch.full((rows, n), -1, dtype=torch.int64)
    sib = torch.full((rows, n), -1, dtype=torch.int64)
    nxt[:bs] = torch.tensor([c for c, _ in links])
    sib[:bs] = torch.tensor([s for _, s in links])
    return dict(
        parents=trees,
        predicts=torch.zeros(bs * n, dtype=torch.int32),
        accept_index=torch.full((bs, steps), -1, dtype=torch.int32),
        accept_token_num=torch.full((bs,), SENTINEL, dtype=torch.int32),
        candidates=torch.tensor(candidates, dtype=torch.int64).view(bs, n),
        retrieve_index=torch.arange(rows * n, dtype=torch.int64).view(rows, n),
        retrieve_next_token=nxt,
        retrieve_next_sibling=sib,
        target_predict=torch.tensor(targets, dtype=torch.int64).view(bs, n),
    )


# trees with a known greedy outcome: (parents, candidates, targets, accepted path)
_TWINS = [-1, 0, 0, 1, 2, 3, 4, 5]  # root -> 1, 2; 1 -> 3 -> 5 -> 7; 2 -> 4 -> 6
DESIGNED = {
    # a chain whose every draft is the target's choice: all accepted
    "chain-all": (
        [-1, *range(7)],
        [100 + i for i in range(8)],
        [101 + i for i in range(8)],
        list(range(8)),
    ),
    # the chain's fourth draft is wrong
    "chain-some": (
        [-1, *range(7)],
        [100 + i for i in range(8)],
        [101, 102, 103, 0, 105, 106, 107, 108],
        [0, 1, 2, 3],
    ),
    # a star: the target's token is the fifth sibling
    "star-sibling": ([-1] + [0] * 7, [200 + i for i in range(8)], [205] + [1] * 7, [0, 5]),
    # no child has the target's token
    "star-none": ([-1] + [0] * 7, [200 + i for i in range(8)], [999] + [1] * 7, [0]),
    # siblings 1 and 2 share the token: the first one in sibling order is taken, although
    # the path under the second one would be accepted further
    "twins-first": (_TWINS, [0, 7, 7, 11, 12, 13, 14, 15], [7, 12, 12, 0, 14, 0, 0, 0], [0, 1]),
    # the first sibling is wrong, the second is accepted and its subtree followed
    "second-sibling": (
        _TWINS,
        [0, 5, 7, 11, 12, 13, 14, 15],
        [7, 12, 12, 0, 14, 0, 99, 0],
        [0, 2, 4, 6],
    ),
}


def _verify_cases(gen):
    cases = []
    for name, (parents, cand, target, _path) in DESIGNED.items():
        cases.append(_verify_case([parents], cand, target, 8) | {"id": name})
    # the chain's drafts all right, but accept_index holds 4 steps: 3 drafts accepted
    chain, cand, target, _ = DESIGNED["chain-all"]
    cases.append(_verify_case([chain], cand, target, 4) | {"id": "steps-cap"})
    # one batch of three of them: rows are global (request b's root is row b * N)
    names = ("chain-all", "star-none", "twins-first")
    cases.append(
        _verify_case(
            [DESIGNED[k][0] for k in names],
            sum((DESIGNED[k][1] for k in names), []),
            sum((DESIGNED[k][2] for k in names), []),
            8,
        )
        | {"id": "batch"}
    )
    # random trees, tokens from a vocabulary of 3: siblings share tokens, targets match by
    # chance at every depth
    for i in range(40):
        bs, n = _randint(gen, 1, 4), _randint(gen, 8, 13)
        trees = [_parents(k, n, gen) for k in _kinds(gen, bs)]
        cand = torch.randint(0, 3, (bs * n,), generator=gen).tolist()
        target = torch.randint(0, 3, (bs * n,), generator=gen).tolist()
        steps = _randint(gen, 2, n + 1)
        cases.append(_verify_case(trees, cand, target, steps) | {"id": f"random-{i}"})
    return cases


def _window_case(gen, lens, *, rows_dtype=torch.int64, offset_dtype=torch.int64, assign=False):
    """``req_to_token`` rows (int32, as ReqToTokenPool holds them) and one [start, end)
    window per request, packed in request order into ``out_cache_loc`` (int64)."""
    bs, pool_rows, pool_len = len(lens), 6, 96
    req_to_token = torch.randperm(pool_rows * pool_len, generator=gen).view(pool_rows, -1)
    req_to_token = req_to_token.to(torch.int32)
    rows = torch.randperm(pool_rows - 1, generator=gen)[:bs] + 1  # row 0: padding row
    start = torch.tensor([_randint(gen, 0, pool_len - n + 1) for n in lens])
    total = sum(lens)
    out = torch.full((total + 5,), SENTINEL, dtype=torch.int64)
    if assign:  # the slots to write into req_to_token
        out[:total] = torch.randperm(10_000, generator=gen)[:total] + 10_000
    return dict(
        req_pool_indices=rows.to(rows_dtype),
        req_to_token=req_to_token,
        start_offset=start.to(offset_dtype),
        end_offset=(start + torch.tensor(lens, dtype=torch.int64)).to(offset_dtype),
        out_cache_loc=out,
    )


def _front_case(gen, num_front, n):
    """``fill_front_out_cache_loc_func``'s CPU call: request b's verify window is row b of
    ``out_cache_loc.view(bs, -1).int()``, its first ``num_front[b]`` slots packed."""
    bs = len(num_front)
    window = (torch.randperm(1000, generator=gen)[: bs * n] + 1).view(bs, n)
    num = torch.tensor(num_front, dtype=torch.int32)
    return dict(
        req_pool_indices=torch.arange(bs),
        req_to_token=window.int(),
        start_offset=torch.zeros_like(num),
        end_offset=num,
        out_cache_loc=torch.full((bs * n,), SENTINEL, dtype=torch.int64),
    )


def _window_cases(gen, assign):
    cases = [
        _window_case(gen, [8], assign=assign),
        _window_case(gen, [8, 0, 8], assign=assign),  # a zero-length window
        _window_case(gen, [0, 40, 5, 0], assign=assign),  # longer than a 32-slot block
        _window_case(gen, [12, 9], offset_dtype=torch.int32, assign=assign),
        _window_case(gen, [3, 33, 1], rows_dtype=torch.int32, assign=assign),
        _window_case(gen, [0, 0], assign=assign),
    ]
    if not assign:
        cases += [_front_case(gen, [1, 8, 3], 8), _front_case(gen, [12], 12)]
    for _ in range(8):
        bs = _randint(gen, 1, 5)
        lens = torch.randint(0, 14, (bs,), generator=gen).tolist()
        cases.append(_window_case(gen, lens, assign=assign))
    return cases


def _accept_index(gen, bs, n, steps, accepted, dtype=torch.int32):
    """Request b's root row then ``accepted[b]`` drafts' global rows, -1 after (a request
    with ``accepted[b] == -1`` is all -1)."""
    out = torch.full((bs, steps), -1, dtype=dtype)
    for b, k in enumerate(accepted):
        if k >= 0:
            nodes = torch.randperm(n - 1, generator=gen)[:k].sort().values + 1
            out[b, : k + 1] = torch.cat([torch.zeros(1, dtype=torch.long), nodes]) + b * n
    return out


def _accept_cases(gen):
    cases = []
    for accepted, steps, dtype in (
        ([0], 8, torch.int32),
        ([7], 8, torch.int32),
        ([2, 0, 5], 6, torch.int32),
        ([3, -1, 1], 5, torch.int32),
        ([4, 4], 5, torch.int64),
    ):
        bs, n = len(accepted), 8
        cases.append(
            dict(
                accept_index=_accept_index(gen, bs, n, steps, accepted, dtype),
                out_cache_loc=torch.randperm(5000, generator=gen)[: bs * n] + 1,
                accept_out_cache_loc=torch.zeros(bs * steps, dtype=torch.int64),
            )
        )
    return cases


def _bonus_cases(gen):
    cases = []
    for lens, steps, dtype in (
        ([1], 4, torch.int32),
        ([4], 4, torch.int32),
        ([1, 3, 6], 6, torch.int32),
        ([2, 5], 7, torch.int64),
    ):
        bs = len(lens)
        cases.append(
            dict(
                accept_tokens=torch.randint(0, 30_000, (bs, steps), generator=gen).to(dtype),
                accept_lens=torch.tensor(lens, dtype=torch.int32),
                bonus_tokens=torch.full((bs,), SENTINEL, dtype=torch.int32),
                accept_stride=steps,
            )
        )
    return cases


MOVE_SLOTS, MOVE_LAYERS, MOVE_HEADS, MOVE_K_DIM, MOVE_V_DIM = 48, 2, 2, 8, 4


def _moves(gen, n, pad):
    """(tgt, src) as speculative compaction makes them: distinct targets, sources that may
    be other pairs' targets (the move must gather every source first), 0 -> 0 padding."""
    tgt = torch.randperm(MOVE_SLOTS, generator=gen)[:n] + 1
    src = torch.where(
        torch.rand(n, generator=gen) < 0.4,
        tgt[torch.randint(0, n, (n,), generator=gen)],
        torch.randint(1, MOVE_SLOTS + 1, (n,), generator=gen),
    )
    zeros = torch.zeros(pad, dtype=torch.int64)
    return torch.cat((tgt, zeros)), torch.cat((src, zeros))


def _move_cases(gen):
    # buffers as the pool orders its data_ptrs: K of every layer, then V (other row width)
    shapes = [(MOVE_K_DIM,)] * MOVE_LAYERS + [(MOVE_V_DIM,)] * MOVE_LAYERS
    cases = []
    # a hand-made overlap: 2 <- 3 <- 4 <- 2 rotates, gathered first
    rotate = (torch.tensor([2, 3, 4, 9, 0]), torch.tensor([3, 4, 2, 9, 0]))
    for i, (tgt, src) in enumerate(
        [rotate, *(_moves(gen, n, pad) for n, pad in ((1, 0), (6, 2), (20, 3), (40, 0)))]
    ):
        dtype = torch.int32 if i % 2 else torch.int64
        bufs = [torch.randn(MOVE_SLOTS + 1, MOVE_HEADS, *s, generator=gen) for s in shapes]
        cases.append(dict(buffers=bufs, tgt=tgt.to(dtype), src=src.to(dtype)))
    return cases


def _all_cases() -> dict[str, list[dict]]:
    gen = torch.Generator().manual_seed(0)
    return {
        "reconstruct": _reconstruct_cases(gen),
        "reconstruct_whole": _whole_buffer_cases(gen),
        "verify": _verify_cases(gen),
        "extend": _window_cases(gen, assign=False),
        "assign": _window_cases(gen, assign=True),
        "accept": _accept_cases(gen),
        "bonus": _bonus_cases(gen),
        "move": _move_cases(gen),
    }


@pytest.fixture(scope="module")
def triton_ref(tmp_path_factory):
    """(fresh copy of the inputs, SGLang's Triton kernels' outputs) per kind of case."""
    return triton_outputs(_REFERENCE, _all_cases(), tmp_path_factory.mktemp("cpu_spec"))


def _same(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.dtype == want.dtype, what
    assert torch.equal(got, want), (what, got.tolist(), want.tolist())


# -- reconstruct_indices_from_tree_mask ----------------------------------------------------


def _run_reconstruct(c):
    cpu_spec.reconstruct_indices_from_tree_mask(
        c["tree_mask"],
        c["verified_seq_len"],
        c["positions"],
        c["retrieve_index"],
        c["retrieve_next_token"],
        c["retrieve_next_sibling"],
        c["batch_size"],
        c["draft_token_num"],
    )


def _check_reconstruct(got, want, i):
    # the whole preallocated buffers: the requests' rows, and nothing past them
    for name, g, w in zip(
        ("positions", "index", "next", "sibling"), got["buffers"], want["buffers"], strict=True
    ):
        _same(g, w, (i, name))


def test_tree_metadata_matches_sglangs_kernel(triton_ref):
    fresh, ref = triton_ref
    for i, (c, w) in enumerate(zip(fresh()["reconstruct"], ref["reconstruct"], strict=True)):
        # the reference says what the trees say: first child, next sibling, depth
        bs, n = c["batch_size"], c["draft_token_num"]
        links = [_links(p) for p in c["parents"]]
        for k, buf in enumerate(w["buffers"][2:]):
            rows = buf.view(-1)[: bs * n].view(bs, n)
            assert rows.tolist() == [link[k] for link in links], i
        depth = torch.stack([_mask(p).sum(-1) - 1 for p in c["parents"]])
        lens = c["verified_seq_len"][:bs].long().view(bs, 1)
        assert torch.equal(w["buffers"][0][: bs * n], (depth + lens).reshape(-1)), i
        _run_reconstruct(c)
        _check_reconstruct(c, w, i)
        # the per-bs views left the preallocated rows past the batch alone
        assert (c["buffers"][1].view(-1)[bs * n :] == SENTINEL).all(), i


def test_tree_metadata_into_whole_preallocated_buffers_matches_sglangs_kernel(triton_ref):
    """``retrieve_*`` larger than ``[bs, N]`` (buffers preallocated for more requests):
    SGLang's kernel (and sgl-kernel's op) write request b's rows at ``b * N`` of the flat
    buffer, the first ``bs * N`` entries."""
    fresh, ref = triton_ref
    cases, want = fresh()["reconstruct_whole"], ref["reconstruct_whole"]
    for i, (c, w) in enumerate(zip(cases, want, strict=True)):
        bs, n = c["batch_size"], c["draft_token_num"]
        assert (w["buffers"][1].view(-1)[: bs * n] == torch.arange(bs * n)).all()
        _run_reconstruct(c)
        _check_reconstruct(c, w, i)


# -- verify_tree_greedy ----------------------------------------------------------------------


def _run_verify(c):
    cpu_spec.verify_tree_greedy_cpu(
        c["predicts"],
        c["accept_index"],
        c["accept_token_num"],
        c["candidates"],
        c["retrieve_index"],
        c["retrieve_next_token"],
        c["retrieve_next_sibling"],
        c["target_predict"],
    )


def test_greedy_tree_verify_matches_sglangs_kernel(triton_ref):
    fresh, ref = triton_ref
    cases, want = fresh()["verify"], ref["verify"]
    by_id = {w["id"]: w for w in want}
    # the reference takes the designed paths (sibling order decides among equal tokens)
    for name, (_, _, target, path) in DESIGNED.items():
        w = by_id[name]
        assert w["accept_index"][0].tolist() == path + [-1] * (8 - len(path)), name
        assert w["accept_token_num"].tolist() == [len(path) - 1], name
        assert w["predicts"][path].tolist() == [target[j] for j in path], name
    assert by_id["steps-cap"]["accept_token_num"].tolist() == [3]
    assert by_id["batch"]["accept_token_num"].tolist() == [7, 0, 1]
    assert by_id["batch"]["accept_index"][2, :3].tolist() == [16, 17, -1]
    # the random trees cover no, some and all-the-way acceptance
    accepted = torch.cat([w["accept_token_num"] for w in want if w["id"].startswith("random")])
    assert {0, 1, 2, 3} <= set(accepted.tolist()), accepted.tolist()
    for c, w in zip(cases, want, strict=True):
        _run_verify(c)
        for name in ("predicts", "accept_index", "accept_token_num"):
            _same(c[name], w[name], (c["id"], name))


def test_greedy_tree_verify_with_retrieve_buffers_wider_than_the_batch(triton_ref):
    """The retrieve tensors as preallocated ``[max_bs, N]`` while the batch has fewer
    requests: SGLang's kernel reads request b's entries at ``b * N``."""
    fresh, ref = triton_ref
    c = next(c for c in fresh()["verify"] if c["id"] == "batch")
    w = next(w for w in ref["verify"] if w["id"] == "batch")
    n = c["candidates"].shape[1]
    wide = _verify_case(
        c["parents"],
        c["candidates"].view(-1).tolist(),
        c["target_predict"].view(-1).tolist(),
        8,
        retrieve_rows=5,
    )
    assert wide["retrieve_index"].shape == (5, n)
    _run_verify(wide)
    for name in ("predicts", "accept_index", "accept_token_num"):
        _same(wide[name], w[name], name)


# -- cache-loc windows, accepted slots, bonus tokens ----------------------------------------


WINDOW_OPS = {"extend": "assign_extend_cache_locs_cpu", "assign": "assign_req_to_token_pool_cpu"}


@pytest.mark.parametrize("kind", list(WINDOW_OPS))
def test_cache_loc_windows_match_sglangs_kernels(triton_ref, kind):
    """``assign_extend_cache_locs`` reads each request's window of ``req_to_token`` into the
    packed ``out_cache_loc``; ``assign_req_to_token_pool`` writes it back. Zero-length
    windows, windows longer than the kernels' 32-slot block, int32 offsets and rows."""
    fresh, ref = triton_ref
    for i, (c, w) in enumerate(zip(fresh()[kind], ref[kind], strict=True)):
        before = c["req_to_token"].clone()
        getattr(cpu_spec, WINDOW_OPS[kind])(
            c["req_pool_indices"],
            c["req_to_token"],
            c["start_offset"],
            c["end_offset"],
            c["out_cache_loc"],
            c["req_to_token"].shape[1],
        )
        _same(c["out_cache_loc"], w["out_cache_loc"], (kind, i))
        _same(c["req_to_token"], w["req_to_token"], (kind, i))
        # the reference did the job: window by window, packed in request order
        packed, table, off = w["out_cache_loc"], w["req_to_token"], 0
        for row, s, e in zip(
            c["req_pool_indices"].tolist(),
            c["start_offset"].tolist(),
            c["end_offset"].tolist(),
            strict=True,
        ):
            assert torch.equal(table[row, s:e].long(), packed[off : off + e - s]), (kind, i)
            off += e - s
        if kind == "extend":
            assert (packed[off:] == SENTINEL).all(), (kind, i)
        changed = (table != before).any(-1)
        assert set(changed.nonzero().view(-1).tolist()) <= set(c["req_pool_indices"].tolist())


def test_accepted_slots_are_packed_as_sglangs_kernel_packs_them(triton_ref):
    fresh, ref = triton_ref
    for i, (c, w) in enumerate(zip(fresh()["accept"], ref["accept"], strict=True)):
        cpu_spec.fill_accept_out_cache_loc_cpu(
            c["accept_index"], c["out_cache_loc"], c["accept_out_cache_loc"]
        )
        kept = c["accept_index"][c["accept_index"] != -1].long()
        assert torch.equal(w["accept_out_cache_loc"][: kept.numel()], c["out_cache_loc"][kept])
        _same(c["accept_out_cache_loc"], w["accept_out_cache_loc"], i)


def test_bonus_tokens_match_sglangs_kernel(triton_ref):
    fresh, ref = triton_ref
    for i, (c, w) in enumerate(zip(fresh()["bonus"], ref["bonus"], strict=True)):
        cpu_spec.fill_bonus_tokens_cpu(
            c["accept_tokens"], c["accept_lens"], c["bonus_tokens"], c["accept_stride"]
        )
        _same(c["bonus_tokens"], w["bonus_tokens"], i)


# -- the all-layer KV move -------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=MOVE_SLOTS,
        page_size=1,
        dtype=torch.float32,
        head_num=MOVE_HEADS,
        head_dim=MOVE_K_DIM,
        v_head_dim=MOVE_V_DIM,
        layer_num=MOVE_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def test_kv_move_matches_sglangs_tiled_copy_and_native_move(triton_ref, kv_pool):
    """On SGLang's CPU pool, through its ``data_ptrs`` / ``data_strides`` (K and V rows of
    different widths): SGLang's tiled copy kernel, its ``move_kv_cache_native`` and a
    pair-by-pair copy from a snapshot all agree with the stand-in, overlaps included."""
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    fresh, ref = triton_ref
    bufs = [*kv_pool.k_buffer, *kv_pool.v_buffer]
    for i, (c, w) in enumerate(zip(fresh()["move"], ref["move"], strict=True)):
        for buf, init in zip(bufs, c["buffers"], strict=True):
            buf.copy_(init)
        cpu_spec.copy_all_layer_kv_cache_cpu(
            kv_pool.data_ptrs, kv_pool.data_strides, c["tgt"], c["src"]
        )
        native = [b.clone() for b in c["buffers"]]
        half = len(native) // 2
        move_kv_cache_native(native[:half], native[half:], c["tgt"], c["src"])
        for j, (got, init) in enumerate(zip(bufs, c["buffers"], strict=True)):
            pairwise = init.clone()
            for t, s in zip(c["tgt"].tolist(), c["src"].tolist(), strict=True):
                pairwise[t] = init[s]
            _same(got, w["buffers"][j], (i, j, "triton"))
            _same(got, native[j], (i, j, "native"))
            _same(got, pairwise, (i, j, "pairwise"))
        if (c["tgt"] != c["src"]).any():  # something moved
            assert not torch.equal(bufs[0], c["buffers"][0]), i


def test_an_empty_kv_move_changes_nothing(kv_pool):
    before = [b.clone() for b in kv_pool.k_buffer]
    empty = torch.empty(0, dtype=torch.int64)
    cpu_spec.copy_all_layer_kv_cache_cpu(kv_pool.data_ptrs, kv_pool.data_strides, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(kv_pool.k_buffer, before, strict=True))


# -- verify_attention --------------------------------------------------------------------------

Q_HEADS, KV_HEADS, HEAD_DIM, SCALING = 4, 2, 8, 0.3


def _attention_setup(trees, seq_lens, pool, gen):
    """A TARGET_VERIFY batch over SGLang's CPU pool: request b's committed prefix in
    ``req_to_token`` (random slots), its N drafts at ``out_cache_loc[b*N:(b+1)*N]``."""
    bs, n = len(trees), len(trees[0])
    slots = torch.randperm(pool.size, generator=gen) + 1
    prefix = list(torch.split(slots[: sum(seq_lens)], seq_lens))
    loc = slots[sum(seq_lens) : sum(seq_lens) + bs * n].clone()
    req_rows = torch.tensor([3, 1, 4, 2][:bs])
    req_to_token = torch.zeros(6, 64, dtype=torch.int32)
    for b in range(bs):
        req_to_token[req_rows[b], : seq_lens[b]] = prefix[b].int()
    for buf in (*pool.k_buffer, *pool.v_buffer):  # old KV everywhere, drafts' slots too
        buf.copy_(torch.randn(buf.shape, generator=gen))
    layer = SimpleNamespace(
        layer_id=1,
        tp_q_head_num=Q_HEADS,
        tp_k_head_num=KV_HEADS,
        qk_head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        scaling=SCALING,
        logit_cap=0,
        sliding_window_size=-1,
        is_cross_attention=False,
    )
    spec = SimpleNamespace(
        draft_token_num=n,
        custom_mask=torch.stack([_mask(p) for p in trees]).reshape(-1),
    )
    batch = SimpleNamespace(
        batch_size=bs,
        out_cache_loc=loc,
        req_pool_indices=req_rows,
        seq_lens=torch.tensor(seq_lens),
        spec_info=spec,
    )
    backend = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token)
    )
    q = torch.randn(bs * n, Q_HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    return backend, layer, batch, prefix, q, k, v


def _tree_attention_ref(trees, prefix, keys, values, q, k_new, v_new):
    """Float64, node by node: draft i of request b attends to the prefix and to the drafts
    its mask row marks; q head h reads kv head ``h // (Q_HEADS // KV_HEADS)``."""
    n = len(trees[0])
    out = torch.zeros(q.shape[0], Q_HEADS, HEAD_DIM, dtype=torch.float64)
    qs = q.double().view(-1, Q_HEADS, HEAD_DIM)
    for b, parents in enumerate(trees):
        mask = _mask(parents)
        for i in range(n):
            row = b * n + i
            drafts = [b * n + j for j in range(n) if mask[i, j]]
            ks = torch.cat([keys[prefix[b]], k_new[drafts]]).double()
            vs = torch.cat([values[prefix[b]], v_new[drafts]]).double()
            for h in range(Q_HEADS):
                kvh = h // (Q_HEADS // KV_HEADS)
                scores = [SCALING * float(qs[row, h] @ ks[t, kvh]) for t in range(ks.shape[0])]
                top = max(scores)
                weights = torch.tensor([math.exp(s - top) for s in scores], dtype=torch.float64)
                out[row, h] = (weights / weights.sum()) @ vs[:, kvh]
    return out.view(q.shape[0], -1)


@pytest.fixture()
def attn_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=60,
        page_size=1,
        dtype=torch.float32,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


def test_verify_attention_follows_the_tree_mask(attn_pool):
    gen = torch.Generator().manual_seed(1)
    trees = [_parents(k, 9, gen) for k in ("random", "deep", "star")]
    backend, layer, batch, prefix, q, k, v = _attention_setup(trees, [5, 1, 12], attn_pool, gen)
    old = [b.clone() for b in (*attn_pool.k_buffer, *attn_pool.v_buffer)]
    out = cpu_spec.verify_attention(backend, q, k, v, layer, batch)
    # the drafts' KV went to out_cache_loc in this layer, nothing else changed
    loc = batch.out_cache_loc
    assert torch.equal(attn_pool.k_buffer[1][loc], k)
    assert torch.equal(attn_pool.v_buffer[1][loc], v)
    for now, was in zip((*attn_pool.k_buffer, *attn_pool.v_buffer), old, strict=True):
        keep = torch.ones(now.shape[0], dtype=torch.bool)
        if now is attn_pool.k_buffer[1] or now is attn_pool.v_buffer[1]:
            keep[loc] = False
        assert torch.equal(now[keep], was[keep])
    want = _tree_attention_ref(trees, prefix, attn_pool.k_buffer[1], attn_pool.v_buffer[1], q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # and the mask matters: the same batch read as a chain differs
    batch.spec_info.custom_mask = torch.stack([_mask(_parents("chain", 9, gen))] * 3).reshape(-1)
    chain = cpu_spec.verify_attention(backend, q, k, v, layer, batch)
    assert not torch.allclose(chain, out, atol=1e-3)


def test_verify_attention_on_a_chain_is_causal_attention(attn_pool):
    gen = torch.Generator().manual_seed(2)
    n, lens = 8, [6, 3]
    trees = [_parents("chain", n, gen)] * 2
    backend, layer, batch, prefix, q, k, v = _attention_setup(trees, lens, attn_pool, gen)
    out = cpu_spec.verify_attention(backend, q, k, v, layer, batch)
    group = Q_HEADS // KV_HEADS
    for b, length in enumerate(lens):
        rows = slice(b * n, (b + 1) * n)
        keys = torch.cat([attn_pool.k_buffer[1][prefix[b]], k[rows]]).double()
        values = torch.cat([attn_pool.v_buffer[1][prefix[b]], v[rows]]).double()
        # the prefix's own queries are arbitrary: only the drafts' rows are compared
        qs = torch.cat([torch.randn(length, Q_HEADS * HEAD_DIM, generator=gen), q[rows]])
        qs = qs.double().view(-1, Q_HEADS, HEAD_DIM).transpose(0, 1)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        full = torch.nn.functional.scaled_dot_product_attention(
            qs, keys, values, is_causal=True, scale=SCALING
        )
        want = full.transpose(0, 1)[length:].reshape(n, -1)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)


def test_verify_attention_without_saving_reads_the_pool(attn_pool):
    """``save_kv_cache=False``: the drafts' KV is already in the pool (written by the
    caller); nothing is written and the attention reads what the pool holds."""
    gen = torch.Generator().manual_seed(3)
    trees = [_parents("random", 10, gen)]
    backend, layer, batch, prefix, q, k, v = _attention_setup(trees, [7], attn_pool, gen)
    old = [b.clone() for b in (*attn_pool.k_buffer, *attn_pool.v_buffer)]
    out = cpu_spec.verify_attention(backend, q, k, v, layer, batch, save_kv_cache=False)
    for now, was in zip((*attn_pool.k_buffer, *attn_pool.v_buffer), old, strict=True):
        assert torch.equal(now, was)
    loc = batch.out_cache_loc
    want = _tree_attention_ref(
        trees,
        prefix,
        attn_pool.k_buffer[1],
        attn_pool.v_buffer[1],
        q,
        attn_pool.k_buffer[1][loc],
        attn_pool.v_buffer[1][loc],
    )
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
