"""Relay's host tier (``runtime/cache/host_tier.py``) on SGLang's own CPU code: the real device
pool (``MHATokenToKVPool``) and slot allocators (token and paged), a real host pool
(``MHATokenToKVPoolHost``, layer_first) and HiCache's transfer engine (``L2TransferEngine``,
io backend ``direct``), with SGLang's controller rule for the indices
(``HiCacheController.move_indices`` / ``_move_write_operation``).

A span copied to host and back into fresh slots reads, slot for slot, the KV it was
decoded with (checked against a clone taken at record time, after the device slots were
overwritten), with its hidden rows, influence scores and hidden bits, and fresh stamps;
the retention order is TTL, then consumed spans, then the rest, each least recently used
first; the store demotes instead of dropping; and a copy back that not every TP rank can
run allocates nothing."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from kv_pools import cpu_kv_pools

from sglang_relay.runtime.cache.host_tier import HostCopy, HostTier, Retention
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.cache.span_store import SpanStore

SLOTS = 64
LAYERS = 2
HIDDEN = 4


def _parts(page: int, host_tokens: int = 32):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    p = cpu_kv_pools(slots=SLOTS, layers=LAYERS, page=page, seed=page, host_tokens=host_tokens)
    pool, host = p.pool, p.host
    if page == 1:
        allocator = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", pool, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            SLOTS, page, torch.float32, "cpu", pool, need_sort=False
        )
    ledger = SlotLedger(
        SLOTS + page, "cpu", hidden_size=HIDDEN, dtype=torch.float32, influence=True
    )
    # SGLang's own index rules, as the tier is given them on a server (sglang/host.py)
    from sglang_relay.runtime.sglang.host import transfer_indices

    controller = SimpleNamespace(
        l2_transfer_engine=p.engine, io_backend="direct", device="cpu", move_indices=None,
        _move_op_indices=None, _move_write_operation=None, transfer_layer_id_max=LAYERS,
    )  # fmt: skip
    return SimpleNamespace(
        pool=pool, allocator=allocator, host=host, ledger=ledger, engine=p.engine,
        indices=transfer_indices(controller, host),
    )  # fmt: skip


def _tier(p, **kwargs) -> HostTier:
    return HostTier(
        host_pool=p.host,
        kv_pool=p.pool,
        engine=kwargs.pop("engine", p.engine),
        indices=p.indices,
        ledger=p.ledger,
        allocator=p.allocator,
        page_size=p.pool.page_size,
        retention=kwargs.pop("retention", Retention(ttl=600)),
        **kwargs,
    )


def _decoded(p, slots: torch.Tensor, hidden_rows: torch.Tensor) -> torch.Tensor:
    """A forward wrote ``slots`` with hidden rows for all but the last two (stamps as the
    served forward gives them); returns the snapshot a span records."""
    p.ledger.stamp(slots[:-2], with_hidden=True)
    p.ledger.store_hidden(slots[:-2], hidden_rows[:-2])
    p.ledger.stamp(slots[-2:], with_hidden=False)
    p.ledger.influence[slots] = torch.arange(slots.numel(), dtype=torch.float32) + 0.5
    return p.ledger.snapshot(slots)


@pytest.mark.parametrize("page", [1, 4])
def test_a_span_comes_back_from_host_with_its_kv_and_side_rows(page):
    p = _parts(page)
    # a request's row: its slots are congruent to positions mod the page (pages 3, 5, 6)
    row = torch.cat([torch.arange(3 * page, 4 * page), torch.arange(5 * page, 7 * page)])
    slots = row[1 : 1 + 2 * page + 1] if page > 1 else torch.tensor([9, 3, 17, 40, 41])
    n = slots.numel()
    hidden_rows = torch.randn(n, HIDDEN)
    stamps = _decoded(p, slots, hidden_rows)
    want_k = [p.pool.k_buffer[i][slots].clone() for i in range(LAYERS)]
    want_v = [p.pool.v_buffer[i][slots].clone() for i in range(LAYERS)]
    tier = _tier(p)
    assert tier.backup(7, slots, stamps)
    for i in range(LAYERS):  # the slots are freed and rewritten by another request
        p.pool.k_buffer[i][slots] = 0.0
        p.pool.v_buffer[i][slots] = 0.0
    p.ledger.stamp(slots, with_hidden=False)
    p.ledger.hidden[slots] = 0.0
    used = p.allocator.alloc(16 if page == 1 else 4 * page)  # other requests hold slots
    assert used is not None

    back = tier.restore(7)
    assert back is not None
    new, new_stamps, held = back
    assert held.numel() % page == 0 and torch.isin(new, held).all()
    assert not torch.isin(held, used).any()  # fresh slots, not another request's
    if page > 1:
        assert torch.equal(new % page, slots % page)  # in-page offsets kept
    for i in range(LAYERS):
        assert torch.equal(p.pool.k_buffer[i][new], want_k[i])
        assert torch.equal(p.pool.v_buffer[i][new], want_v[i])
    assert p.ledger.unchanged(new, new_stamps).all()
    assert not torch.isin(new_stamps, stamps).any()  # fresh stamps
    assert torch.equal(SlotLedger.has_hidden(new_stamps), SlotLedger.has_hidden(stamps))
    assert torch.equal(p.ledger.hidden[new][:-2], hidden_rows[:-2])
    assert torch.equal(p.ledger.influence[new], torch.arange(n, dtype=torch.float32) + 0.5)
    assert tier.counters["restores"] == 1 and tier.counters["restore_tokens"] == n


def test_retention_expires_by_ttl_and_frees_consumed_then_the_rest_oldest_first():
    def copy(t, consumed=False):
        return HostCopy(torch.zeros(1), torch.zeros(1), torch.zeros(1), None, None, t, consumed)

    copies = OrderedDict(
        [(1, copy(0.0)), (2, copy(5.0, consumed=True)), (3, copy(6.0)), (4, copy(7.0, True))]
    )
    rule = Retention(ttl=100.0)
    assert rule.victim(copies, keep=0) == (2, "lru_consumed")
    assert rule.victim(copies, keep=2) == (4, "lru_consumed")
    assert rule.expired(copies, now=101.0) == [1]  # 1 unused for 101 s
    assert rule.expired(copies, now=106.5) == [1, 2, 3]
    no_consumed = OrderedDict((k, v) for k, v in copies.items() if not v.consumed)
    assert rule.victim(no_consumed, keep=0) == (1, "lru")
    assert Retention(ttl=100.0, priority="lru").victim(copies, keep=0) == (1, "lru")
    with pytest.raises(LookupError):
        rule.victim(OrderedDict([(9, copy(0.0))]), keep=9)
    for bad in ({"ttl": 0}, {"ttl": 5, "priority": "fifo"}):
        with pytest.raises(ValueError):
            Retention(**bad)


def test_a_full_tier_gives_way_by_the_retention_order():
    p = _parts(1, host_tokens=8)
    clock = [0.0]
    tier = _tier(p, retention=Retention(ttl=100.0), clock=lambda: clock[0])
    spans = {sid: torch.arange(10 * sid, 10 * sid + 4) for sid in (1, 2, 3)}
    for sid in (1, 2):
        clock[0] += 1
        assert tier.backup(sid, spans[sid], _decoded(p, spans[sid], torch.zeros(4, HIDDEN)))
    tier.touch(1)  # a prompt used span 1: it gives way before span 2, unused yet
    clock[0] += 1
    assert tier.backup(3, spans[3], _decoded(p, spans[3], torch.zeros(4, HIDDEN)))
    assert list(tier.copies) == [2, 3] and tier.counters["evicted_lru_consumed"] == 1
    clock[0] += 200  # nobody used them for the TTL
    assert tier.sweep() == 2 and not tier.copies and tier.stats()["host_tokens"] == 0
    assert p.host.available_size() == 8
    assert not tier.backup(4, torch.arange(20), torch.ones(20, dtype=torch.int64) * 2)
    assert tier.counters["backups_declined_no_host"] == 1  # larger than the tier


def test_a_copy_back_not_every_rank_can_run_allocates_nothing():
    p = _parts(1)
    asked = []
    tier = _tier(p, agree=lambda ok: asked.append(ok) or False)  # another rank cannot
    slots = torch.arange(5, 10)
    assert tier.backup(1, slots, _decoded(p, slots, torch.zeros(5, HIDDEN)))
    free = p.allocator.available_size()
    assert tier.restore(1) is None and tier.restore(2) is None
    assert asked == [True, False]  # every rank is asked, with or without the copy
    assert p.allocator.available_size() == free
    assert tier.counters["restores_declined_tp"] == 1
    assert tier.counters["restores_missed_no_copy"] == 1


def test_the_store_demotes_owned_spans_and_owns_what_comes_back():
    p = _parts(1)
    released = []
    store = SpanStore(min_match=4, max_tokens=12, release_slots=released.append)
    store.tier = _tier(p)
    slots = torch.arange(20, 28)
    stamps = _decoded(p, slots, torch.zeros(8, HIDDEN))
    sid = store.add(list(range(100, 108)), slots, torch.arange(8), stamps, "ns", owned=True)
    assert store.tier.has(sid) and store.owned_tokens == 8
    assert store.release_owned(8) == 8  # SGLang needs the room: demoted, not dropped
    assert torch.equal(released[0], slots) and sid in store.spans
    assert store.owned_tokens == 0 and store.find(list(range(100, 108)), "ns")
    new, new_stamps, held = store.tier.restore(sid)
    store.rehome(sid, new, new_stamps, held)
    span = store.spans[sid]
    assert span.owned and store.owned_tokens == 8 and torch.equal(span.slots, new)
    # the device budget (12) pushes the older owned span out: demoted, still indexed
    other = torch.arange(40, 48)
    sid2 = store.add(
        list(range(200, 208)), other, torch.arange(8), _decoded(p, other, torch.zeros(8, 4)),
        "ns", owned=True,
    )  # fmt: skip
    assert sid in store.spans and not store.spans[sid].owned and store.spans[sid2].owned
    store.drop(sid)
    assert not store.tier.has(sid)  # a dropped span's copy is freed


class _Broken:
    """A transfer engine whose copies fail (a device error, say)."""

    def submit_device_to_host(self, transfers):
        raise RuntimeError("copy failed")

    submit_host_to_device = submit_device_to_host


def test_failed_copies_leave_nothing_held():
    p = _parts(1)
    slots = torch.arange(5, 10)
    broken = _tier(p, engine=_Broken())
    assert not broken.backup(1, slots, _decoded(p, slots, torch.zeros(5, HIDDEN)))
    assert p.host.available_size() == p.host.size and broken.counters["backup_errors"] == 1
    tier = _tier(p)
    assert tier.backup(1, slots, _decoded(p, slots, torch.zeros(5, HIDDEN)))
    tier.engine = _Broken()
    free = p.allocator.available_size()
    assert tier.restore(1) is None  # the copy back failed: its device slots go back
    assert p.allocator.available_size() == free and tier.counters["restore_errors"] == 1


def test_a_copy_past_the_ttl_does_not_come_back():
    p = _parts(1)
    clock = [0.0]
    tier = _tier(p, retention=Retention(ttl=10.0), clock=lambda: clock[0])
    slots = torch.arange(5, 10)
    assert tier.backup(1, slots, _decoded(p, slots, torch.zeros(5, HIDDEN)))
    clock[0] = 5.0
    tier.touch(1)  # used at 5 s: the TTL counts from there
    clock[0] = 14.0
    assert tier.restore(1) is not None
    clock[0] = 30.0
    assert tier.restore(1) is None and not tier.has(1)
    assert tier.counters["evicted_ttl"] == 1
    assert tier.counters["restores_missed_no_copy"] == 1
