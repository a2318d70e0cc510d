"""Relay's side data follows KV the pool moves outside any forward (speculative decoding's
compaction of accepted drafts), checked against SGLang's own code on its real CPU pool:
``MHATokenToKVPool.move_kv_cache`` (pure-torch move, ``SGLANG_NATIVE_MOVE_KV_CACHE=1``)
and ``spec_utils.move_accept_tokens_to_target_kvcache``."""

from __future__ import annotations

import pytest
import torch

from sglang_relay.runtime.cache.side_data import HIDDEN_BIT, SlotLedger

SLOTS = 64


@pytest.fixture()
def pool(monkeypatch):
    monkeypatch.setenv("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    p = MHATokenToKVPool(
        size=SLOTS,
        page_size=1,
        dtype=torch.float32,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_kv_cache_copy=False,
    )
    assert p.use_native_move_kv_cache
    for layer in range(2):  # every slot's KV says which slot wrote it
        p.k_buffer[layer][:] = torch.arange(SLOTS + 1, dtype=torch.float32).view(-1, 1, 1)
        p.v_buffer[layer][:] = -p.k_buffer[layer]
    return p


def _ledger(written: torch.Tensor, hidden_bits: torch.Tensor) -> SlotLedger:
    """A ledger over the pool's slots whose hidden row of each slot says which slot wrote
    it (like the pool's KV); ``written`` slots stamped, with ``hidden_bits`` where set."""
    ledger = SlotLedger(SLOTS + 1, "cpu", hidden_size=4, dtype=torch.float32, influence=True)
    ledger.hidden[:] = torch.arange(SLOTS + 1, dtype=torch.float32).view(-1, 1)
    ledger.influence[:] = torch.arange(SLOTS + 1, dtype=torch.float32) * 0.5
    for with_hidden in (True, False):
        rows = written[hidden_bits == with_hidden]
        if rows.numel():
            ledger.stamp(rows, with_hidden=with_hidden)
    return ledger


def _moves(gen: torch.Generator):
    """Random (tgt, src) pairs as SGLang's compaction makes them: distinct targets, sources
    that may be other pairs' targets (overlap), trailing 0 -> 0 padding pairs."""
    n = int(torch.randint(1, 12, (1,), generator=gen))
    tgt = torch.randperm(SLOTS, generator=gen)[:n] + 1
    src = torch.where(
        torch.rand(n, generator=gen) < 0.3,
        tgt[torch.randint(0, n, (n,), generator=gen)],
        torch.randint(1, SLOTS + 1, (n,), generator=gen),
    )
    pad = torch.zeros(int(torch.randint(0, 3, (1,), generator=gen)), dtype=torch.int64)
    return torch.cat((tgt, pad)), torch.cat((src, pad))


def test_the_ledger_moves_exactly_as_sglangs_pool_moves_kv(pool):
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        written = torch.randperm(SLOTS, generator=gen)[:40] + 1
        bits = torch.rand(40, generator=gen) < 0.5
        ledger = _ledger(written, bits)
        for layer in range(2):
            pool.k_buffer[layer][:] = torch.arange(SLOTS + 1, dtype=torch.float32).view(-1, 1, 1)
        before = ledger.stamps.clone()
        tgt, src = _moves(gen)
        pool.move_kv_cache(tgt, src)
        ledger.move(tgt, src)
        # hidden rows and influence sit with their KV, slot by slot, as the pool moved it
        for layer in range(2):
            kv_from = pool.k_buffer[layer][:, 0, 0]
            assert torch.equal(ledger.hidden[:, 0], kv_from)
            assert torch.equal(ledger.influence, kv_from * 0.5)
        # stamps: brute force, pair by pair (padding 0 -> 0 keeps slot 0 unwritten)
        moved = {int(t): int(s) for t, s in zip(tgt, src, strict=True)}
        fresh = int(ledger.generation) * 2
        for slot in range(SLOTS + 1):
            if slot not in moved:
                assert int(ledger.stamps[slot]) == int(before[slot]), slot
                continue
            was = int(before[moved[slot]])
            want = 0 if was == 0 else fresh | (was & HIDDEN_BIT)
            assert int(ledger.stamps[slot]) == want, (slot, moved[slot], was)


