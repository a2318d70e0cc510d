"""Graph-mode decode, unit level: the slot ledger's writes work inside a compiled (captured)
function without being frozen into it, and the CPU graph stand-in's decode attention equals
a float64 brute force."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from sglang_relay.runtime.cache.side_data import HIDDEN_BIT, SlotLedger


def test_compiled_decode_step_advances_stamps_on_every_call_without_recompiling():
    """A captured decode replays the same code for every step: the generation must live in
    a tensor the graph advances, not in a Python value the graph would hold constant (and
    that torch.compile would guard on, recompiling every step)."""
    ledger = SlotLedger(16, "cpu", hidden_size=4, dtype=torch.float32)

    def step(loc, h):
        ledger.stamp(loc, with_hidden=True)
        ledger.store_hidden(loc, h)
        return h * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, backend="inductor")
    expected_stamps = [0] * 16  # brute force: generation g stamps (g << 1) | HIDDEN_BIT
    expected_hidden = torch.zeros(16, 4)
    snapshots = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in range(1, 6):
            loc = torch.tensor([g, 10])  # slot 10 is rewritten by every step
            h = torch.full((2, 4), float(g))
            compiled(loc, h)
            for slot in loc.tolist():
                expected_stamps[slot] = (g << 1) | HIDDEN_BIT
                expected_hidden[slot] = float(g)
            assert ledger.stamps.tolist() == expected_stamps
            assert torch.equal(ledger.hidden, expected_hidden)
            snapshots.append(ledger.snapshot(torch.tensor([1, 10])))
    # a span recorded after step 1 is still valid on slot 1, stale on rewritten slot 10
    assert ledger.unchanged(torch.tensor([1, 10]), snapshots[0]).tolist() == [True, False]
    assert SlotLedger.has_hidden(snapshots[-1]).all()
    torch._dynamo.reset()


def _brute_force_decode(q, k_cache, v_cache, req_to_token, rows, lens, scaling):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
        for h in range(q.shape[1]):
            slots = req_to_token[row, :n].long()
            k = k_cache[slots, h // group].double()  # [n, D]
            v = v_cache[slots, h // group].double()
            logits = (k @ q[i, h].double()) * scaling
            w = torch.exp(logits - logits.max())
            out[i, h] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
def test_cpu_graph_decode_attention_equals_brute_force(hq, hkv):
    from sglang_relay.runtime.standin.cpu_graph import paged_decode_attention

    torch.manual_seed(0)
    d, slots = 8, 64
    k_cache, v_cache = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    req_to_token = torch.randint(1, slots, (5, 32), dtype=torch.int32)
    rows, lens = [3, 0, 4], [17, 1, 32]
    q = torch.randn(3, hq, d)
    out = torch.empty_like(q)
    args = (torch.tensor(rows), torch.tensor(lens), 0.35)
    paged_decode_attention(q, out, k_cache, v_cache, req_to_token, *args)
    want = _brute_force_decode(q, k_cache, v_cache, req_to_token, rows, lens, 0.35)
    assert torch.allclose(out.double(), want, atol=1e-5)

    # inside a compiled function the op is opaque: same result, no recompiles on new lengths
    def attend(q, req_pool_indices, seq_lens):
        o = torch.empty_like(q)
        rows, lens = req_pool_indices, seq_lens
        paged_decode_attention(q, o, k_cache, v_cache, req_to_token, rows, lens, 0.35)
        return o * 1.0

    torch._dynamo.reset()
    compiled = torch.compile(attend, dynamic=False)
    compiled(q, *args[:2])
    with torch._dynamo.config.patch(error_on_recompile=True):
        lens2 = [5, 30, 2]
        got = compiled(q, torch.tensor(rows), torch.tensor(lens2))
    want2 = _brute_force_decode(q, k_cache, v_cache, req_to_token, rows, lens2, 0.35)
    assert torch.allclose(got.double(), want2, atol=1e-5)
    torch._dynamo.reset()


class _Attention(torch.nn.Module):
    def forward(self, positions, hidden_states, forward_batch):
        return hidden_states * 0.5


class _Stream:  # SGLang's ResidualStream, as far as the hook reads it
    def __init__(self) -> None:
        self.residual = None


class _Layer(torch.nn.Module):
    """A layer shaped like SGLang 0.5.23's: its attention boundary writes the residual
    stream to ``forward_batch.residual_stream`` and hands the attention a normed input."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()

    def forward(self, positions, h, fb):
        before = fb.residual_stream.residual
        residual = h + 1.0 if before is None else h + before
        fb.residual_stream.residual = residual
        out = self.self_attn(positions=positions, hidden_states=residual * 2.0, forward_batch=fb)
        return out + 0.25


class _Batch:  # a ForwardBatch, as far as the forward reads it
    def __init__(self, loc: torch.Tensor) -> None:
        self.out_cache_loc = loc
        self.residual_stream = None


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, positions, h, fb):
        fb.residual_stream = _Stream()
        for layer in self.layers:
            h = layer(positions, h, fb)
        return h


def test_hidden_state_hook_stores_the_written_residual_inside_a_compiled_forward():
    """The decode capture's pre-hook on ``layers[l].self_attn`` copies the residual stream
    SGLang's boundary wrote, at the batch's slots, in eager and in a compiled forward
    (hooks installed before compiling are traced in), on every call, without recompiling;
    the eager-only counter never becomes a guard."""
    from sglang_relay.runtime.forward.decode import DecodeCapture

    model = _Model()
    ledger = SlotLedger(16, "cpu", hidden_size=4, dtype=torch.float32)
    capture = DecodeCapture(ledger, capture_layer=2)
    capture.install(model)
    capture.install(model)  # idempotent: one hook

    def brute_force(h):  # the residual entering layer 2, by hand
        r = h + 1.0
        h1 = r * 2.0 * 0.5 + 0.25
        r = h1 + r
        h2 = r * 2.0 * 0.5 + 0.25
        return h2 + r

    def step(loc, h, fb):
        ledger.stamp(loc, with_hidden=True)
        return model(None, h, fb)

    h = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    step(torch.tensor([3, 4]), h, _Batch(torch.tensor([3, 4])))
    assert capture.stores == 1
    assert torch.equal(ledger.hidden[torch.tensor([3, 4])], brute_force(h))

    torch._dynamo.reset()
    # fullgraph: the hook (and the eager-only counter) must not break the graph
    compiled = torch.compile(step, dynamic=False, backend="inductor", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in range(1, 5):
            loc = torch.tensor([g + 5, 15])
            h = torch.full((2, 4), float(g))
            compiled(loc, h, _Batch(loc))
            assert torch.allclose(ledger.hidden[loc], brute_force(h))
            assert SlotLedger.has_hidden(ledger.snapshot(loc)).all()
    assert capture.stores == 1  # traced calls leave the eager counter alone
    capture.remove()
    assert not capture.hooked
    torch._dynamo.reset()
