"""The runtime's own logic on a fake pool: slot stamps, span store, planning, request stats.

Expected values come from hand-built cases and brute-force references, never from the code
under test."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_relay.core.config import RelayConfig
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.cache.span_store import SpanStore
from sglang_relay.runtime.forward.attention import build
from sglang_relay.runtime.forward.extend import detect_and_select
from sglang_relay.runtime.forward.scratch import head_maxima, scratch_bytes
from sglang_relay.runtime.sched.planner import Planner, PlanningFailed, valid_runs
from sglang_relay.runtime.stats import RequestStats

L = 30  # layers of the fake model
RELAY = RelayConfig(l_start=3, l_det=4, l_end=-1, min_span=8)
EPIC = RELAY.for_method("epic")


def _brute_runs(ok: list[bool], min_len: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(ok):
        if ok[i]:
            j = i
            while j < len(ok) and ok[j]:
                j += 1
            if j - i >= min_len:
                runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def test_valid_runs_match_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        ok = [rng.random() < 0.8 for _ in range(rng.randint(0, 60))]
        min_len = rng.randint(1, 9)
        assert valid_runs(torch.tensor(ok, dtype=torch.bool), min_len) == _brute_runs(ok, min_len)


def test_stamps_change_only_where_a_forward_writes():
    ledger = SlotLedger(64, "cpu", hidden_size=4, dtype=torch.float32)
    span = torch.tensor([5, 6, 7, 8])
    ledger.stamp(span, with_hidden=True)
    snap = ledger.snapshot(span)
    assert ledger.has_hidden(snap).all()
    ledger.stamp(torch.tensor([1, 2, 3]), with_hidden=False)  # someone else's forward
    assert ledger.unchanged(span, snap).all()
    ledger.stamp(torch.tensor([7]), with_hidden=True)  # slot 7 freed, reused, rewritten
    assert ledger.unchanged(span, snap).tolist() == [True, True, False, True]
    ledger.stamp(torch.tensor([20, 21]), with_hidden=False)
    assert not ledger.has_hidden(ledger.snapshot(torch.tensor([20, 21]))).any()
    assert not ledger.has_hidden(ledger.snapshot(torch.tensor([40]))).any()  # never written
    ledger.reset()
    assert not ledger.unchanged(span, snap).any()


def test_every_allocator_free_path_then_reuse_invalidates_the_span():
    """Frees through every entry point of SGLang 0.5.23's token allocator; once the slots
    are handed out again and a forward writes them, the span's check fails; until then the
    KV is untouched and the span stays valid."""
    pytest.importorskip("sglang")
    from sglang_relay import cpu_setup as cpu

    cpu.activate()
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    def frees(alloc, idx):
        yield "free", lambda: alloc.free(idx)
        yield "free_page_ids", lambda: alloc.free_page_ids(idx)

        def group():
            alloc.free_group_begin()
            alloc.free(idx)
            alloc.free_group_end()

        yield "free_group", group
        yield "free_segment", lambda: alloc.free_segment(idx, start_pos=0)
        yield "free_segments", lambda: alloc.free_segments([(idx, 0)])
        yield "free_full", lambda: alloc.free_full(idx)
        yield "clear", alloc.clear

    size = 32
    probe = TokenToKVPoolAllocator(size, torch.float32, "cpu", kvcache=None, need_sort=False)
    names = [name for name, _ in frees(probe, torch.arange(1, 3))]
    checked = []
    for name in names:
        alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", kvcache=None, need_sort=False)
        ledger = SlotLedger(size + 1, "cpu", hidden_size=None, dtype=torch.float32)
        slots = alloc.alloc(8)
        ledger.stamp(slots, with_hidden=False)  # the upstream decode wrote them
        snap = ledger.snapshot(slots)
        dict(frees(alloc, slots))[name]()
        assert ledger.unchanged(slots, snap).all(), name  # freed, not yet rewritten
        again = alloc.alloc(alloc.available_size())  # everything free, ours included
        assert set(slots.tolist()) <= set(again.tolist()), name
        ledger.stamp(again, with_hidden=False)  # the next forward writes them
        assert not ledger.unchanged(slots, snap).any(), name
        checked.append(name)
    assert checked == names and len(names) == 7


def test_owned_pages_are_whole_pages_of_sglangs_paged_allocator():
    """SGLang 0.5.23's paged allocator frees whole pages: giving back one output token
    that shares its page with the prompt tail frees the prompt tail's slots too. So the
    store holds the pages its span's tokens are in (``page_bounds``), and gives them back
    by freeing the span's slots: exactly those pages return, and no page of the row
    outside them (checked on SGLang's own allocator)."""
    pytest.importorskip("sglang")
    from sglang_relay import cpu_setup as cpu

    cpu.activate()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from sglang_relay.runtime.radix_cache import page_bounds

    page = 16
    alloc = PagedTokenToKVPoolAllocator(
        8 * page, page, torch.float32, "cpu", kvcache=None, need_sort=False
    )
    row = alloc.alloc(4 * page)  # one request: 20 prompt tokens, 37 outputs with KV
    start, end = 20, 57
    before = alloc.available_size()
    alloc.free(row[start : start + 1])  # one token of a page
    assert alloc.available_size() - before == page  # its whole page went back
    alloc.alloc(page)  # (taken again)
    lo, hi = page_bounds(start, end, page)
    assert (lo, hi) == (16, 64) and page_bounds(32, 64, page) == (32, 64)
    held = {int(s) // page for s in row[lo:hi]}
    before = alloc.available_size()
    alloc.free(row[start:end])  # what the store frees: the span's slots
    assert alloc.available_size() - before == hi - lo  # the held pages, whole
    assert {int(s) // page for s in row[start:end]} == held  # and only those
    assert page_bounds(20, 57, 1) == (20, 57)  # page 1: the tokens themselves


def _store():
    released = []
    store = SpanStore(min_match=8, max_tokens=100, release_slots=released.append)
    return store, released


def test_span_store_budget_evicts_lru_and_releases_owned_slots():
    store, released = _store()
    z = torch.zeros(40, dtype=torch.int64)
    a = store.add(list(range(100, 140)), torch.arange(40), z, z, "ns", owned=True)
    b = store.add(list(range(200, 240)), torch.arange(40, 80), z, z, "ns")
    assert store.num_tokens == 80 and store.owned_tokens == 40
    store.find(list(range(100, 140)), "ns")  # touch a: b is now the oldest
    c = store.add(list(range(300, 340)), torch.arange(80, 120), z, z, "ns")
    assert set(store.spans) == {a, c} and released == []
    assert store.release_owned(10) == 40 and len(released) == 1
    assert torch.equal(released[0], torch.arange(40))
    assert set(store.spans) == {c} and store.owned_tokens == 0
    stats = store.stats()  # the budget's drop of b was not for room; a's was
    assert stats["owned_spans_released_for_room"] == 1
    assert stats["owned_tokens_released_for_room"] == 40
    assert b is not None and store.add([1, 2, 3], z[:3], z[:3], z[:3], "ns") is None  # short


def test_span_store_budget_counts_the_page_slots_spans_hold():
    store, released = _store()  # budget 100
    z = torch.zeros(10, dtype=torch.int64)
    ids = [store.add(list(range(k * 10, k * 10 + 10)), torch.arange(10), z, z, "ns",
                     owned=True, held=64) for k in range(3)]  # fmt: skip
    # three 10-token spans, each holding a 64-slot page: 30 tokens but 192 slots
    assert store.owned_tokens <= 100 and store.num_tokens <= 100
    assert set(store.spans) == {ids[2]} and len(released) == 2


def _planner(store, ledger, slots_per_req=64):
    req_to_token = torch.arange(4 * slots_per_req).view(4, slots_per_req) + 200
    return Planner(
        store,
        ledger,
        num_layers=L,
        min_span=8,
        req_to_token=req_to_token,
        attention=build("torch", torch.device("cpu")),
    )


def _fb(rids, prefix, ext, out_cache_loc):
    return SimpleNamespace(
        rids=rids,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
        out_cache_loc=out_cache_loc,
        req_pool_indices=torch.arange(len(rids)),
    )


def _recorded(store, ledger, tokens, slots, *, hidden=True):
    ledger.stamp(slots, with_hidden=hidden)
    pos = torch.arange(100, 100 + len(tokens))
    store.add(tokens, slots, pos, ledger.snapshot(slots), "ns")


def test_plan_batch_trims_rewritten_slots_and_missing_hidden_states():
    store, _ = _store()
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    span_tokens = list(range(500, 540))
    _recorded(store, ledger, span_tokens, torch.arange(10, 50))
    ledger.stamp(torch.tensor([30]), with_hidden=False)  # one slot rewritten (span row 20)
    planner = _planner(store, ledger)
    prompt = [1, 2, 3, 4, 5, *span_tokens, 6, 7]
    stats = RequestStats("relay", L)
    stats.req = SimpleNamespace(rid="r")
    assert planner.plan_request("r", RELAY, stats, prompt[:-1], 0, "ns") == (True, 0)
    out_loc = torch.arange(600, 600 + len(prompt))
    plan, dropped = planner.plan_batch(_fb(["r"], [0], [len(prompt)], out_loc))
    assert dropped == []
    # span rows 0..19 and 21..39 survive (both >= 8 tokens); prompt rows are offset by 5
    want = [5 + i for i in range(40) if i != 20]
    assert plan.span_rows.tolist() == want
    assert plan.span_src.tolist() == [10 + i for i in range(40) if i != 20]
    # delta = new position - old position (recorded at 100 + i)
    assert plan.span_delta.tolist() == [(5 + i) - (100 + i) for i in range(40) if i != 20]
    assert stats.trimmed_tokens == 1 and stats.fallback == "trimmed: span_evicted"
    assert plan.normal_rows.tolist() == [0, 1, 2, 3, 4, 25, 45, 46]  # the trimmed row runs
    # (lo, hi) in the group's rows; the second run follows 21 tokens of its occurrence
    assert [(lo, hi, head) for lo, hi, _, head, _ in plan.groups[0].segments] == [
        (0, 20, 0),
        (20, 39, 21),
    ]
    assert not any(answer for *_, answer in plan.groups[0].segments)  # no reasoning


def test_runs_of_a_reasoning_answer_are_marked_as_answers():
    """A span stored with its answer starting at offset 24 (after the reasoning): a run
    from the answer is an answer run (its own cap), a run of the reasoning is not."""
    store, _ = _store()
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    tokens, slots = list(range(500, 560)), torch.arange(10, 70)
    ledger.stamp(slots, with_hidden=True)
    pos = torch.arange(100, 160)
    store.add(tokens, slots, pos, ledger.snapshot(slots), "ns", answer_start=24)
    planner = _planner(store, ledger, slots_per_req=128)
    reasoning, answer = tokens[:20], tokens[24:]  # a 20-token reasoning quote, the answer
    prompt = [1, 2, *answer, 3, *reasoning, 4]
    stats = RequestStats("relay", L)
    stats.req = SimpleNamespace(rid="r")
    assert planner.plan_request("r", RELAY, stats, prompt[:-1], 0, "ns") == (True, 0)
    plan, _ = planner.plan_batch(_fb(["r"], [0], [len(prompt)], torch.arange(600, 600 + 60)))
    runs = sorted((lo, hi, answer) for lo, hi, _, _, answer in plan.groups[0].segments)
    assert [(hi - lo, answer) for lo, hi, answer in runs] == [(36, True), (20, False)]
    use = plan.owners[0].chunk
    assert use.tokens == 56 and use.answer_tokens == 36


def test_hidden_states_matter_only_to_methods_that_start_above_layer_zero():
    for cfg, expect_rows in ((RELAY, 0), (EPIC, 40)):
        store, _ = _store()
        ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
        span_tokens = list(range(700, 740))
        _recorded(store, ledger, span_tokens, torch.arange(10, 50), hidden=False)  # re-prefilled
        planner = _planner(store, ledger)
        prompt = [9, *span_tokens, 8]
        stats = RequestStats(cfg.method, L)
        planner.plan_request("r", cfg, stats, prompt[:-1], 0, "ns")
        plan, dropped = planner.plan_batch(_fb(["r"], [0], [len(prompt)], torch.arange(600, 642)))
        rows = 0 if plan is None else plan.span_rows.numel()
        assert rows == expect_rows, cfg.method
        if expect_rows == 0:
            assert dropped == [(stats, "hidden_invalid")]


def test_context_rules_carry_the_recorded_masses_or_fall_back():
    """A context-rule group's scores are the masses recorded with its spans, row for row;
    a span recorded without them (the server did not rank by context then) falls back."""
    ctx_rule = RelayConfig(
        l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
        max_ratio=0.2,
    )  # fmt: skip
    for with_context in (True, False):
        store, _ = _store()
        ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
        span_tokens = list(range(900, 940))
        slots = torch.arange(10, 50)
        ledger.stamp(slots, with_hidden=True)
        masses = torch.rand(40)
        store.add(
            span_tokens, slots, torch.arange(100, 140), ledger.snapshot(slots), "ns",
            context=masses if with_context else None,
        )  # fmt: skip
        planner = _planner(store, ledger)
        prompt = [9, 9, *span_tokens, 8]
        stats = RequestStats("relay", L)
        planner.plan_request("r", ctx_rule, stats, prompt[:-1], 0, "ns")
        plan, dropped = planner.plan_batch(_fb(["r"], [0], [len(prompt)], torch.arange(600, 643)))
        if with_context:
            assert dropped == [] and torch.equal(plan.groups[0].context, masses)
            assert plan.groups[0].src.tolist() == slots.tolist()
        else:
            assert plan is None and dropped == [(stats, "context_missing")]


def test_a_request_budget_pools_each_requests_runs_and_only_them():
    """budget="request": a batch's group spends each request's cap over that request's
    runs (highest recorded masses wherever they are), never across requests (brute force
    over the rows' masses)."""
    rule = RelayConfig(
        l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=2, tau_dev=0.0, l_suf=0,
        max_ratio=0.2, budget="request", min_span=8,
    )  # fmt: skip
    store = SpanStore(min_match=8, max_tokens=1000, release_slots=lambda _: None)
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    torch.manual_seed(3)
    spans = {"a": list(range(500, 520)), "b": list(range(700, 730))}
    masses = {"a": torch.rand(20) * 0.1, "b": torch.rand(30)}  # a's tokens barely looked
    for name, slots in (("a", torch.arange(10, 30)), ("b", torch.arange(40, 70))):
        ledger.stamp(slots, with_hidden=True)
        pos = torch.arange(100, 100 + slots.numel())
        store.add(spans[name], slots, pos, ledger.snapshot(slots), "ns", context=masses[name])
    prompts = {
        "r1": [9, *spans["a"], 7, *spans["b"], 8],
        "r2": [5, 6, *spans["a"], 4],  # pooled with r1, a's low masses would lose out
    }
    planner = _planner(store, ledger)
    stats = {}
    for rid, prompt in prompts.items():
        stats[rid] = RequestStats("relay", L)
        assert planner.plan_request(rid, rule, stats[rid], prompt[:-1], 0, "ns")[0]
    lens = [len(p) for p in prompts.values()]
    plan, dropped = planner.plan_batch(_fb(list(prompts), [0, 0], lens, torch.arange(600, 700)))
    assert dropped == [] and len(plan.groups) == 1
    group = plan.groups[0]
    detect_and_select(None, None, None, group, None, None, None)
    expected, row0 = set(), 0
    for rid, prompt in prompts.items():
        score = {}  # batch row -> recorded mass of the span token it holds
        for name in ("a", "b"):
            at = next(
                (i for i in range(len(prompt)) if prompt[i : i + 20] == spans[name][:20]), None
            )
            if at is None:
                continue
            for j in range(len(spans[name])):
                score[row0 + at + j] = float(masses[name][j])
        cap = int(0.2 * len(score))
        expected |= set(sorted(score, key=lambda r: -score[r])[:cap])
        assert stats[rid].chunk.selected == cap
        row0 += len(prompt)
    assert set(group.selected.tolist()) == expected


def test_slots_rewritten_by_this_very_batch_are_not_read():
    store, _ = _store()
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    span_tokens = list(range(800, 840))
    _recorded(store, ledger, span_tokens, torch.arange(10, 50))
    planner = _planner(store, ledger)
    prompt = [9, *span_tokens, 8]
    stats = RequestStats("relay", L)
    planner.plan_request("r", RELAY, stats, prompt[:-1], 0, "ns")
    out_loc = torch.arange(600, 642)
    out_loc[5] = 12  # the allocator handed span slot 12 to this batch (span row 2)
    plan, _ = planner.plan_batch(_fb(["r"], [0], [len(prompt)], out_loc))
    assert plan.span_src.tolist() == list(range(13, 50))  # rows 0-1 are too short to keep


def _two_planned(first_token: int):
    """A planner holding plans "a" and "b" for the same recorded span, their stats and the
    prompt they relay it in."""
    store, _ = _store()
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    span_tokens = list(range(first_token, first_token + 40))
    _recorded(store, ledger, span_tokens, torch.arange(10, 50))
    planner = _planner(store, ledger)
    prompt = [9, *span_tokens, 8]
    s1, s2 = RequestStats("relay", L), RequestStats("relay", L)
    planner.plan_request("a", RELAY, s1, prompt[:-1], 0, "ns")
    planner.plan_request("b", RELAY, s2, prompt[:-1], 0, "ns")
    return planner, s1, s2, prompt


def test_stale_and_unbatched_plans_fall_back_with_a_reason():
    planner, _, _, prompt = _two_planned(900)
    # "a" runs with another prefix length than planned; "b" is not in the batch at all
    plan, dropped = planner.plan_batch(_fb(["a"], [3], [len(prompt)], torch.arange(600, 642)))
    assert plan is None
    assert sorted(reason for _, reason in dropped) == ["stale_plan", "stale_plan"]
    assert planner.pending == {}


def test_a_planning_failure_hands_back_every_plan_it_took():
    planner, s1, s2, prompt = _two_planned(700)
    fb = _fb(["a", "b"], [0, 0], [len(prompt)] * 2, torch.arange(600, 684))
    del fb.extend_prefix_lens_cpu  # a batch planning cannot read
    with pytest.raises(PlanningFailed) as info:
        planner.plan_batch(fb)
    assert {id(s) for s in info.value.stats} == {id(s1), id(s2)}
    assert isinstance(info.value.__cause__, AttributeError)
    assert planner.pending == {}


def test_request_stats_keep_earlier_chunks_when_a_later_chunk_falls_back():
    stats = RequestStats("relay", L)
    c = stats.begin_chunk()
    c.spans, c.tokens, c.recomputed_token_layers, c.first_position = 1, 64, 64 + 12 * 26, 40
    stats.commit()
    c = stats.begin_chunk()
    c.spans, c.tokens, c.first_position = 1, 64, 104
    stats.discard("error: RuntimeError")
    assert stats.reused_tokens == 64 and stats.spans_matched == 1
    assert stats.relayed_from == 40  # the clamp still covers the first chunk
    assert stats.fallback == "error: RuntimeError"
    assert stats.reuse_rate == pytest.approx(1 - (64 + 12 * 26) / (64 * L), abs=1e-4)


def test_a_span_cut_by_a_chunk_boundary_continues_its_occurrence():
    """EPIC's and relay's forced first tokens belong to the start of the occurrence: the
    run that continues a span in the next chunk knows how many tokens came before it."""
    store, _ = _store()
    ledger = SlotLedger(1024, "cpu", hidden_size=4, dtype=torch.float32)
    span_tokens = list(range(1000, 1060))
    _recorded(store, ledger, span_tokens, torch.arange(10, 70))
    planner = _planner(store, ledger)
    prompt = [9, *span_tokens, 8]
    stats = RequestStats("epic", L)
    planner.plan_request("r", EPIC, stats, prompt[0:33], 0, "ns")  # chunk 1: span[0:32]
    first = planner.take_pending()[0]
    assert [(s.span_start, s.length) for s in first.sources] == [(0, 32)] and first.heads == [0]
    planner.plan_request("r", EPIC, stats, prompt[33:61], 33, "ns")  # chunk 2: span[32:60]
    second = planner.pending["r"]
    assert [(s.span_start, s.length) for s in second.sources] == [(32, 28)]
    assert second.heads == [32]
    from sglang_relay.core.selection import select_tokens

    # EPIC's 16 first tokens were all in chunk 1: the continuation forces none
    assert not select_tokens(EPIC, 28, None, None, head=32).any()
    assert select_tokens(EPIC, 28, None, None, head=0).sum() == 16


def test_requests_relay_cannot_serve_safely_are_named():
    from sglang_relay.runtime.sglang.scheduling import request_refusal

    def req(**kw):
        base = dict(
            return_logprob=False,
            logprob_start_len=-1,
            origin_input_ids=list(range(50)),
            return_hidden_states=False,
            input_embeds=None,
            multimodal_inputs=None,
            session_id=None,
            sampling_params=SimpleNamespace(beam_width=1),
        )
        return SimpleNamespace(**{**base, **kw})

    assert request_refusal(req()) is None
    assert request_refusal(req(return_logprob=True, logprob_start_len=50)) is None  # outputs
    assert request_refusal(req(return_logprob=True, logprob_start_len=-1)) is None  # none
    assert request_refusal(req(return_logprob=True, logprob_start_len=3)) == "input_logprobs"
    assert request_refusal(req(return_hidden_states=True)) == "return_hidden_states"
    assert request_refusal(req(multimodal_inputs=object())) == "unsupported_input"
    assert request_refusal(req(session_id="s1")) == "session"
    assert request_refusal(req(sampling_params=SimpleNamespace(beam_width=4))) == "beam_search"


CTX = RelayConfig(
    l_start=0, l_det=0, l_end=-1, signal="context", l_ctx=7, tau_dev=0.0, l_suf=0, max_ratio=0.1
)


def test_budget_reserves_what_the_ledger_allocates():
    """runtime/cache/budget.py's bytes per slot (reserved from SGLang's KV budget before the pool
    exists) equals what a SlotLedger of those settings really allocates, per config shape."""
    from sglang_relay.core.operating import Frontier
    from sglang_relay.runtime.cache.budget import bytes_per_slot, context_layer, side_layers
    from sglang_relay.runtime.config.settings import RelaySettings

    cases = [
        (RelayConfig(l_start=3, l_det=4), Frontier(), 3, None),
        (RelayConfig(l_start=0, l_det=1), Frontier(), None, None),
        (RelayConfig(l_start=3, l_det=4, tau_inf=1.0), Frontier(), 3, 4),
        (
            RelayConfig(l_start=0, l_det=1),
            Frontier(((0.9, RelayConfig(l_start=2, l_det=3, max_ratio=0.1)),)),
            2,
            None,
        ),
        # context rules store the stream entering l_ctx (layer 0: the embeddings, nothing)
        (CTX.__class__(**{**CTX.to_dict(), "l_ctx": 5}), Frontier(), 5, None),
        (CTX.__class__(**{**CTX.to_dict(), "l_ctx": 0}), Frontier(), None, None),
        (RelayConfig(l_start=0, l_det=1), Frontier(((0.9, CTX),)), 7, None),
    ]
    for cfg, frontier, capture, influence in cases:
        settings = RelaySettings(config=cfg, frontier=frontier)
        assert side_layers(settings, 12) == (capture, influence)
        for dtype in (torch.float32, torch.bfloat16):
            ledger = SlotLedger(
                50,
                "cpu",
                hidden_size=24 if capture is not None else None,
                dtype=dtype,
                influence=influence is not None,
            )
            assert bytes_per_slot(settings, 12, 24, dtype.itemsize) * 50 == ledger.nbytes()
    two = RelaySettings(
        config=RelayConfig(l_start=3, l_det=4),
        frontier=Frontier(((0.9, RelayConfig(l_start=2, l_det=3, max_ratio=0.1)),)),
    )
    with pytest.raises(ValueError, match="one layer"):
        side_layers(two, 12)
    # a deviation rule starting at 3 and a context rule at 7: two stored layers
    mixed = RelaySettings(config=RelayConfig(l_start=3, l_det=4), frontier=Frontier(((0.9, CTX),)))
    with pytest.raises(ValueError, match="one layer"):
        side_layers(mixed, 12)
    assert context_layer(mixed, 12) == 7 and context_layer(two, 12) is None


def test_a_requests_own_reasoning_end_marker_counts_as_sglang_counts_it():
    from sglang_relay.runtime.sglang.server import reasoning_end_ids

    config = SimpleNamespace(think_end_ids=[7], request_selectable_think_end_id_sequences=[[5, 6]])

    def req(ids):
        custom = None if ids is None else {"__sglang_reasoning_end_token_ids": ids}
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))

    assert reasoning_end_ids(config, req([5, 6])) == (5, 6)
    assert reasoning_end_ids(config, req([9])) == (7,)  # not selectable: the model's
    assert reasoning_end_ids(config, req("x")) == (7,)  # malformed: the model's
    assert reasoning_end_ids(config, req(None)) == (7,)
    assert reasoning_end_ids(config) == (7,)
    assert reasoning_end_ids(SimpleNamespace(), req(None)) is None


def test_a_relay_extend_error_falls_back_on_one_rank_and_fails_loudly_under_tp(monkeypatch):
    """One rank: the batch runs SGLang's forward and its requests say why. Under TP the
    failing rank may have left the others inside a collective it never joins, so relay
    turns off and the error goes to SGLang (which fails as on any forward error) instead
    of pairing SGLang's collectives with relay's. A failure before the first collective
    (relay's memory bound, preparing the extend) falls back under TP too: the ranks learn
    it together (``worst_failure``, a real two-rank exchange in test_tp_sync.py)."""
    from sglang_relay.runtime import runtime as rt_mod
    from sglang_relay.runtime.metrics import PhaseClock
    from sglang_relay.runtime.runtime import RelayRuntime

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    prepared = []
    monkeypatch.setattr(rt_mod, "relay_prepare", lambda *a: prepared.append(a))
    monkeypatch.setattr(rt_mod, "relay_extend", broken)
    ledger = SlotLedger(64, "cpu", hidden_size=4, dtype=torch.float32)
    fb = SimpleNamespace(out_cache_loc=torch.arange(4))

    def runtime(tp):
        owner = RequestStats("relay", L)
        plan = SimpleNamespace(owners=[owner], lora=None, span_rows=torch.arange(3),
                               probes=[], groups=[])  # fmt: skip
        me = SimpleNamespace(tp=tp, lora=None, ledger=ledger, capture_layer=None, disabled=None)
        me.influence_hook, me.decode_capture = None, SimpleNamespace(stores=0)
        heads = [SimpleNamespace(q=4, kv=2, d=8, dv=8), SimpleNamespace(q=2, kv=1, d=8, dv=8)]
        me.driver = SimpleNamespace(head_max=head_maxima(heads))
        me.scratch_free = lambda: 1 << 40
        me.phases = PhaseClock(enabled=True)  # timing on: the phases are timed too
        me._plain = lambda *a, me=me: RelayRuntime._plain(me, *a)
        me._fall_back = lambda *a, me=me: RelayRuntime._fall_back(me, *a)
        me.discarded = []
        me._discard = lambda stats, reason, me=me: me.discarded.append(reason)
        me.disable = lambda reason, me=me: setattr(me, "disabled", reason)
        ran = []
        standard = lambda *a, ran=ran, **k: ran.append("standard") or "out"  # noqa: E731
        return me, ran, (standard, "model", "ids", "pos", fb, plan, (), {})

    agreed = SimpleNamespace(rank=1, worst_failure=lambda failed, what: failed)
    for tp in (None, agreed):
        me, ran, call = runtime(tp)
        if tp is None:
            assert RelayRuntime._relay(me, *call) == "out"
            assert ran == ["standard"] and me.discarded == ["error: RuntimeError"]
            assert me.disabled is None
        else:
            with pytest.raises(RuntimeError, match="boom"):
                RelayRuntime._relay(me, *call)
            assert ran == [] and "TP rank 1" in me.disabled
    # before the first collective: no memory for relay's buffers (a plan of 3 span rows
    # of 2 KV heads x 8 needs 2 * 2 * 3 * 16 * 4 bytes at its splice), or the splice raises
    monkeypatch.setattr(rt_mod, "relay_extend", lambda *a: pytest.fail("not to run"))
    me, _, call = runtime(None)
    assert me.driver.head_max == (4, 4 * 8, 2 * 8)  # the widest layer's, made once
    assert scratch_bytes(call[5], me.driver) == 2 * (2 * 3 * 16 * 4)  # SLACK x the splice
    for tp in (None, agreed):
        me, ran, call = runtime(tp)
        me.scratch_free = lambda: 10
        assert RelayRuntime._relay(me, *call) == "out" and ran == ["standard"]
        assert me.discarded[0].startswith("memory: relay needs") and me.disabled is None
        me, ran, call = runtime(tp)
        monkeypatch.setattr(rt_mod, "relay_prepare", broken)
        assert RelayRuntime._relay(me, *call) == "out" and ran == ["standard"]
        assert me.discarded == ["error: RuntimeError"] and me.disabled is None
        assert me.phases.n["prepare"] == 1 and me.phases.stats()["phase_prepare_ms"] >= 0
        monkeypatch.setattr(rt_mod, "relay_prepare", lambda *a: None)