def test_a_span_that_recorded_a_slot_never_sees_kv_moved_into_it():
    ledger = _ledger(torch.arange(1, 9), torch.ones(8, dtype=torch.bool))
    slots = torch.arange(1, 5)
    snap = ledger.snapshot(slots)
    ledger.move(torch.tensor([2]), torch.tensor([2]))  # even a move of a slot onto itself
    assert ledger.unchanged(slots, snap).tolist() == [True, False, True, True]
    ledger.move(torch.tensor([3]), torch.tensor([7]))
    assert ledger.unchanged(slots, snap).tolist() == [True, False, False, True]
    assert ledger.has_hidden(ledger.snapshot(slots)).all()


def _front(num_front, out_cache_loc, front):
    """SGLang's ``fill_front_out_cache_loc_func`` by its contract (its CPU path needs the
    sgl-kernel CPU build): the first ``num_front[b]`` slots of request b's window, packed."""
    window = out_cache_loc.view(num_front.numel(), -1)
    packed = torch.cat([window[b, : int(n)] for b, n in enumerate(num_front)])
    front[: packed.numel()] = packed


def _accepted(accept_index, out_cache_loc, out, size):
    """``fill_accept_out_cache_loc_func`` by its contract: the slots of accepted nodes
    (``accept_index != -1``), in order, packed."""
    flat = accept_index.reshape(-1)
    packed = out_cache_loc[flat[flat != -1]]
    out[: packed.numel()] = packed


@pytest.mark.parametrize(
    "windows, accept_index",
    [
        # accept_index: global verify rows (request b's node j is row b * 4 + j)
        ([[10, 11, 12, 13]], [[0, 1, 2, -1]]),  # a chain: the identity move
        ([[10, 11, 12, 13]], [[0, 2, 3, -1]]),  # a branch: overlapping moves
        ([[10, 11, 12, 13]], [[0, -1, -1, -1]]),  # the root only
        (  # three requests, different acceptance
            [[20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]],
            [[0, 3, -1, -1], [4, 5, 6, 7], [8, 10, 11, -1]],
        ),
    ],
)
def test_speculative_compaction_through_the_served_pool_keeps_side_data_with_kv(
    pool, monkeypatch, windows, accept_index
):
    """SGLang's real ``move_accept_tokens_to_target_kvcache`` on the real pool, whose
    ``move_kv_cache`` reaches relay's hook: every accepted node's KV and hidden row end at
    the front of its request's window, together, with a stamp that still says hidden."""
    from types import SimpleNamespace

    from sglang.srt.speculative import spec_utils

    from sglang_relay.runtime import plugin
    from sglang_relay.runtime.runtime import RelayRuntime
    from sglang_relay.runtime.sglang.pool import attach_pool_runtime, moves_reach_hook

    monkeypatch.setattr(spec_utils, "fill_front_out_cache_loc_func", _front)
    monkeypatch.setattr(spec_utils, "fill_accept_out_cache_loc_func", _accepted)
    loc = torch.tensor(windows, dtype=torch.int64).reshape(-1)
    ledger = _ledger(loc, torch.ones(loc.numel(), dtype=torch.bool))  # the verify's rows
    rt = SimpleNamespace(ledger=ledger, counters={"kv_moves": 0}, _moved_slots=None)
    rt.kv_moved = lambda tgt, src: RelayRuntime.kv_moved(rt, tgt, src)
    attach_pool_runtime(pool, rt)
    assert moves_reach_hook(pool)
    # as the registered "after" hook wraps it (unless SGLang's plugins were already
    # loaded in this test process, which applies the hook itself)
    if not hasattr(type(pool).move_kv_cache, "__wrapped__"):
        sglang_move = pool.move_kv_cache
        monkeypatch.setattr(
            pool,
            "move_kv_cache",
            lambda t, s: plugin._after_kv_move(sglang_move(t, s), pool, t, s),
        )
    accept = torch.tensor(accept_index, dtype=torch.int64)
    correct = (accept != -1).sum(1) - 1
    batch = SimpleNamespace(seq_lens=torch.zeros(len(windows)), out_cache_loc=loc)
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    spec_utils.move_accept_tokens_to_target_kvcache(batch, accept, correct, allocator)

    assert rt.counters["kv_moves"] == 1
    # the slots whose KV changed place: accepted nodes not already at their depth's slot
    moved = sum(
        int(loc[i]) != window[depth]
        for b, window in enumerate(windows)
        for depth, i in enumerate(int(i) for i in accept[b] if i != -1)
    )
    assert int(rt._moved_slots) == moved
    for b, window in enumerate(windows):
        nodes = [int(i) for i in accept[b] if i != -1]
        for depth, i in enumerate(nodes):  # node i was written to slot loc[i]
            slot = window[depth]
            assert pool.k_buffer[0][slot, 0, 0] == float(loc[i])
            assert ledger.hidden[slot, 0] == float(loc[i])
            assert bool(ledger.has_hidden(ledger.stamps[slot : slot + 1]))
    for layer in range(2):
        assert torch.equal(ledger.hidden[:, 0], pool.k_buffer[layer][:, 0, 0])


