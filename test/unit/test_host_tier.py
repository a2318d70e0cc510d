"""HiCache's host tier as relay meets it, on SGLang's own CPU code: the real device pool
(``MHATokenToKVPool``), host pool (``MHATokenToKVPoolHost``, layer_first) and transfer
engine (``L2TransferEngine``, io backend ``direct``), with the CPU stand-in's torch row
copy bound where a CUDA build imports ``sgl_kernel``'s (``cpu.host_tier_on_cpu``).

Every host-to-device copy writes device slots outside any model forward; relay stamps
those slots first (``plugin._before_host_load``), so a span recorded on them never reads
the loaded KV as its own, while spans on other slots stay valid."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kv_pools import cpu_kv_pools

from sglang_relay.runtime.cache.side_data import SlotLedger

SLOTS = 64
LAYERS = 2


@pytest.fixture()
def tier():
    return cpu_kv_pools(slots=SLOTS, layers=LAYERS)


def _transfer(tier, host_idx, dev_idx, *, is_draft=False):
    from sglang.srt.mem_cache.l2_transfer import L2Transfer

    return L2Transfer(tier.host, tier.pool, host_idx, dev_idx, is_draft=is_draft)


def _load(tier, host_idx, dev_idx, **kwargs):
    """SGLang's host-to-device submit, through relay's "before" hook as the hook registry
    installs it (applied already if this process loaded SGLang's plugins)."""
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    from sglang_relay.runtime import plugin

    transfers = [_transfer(tier, host_idx, dev_idx, **kwargs)]
    submit = L2TransferEngine.submit_host_to_device
    if not hasattr(submit, "__wrapped__"):
        plugin._before_host_load(tier.engine, transfers)
    return submit(tier.engine, transfers, transfer_layer_id_max=LAYERS)


def test_kv_goes_to_host_and_comes_back_into_other_slots(tier):
    src = torch.tensor([3, 4, 5, 9, 17])
    dst = torch.tensor([20, 21, 40, 41, 63])
    k, v = tier.pool.k_buffer, tier.pool.v_buffer
    want = [(k[i][src].clone(), v[i][src].clone()) for i in range(LAYERS)]
    host_idx = tier.host.alloc(src.numel())
    tier.engine.submit_device_to_host([_transfer(tier, host_idx, src)]).finish_event.synchronize()
    untouched = [tier.pool.k_buffer[i].clone() for i in range(LAYERS)]
    _load(tier, host_idx, dst).finish_event.synchronize()
    others = torch.ones(SLOTS + 1, dtype=torch.bool)
    others[dst] = False
    for layer, (k, v) in enumerate(want):
        assert torch.equal(tier.pool.k_buffer[layer][dst], k)
        assert torch.equal(tier.pool.v_buffer[layer][dst], v)
        assert torch.equal(tier.pool.k_buffer[layer][others], untouched[layer][others])


def test_a_host_load_gives_the_slots_it_writes_fresh_stamps(tier):
    from sglang_relay.runtime.runtime import RelayRuntime
    from sglang_relay.runtime.sglang.pool import attach_pool_runtime

    ledger = SlotLedger(SLOTS + 1, "cpu", hidden_size=4, dtype=torch.float32)
    span = torch.arange(10, 30)  # a recorded span, decoded with its hidden rows
    ledger.stamp(span, with_hidden=True)
    snapshot = ledger.snapshot(span)
    rt = SimpleNamespace(ledger=ledger, counters={"host_loaded_slots": 0})
    rt.kv_loaded = lambda slots: RelayRuntime.kv_loaded(rt, slots)
    attach_pool_runtime(tier.pool, rt)

    host_idx = tier.host.alloc(4)
    tier.engine.submit_device_to_host([_transfer(tier, host_idx, torch.tensor([1, 2, 3, 4]))])
    loaded = torch.tensor([12, 13, 27, 50])  # freed span slots (and one other) reused
    _load(tier, host_idx, loaded)

    valid = ledger.unchanged(span, snapshot)
    hit = torch.isin(span, loaded)
    assert not valid[hit].any()  # the span no longer claims the loaded KV
    assert valid[~hit].all()  # the rest of it is still what was decoded
    assert not ledger.has_hidden(ledger.stamps[loaded]).any()  # no hidden row came along
    assert rt.counters["host_loaded_slots"] == loaded.numel()


def test_a_pool_relay_does_not_serve_is_not_stamped(tier):
    """A pool with no relay runtime (an EAGLE draft model's) loads untouched; so does a
    draft transfer into the served pool (its slots hold the draft model's KV only)."""
    from sglang_relay.runtime.sglang.pool import attach_pool_runtime

    ledger = SlotLedger(SLOTS + 1, "cpu", hidden_size=None, dtype=torch.float32)
    ledger.stamp(torch.arange(SLOTS + 1), with_hidden=False)
    before = ledger.stamps.clone()
    host_idx = tier.host.alloc(2)
    _load(tier, host_idx, torch.tensor([5, 6]))  # no runtime attached yet
    rt = SimpleNamespace(ledger=ledger, counters={"host_loaded_slots": 0}, kv_loaded=None)
    attach_pool_runtime(tier.pool, rt)
    plugin_transfers = [_transfer(tier, host_idx, torch.tensor([5, 6]), is_draft=True)]
    from sglang_relay.runtime import plugin

    plugin._before_host_load(tier.engine, plugin_transfers)  # kv_loaded=None: not called
    assert torch.equal(ledger.stamps, before)


def test_the_stand_in_copies_rows_as_a_brute_force_loop_does():
    from sglang_relay.runtime.standin.cpu import transfer_kv_direct

    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(16, 2, 4, generator=gen) for _ in range(3)]
    dst = [torch.zeros(32, 2, 4) for _ in range(3)]
    si, di = torch.tensor([0, 5, 5, 15]), torch.tensor([31, 0, 7, 8])
    transfer_kv_direct(src, dst, si, di, page_size=1)
    for s, d in zip(src, dst, strict=True):
        want = torch.zeros(32, 2, 4)
        for a, b in zip(si.tolist(), di.tolist(), strict=True):
            want[b] = s[a]
        assert torch.equal(d, want)
    with pytest.raises(ValueError):
        transfer_kv_direct(src, dst[:2], si, di, page_size=1)
