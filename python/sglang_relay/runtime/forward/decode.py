"""Plain forwards on SGLang's own model forward, and what relay keeps from them.

Every decode and every extend without relay work (plain requests, mixed batches, a
retracted request's re-prefill, fallbacks) runs the served model's own ``forward``,
untouched: its layers, its layer boundaries (residual adds, TP sums, fused kernels), its
attention backend. Relay adds three things around and inside it:

* before it, a stamp on every KV slot it writes
  (:class:`~sglang_relay.runtime.cache.side_data.SlotLedger`);
* a forward pre-hook on ``layers[capture_layer].self_attn`` that copies the residual stream
  SGLang's attention boundary has just written (the stream entering ``l_start``) into the
  ledger at the batch's KV slots: an observer, no numerical effect, no collective (the
  stream is complete and replicated on every TP rank in the layouts relay serves);
* with influence scores on (eager decode only), a forward hook on the attention module of
  ``influence_layer`` that accumulates the attention mass each context token receives.

Decode graphs (CUDA graphs, SGLang's CPU graph runner) capture the decode forward once, at
model-runner init, before the relay runtime exists, and torch.compile ignores hooks added
after it compiled. :func:`install_decode_capture` therefore builds the
:class:`DecodeCapture` (the ledger and the hidden-state hook) and hangs it on the model
just before SGLang captures its decode graphs, so captured and eager decode run the same
stamp and the same hook: tensor ops on static buffers indexed by ``out_cache_loc``, no
host sync, no Python decision a replay would freeze.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sglang_relay.core.attention import attention_probs, visible
from sglang_relay.runtime.cache.side_data import SlotLedger
from sglang_relay.runtime.models.anatomy import radix_of
from sglang_relay.runtime.sglang.model import (
    attach_decode_capture,
    attention_entry_residual,
    attention_inputs,
    attention_window,
    decode_capture_of,
    inner_model,
)

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch, ModelRunner

logger = logging.getLogger(__name__)


class DecodeCapture:
    """What every plain forward writes besides KV: stamps, and (``capture_layer`` set) the
    hidden state entering ``capture_layer``, stored by a hook inside SGLang's forward.
    Graph-safe: see the module doc."""

    def __init__(self, ledger: SlotLedger, capture_layer: int | None) -> None:
        self.ledger = ledger
        self.capture_layer = capture_layer
        self.stores = 0  # eager forwards whose hidden-state hook fired
        self._handles: list = []

    def install(self, model, residual: str = "boundary") -> None:
        """Register the hidden-state hook on ``model`` (idempotent), where the adapter's
        :attr:`~sglang_relay.runtime.models.anatomy.Anatomy.residual` says the stream is.
        Must run before any graph capture: torch.compile ignores hooks added to a module
        it already compiled."""
        if self._handles or self.capture_layer is None:
            return
        layer = model.layers[self.capture_layer]
        if residual == "boundary":  # SGLang's layer boundary has written the residual
            hook = layer.self_attn.register_forward_pre_hook(self._store, with_kwargs=True)
        else:  # Gemma 3: the layer is handed (hidden_states, residual) by its caller
            hook = layer.register_forward_pre_hook(self._store_from_args, with_kwargs=True)
        self._handles.append(hook)

    @property
    def hooked(self) -> bool:
        return self.capture_layer is None or bool(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _store(self, module, args, kwargs) -> None:
        """Pre-hook of ``self_attn`` at ``capture_layer``: SGLang's attention boundary has
        written the residual stream entering the layer; copy its rows to their KV slots."""
        _, fb = attention_inputs(args, kwargs)
        self.ledger.store_hidden(fb.out_cache_loc, attention_entry_residual(fb))
        if not torch.compiler.is_compiling():  # a traced counter would be a guard
            self.stores += 1

    def _store_from_args(self, module, args, kwargs) -> None:
        """Pre-hook of a decoder layer that takes its residual as an argument (no layer
        boundary): the stream entering it is ``hidden_states + residual`` (the add its input
        norm fuses; the first layer: ``hidden_states`` alone)."""
        h, r, fb = kwargs["hidden_states"], kwargs.get("residual"), kwargs["forward_batch"]
        self.ledger.store_hidden(fb.out_cache_loc, h if r is None else h + r)
        if not torch.compiler.is_compiling():
            self.stores += 1

    def matches(self, capture_layer: int | None, *, influence: bool, slots: int) -> bool:
        """Whether this capture keeps what a runtime with these needs needs (a ledger sized
        before a post-capture shrink of the KV pool still covers every slot)."""
        return (
            self.capture_layer == capture_layer
            and self.hooked
            and (self.ledger.influence is not None) == influence
            and self.ledger.stamps.shape[0] >= slots
        )

    def forward(self, original, model, input_ids, positions, fb: ForwardBatch, *args, **kwargs):
        """SGLang's forward, its slots stamped first (the hook stores the hidden rows)."""
        self.ledger.stamp(fb.out_cache_loc, with_hidden=self.capture_layer is not None)
        return original(model, input_ids, positions, fb, *args, **kwargs)