def test_a_pool_class_with_its_own_move_is_not_followed(pool):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_relay.runtime.sglang.hooks import resolve
    from sglang_relay.runtime.sglang.pool import moves_reach_hook
    from sglang_relay.runtime.sglang.targets import KV_MOVE_TARGET

    assert resolve(KV_MOVE_TARGET) is MHATokenToKVPool.move_kv_cache
    assert moves_reach_hook(pool)

    class OwnMove(MHATokenToKVPool):
        def move_kv_cache(self, tgt_loc, src_loc):
            return None

    class Inherits(MHATokenToKVPool):
        pass

    assert not moves_reach_hook(OwnMove.__new__(OwnMove))
    assert moves_reach_hook(Inherits.__new__(Inherits))


@pytest.mark.parametrize(
    "mode, hidden, discarded",
    [
        ("TARGET_VERIFY", True, "target_verify_batch"),
        ("DECODE", True, "decode_batch"),
        ("IDLE", False, "idle_batch"),
    ],
)
def test_a_verify_forward_stores_hidden_rows_and_runs_no_plan(mode, hidden, discarded):
    """A speculative verify runs SGLang's own forward: its slots are stamped as holding a
    stored hidden row (the layer hook stores them, as in decode), and a pending relay plan
    cannot run in it: its request falls back with the mode as reason."""
    from types import SimpleNamespace

    from sglang_relay.runtime.metrics import RelayCounters
    from sglang_relay.runtime.runtime import RelayRuntime
    from sglang_relay.runtime.stats import RequestStats

    ledger = SlotLedger(16, "cpu", hidden_size=4, dtype=torch.float32)
    loc = torch.tensor([3, 4, 5, 6])
    stats = RequestStats("relay", 30)
    pending = [SimpleNamespace(stats=stats)]
    me = SimpleNamespace(
        ledger=ledger,
        capture_layer=3,
        disabled=None,
        influence_hook=None,
        hook_forwards=0,
        counters=RelayCounters(),
        planner=SimpleNamespace(take_pending=lambda: [pending.pop()] if pending else []),
    )
    capture = SimpleNamespace(stores=0)
    me.decode_capture = capture

    def sglang_forward(model, ids, pos, fb):  # SGLang's forward; its layer hook stores
        ledger.store_hidden(fb.out_cache_loc, torch.ones(4, 4))
        capture.stores += 1
        return "out"

    me._plain = lambda *a: RelayRuntime._plain(me, *a)
    me._discard = lambda s, reason: RelayRuntime._discard(me, s, reason)
    me._republish = lambda s: None
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name=mode), out_cache_loc=loc)
    assert RelayRuntime.forward(me, sglang_forward, "model", "ids", "pos", fb) == "out"
    assert bool(ledger.has_hidden(ledger.snapshot(loc)).all()) == hidden
    assert (ledger.stamps[loc] != 0).all()
    assert stats.fallback == discarded and me.counters[f"fallback_{discarded}"] == 1
    assert me.disabled is None
