"""The driver's layer loop keeps a row set's stream compact between layers: the stream it
returns, and the stream every entry that says it uses it sees, equal a loop written here
that gathers and scatters the rows at every layer (the loop before 2026-12-07). The layer
is a stand-in that, like SGLang's norms, may write into its input rows in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_relay.runtime.forward.layer_driver import LayerDriver, LayerPlan, RowSet, Stream

LAYERS, ROWS, WIDTH = 9, 12, 5


def stand_in_layer(lid, positions, h, r, fb, attend):
    """A layer that depends on ``h``, ``r``, the layer and the positions, and scribbles on
    its input rows (the caller's own copies) as an in-place norm may."""
    x = h if r is None else h + r
    out = torch.tanh(x * (lid + 1) + positions[:, None].float() / 7)
    h.mul_(-3.0)
    return out, x


class Scripted(LayerPlan):
    """Row sets by layer (the same object while a set lasts, as the extend plan does);
    entries that inject into or read the stream at the layers of ``touch``."""

    def __init__(self, sets: dict[int, list[int] | None], touch: set[int], honest: bool):
        self.sets, self.touch, self.honest = sets, touch, honest
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._rows, self._key = None, object()

    def uses_stream(self, lid):
        return lid in self.touch if self.honest else True

    def enter(self, lid, stream):
        if lid in self.touch:
            self.seen[lid] = (stream.h.clone(), None if stream.r is None else stream.r.clone())
            stream.h[lid % ROWS] += 10.0  # an injected row
        key = self.sets[lid]
        if key is None:
            return None
        if key is not self._key:
            self._key = key
            idx = torch.tensor(key, dtype=torch.int64)
            self._rows = RowSet(idx, idx * 3, idx, attention=None)
        return self._rows


def reference_loop(plan: LayerPlan, stream: Stream) -> Stream:
    for lid in range(LAYERS):
        rows = plan.enter(lid, stream)
        if rows is None:
            continue
        r = None if stream.r is None else stream.r[rows.index].clone()
        h, r = stand_in_layer(lid, rows.positions, stream.h[rows.index].clone(), r, None, None)
        stream.h[rows.index] = h
        stream.residual()[rows.index] = r
    return stream


def driver() -> LayerDriver:
    drv = LayerDriver.__new__(LayerDriver)
    drv.num_layers = LAYERS
    drv._heads = tuple(SimpleNamespace() for _ in range(LAYERS))
    drv.layer = stand_in_layer
    return drv


A, B, C = [0, 2, 3, 7], [1, 2, 5, 6, 11], list(range(ROWS))
SCRIPTS = {
    "one set, entries inside it": (dict.fromkeys(range(LAYERS), A), {0, 4, 7}),
    "sets change, a layer without rows, entries at changes": (
        {0: C, 1: C, 2: A, 3: A, 4: None, 5: B, 6: B, 7: B, 8: A},
        {2, 3, 6, 8},
    ),
    "a set returns after another": ({0: A, 1: A, 2: B, 3: B, 4: A, 5: A, 6: A, 7: C, 8: C}, set()),
}


@pytest.mark.parametrize("honest", [True, False], ids=["entries named", "every layer"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_compact_loop_equals_a_gather_and_scatter_at_every_layer(script, honest):
    sets, touch = SCRIPTS[script]
    start = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(5))
    ours, theirs = Scripted(sets, touch, honest), Scripted(sets, touch, honest)
    got = driver().run(ours, Stream(start.clone()), None)
    want = reference_loop(theirs, Stream(start.clone()))
    assert torch.equal(got.h, want.h) and torch.equal(got.residual(), want.residual())
    assert ours.seen.keys() == theirs.seen.keys() == touch
    for lid in touch:
        (gh, gr), (wh, wr) = ours.seen[lid], theirs.seen[lid]
        assert torch.equal(gh, wh), lid
        assert (gr is None and wr is None) or torch.equal(gr, wr), lid