class InfluenceHook:
    """Eager decode with influence scores (the profile's ``tau_inf``): after SGLang's
    attention at ``influence_layer`` has written the decode rows' KV, add the attention
    mass each query puts on each context token to ``ledger.influence``. Armed only around
    an eager DECODE forward (a host loop per request: refused with decode graphs)."""

    def __init__(self, model, layer: int, ledger: SlotLedger, pool, req_to_token) -> None:
        self.ledger, self.pool, self.req_to_token = ledger, pool, req_to_token
        self.armed = False
        attn = radix_of(model.layers[layer].self_attn)
        self._handle = attn.register_forward_hook(self._accumulate, with_kwargs=True)

    def _accumulate(self, module, args, kwargs, output) -> None:
        if not self.armed:
            return
        q = args[0] if args else kwargs["q"]
        fb = args[3] if len(args) > 3 else kwargs["forward_batch"]
        q_rope = kwargs.get("q_rope")  # MLA on backends that take the rotary part apart
        if q_rope is not None:
            hq = module.tp_q_head_num
            q = torch.cat((q.reshape(-1, hq, module.v_head_dim), q_rope.reshape(-1, hq,
                           module.qk_head_dim - module.v_head_dim)), -1)  # fmt: skip
        sinks = kwargs.get("sinks")  # gpt-oss passes its sink logits to the attention
        accumulate_influence(
            fb, module, q, self.ledger.influence, self.pool, self.req_to_token, sinks
        )

    def remove(self) -> None:
        self._handle.remove()


def new_ledger(model, pool, capture_layer: int | None, *, influence: bool = False) -> SlotLedger:
    """The side data of ``pool``'s slots: a stamp each, the hidden row entering
    ``capture_layer`` (None: none) and, with ``influence``, an influence score."""
    kbuf = pool.get_key_buffer(radix_of(model.layers[0].self_attn).layer_id)
    weight = model.embed_tokens.weight
    return SlotLedger(
        kbuf.shape[0],
        kbuf.device,
        hidden_size=weight.shape[-1] if capture_layer is not None else None,
        dtype=weight.dtype,
        influence=influence,
    )


def install_decode_capture(model_runner: ModelRunner) -> DecodeCapture | None:
    """Before SGLang captures decode graphs: build the ledger and the decode capture of a
    relay server and attach them to the served model (the runtime adopts them later).
    None when the server is not a relay server, or its settings are refused later anyway
    (the cache factory says why), or influence scores are on (not graph-safe: refused
    with decode graphs)."""
    from sglang_relay.runtime.backend import serves_relay
    from sglang_relay.runtime.cache.budget import side_layers
    from sglang_relay.runtime.config.settings import server_settings
    from sglang_relay.runtime.models.registry import anatomy_of

    args = model_runner.server_args
    if not serves_relay(args) or getattr(model_runner, "is_draft_worker", False):
        return None
    model = inner_model(model_runner)
    try:
        settings = server_settings(args.model_path)
        capture_layer, influence_layer = side_layers(settings, len(model.layers))
        residual = anatomy_of(type(model_runner.model).__name__).residual
    except ValueError:  # (an architecture without an adapter is refused at start-up)
        return None
    if influence_layer is not None:
        return None
    existing = decode_capture_of(model)
    if existing is not None:
        return existing
    ledger = new_ledger(model, model_runner.token_to_kv_pool, capture_layer)
    capture = DecodeCapture(ledger, capture_layer)
    capture.install(model, residual)
    attach_decode_capture(model, capture)
    logger.info(
        "sglang-relay: decode capture installed before graph capture (capture_layer=%s)",
        capture_layer,
    )
    return capture


def accumulate_influence(
    fb: ForwardBatch, radix_attn, q, influence: torch.Tensor, pool, req_to_token, sinks=None
) -> None:
    """``influence[slot] += sum over heads of the attention probability`` that each decode
    query puts on each context token (after the query's own KV was written), within the
    layer's sliding window and with its ``sinks`` taking their share where it has them."""
    hq, d = radix_attn.tp_q_head_num, radix_attn.qk_head_dim
    keys = pool.get_key_buffer(radix_attn.layer_id)
    q3 = q.reshape(-1, hq, d).float()
    window = attention_window(radix_attn)
    for i, seq_len in enumerate(fb.seq_lens.tolist()):
        slots = req_to_token[fb.req_pool_indices[i], :seq_len].long()
        seen = visible(torch.tensor([seq_len - 1], device=q.device), seq_len, window)
        probs = attention_probs(q3[i : i + 1], keys[slots].float(), seen, radix_attn.scaling,
                                sinks)  # fmt: skip
        influence.index_add_(0, slots, probs[0].sum(dim=(0, 1)))
