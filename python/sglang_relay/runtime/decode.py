"""The capture forward: SGLang's own per-layer calls (its attention backend included) that
also store, for every token the forward writes, the residual stream entering ``l_start``
at the token's KV slot, and (with influence scores on, in pure decode batches) the
attention mass each context token receives.

It runs for every decode and extend batch without relay work on a server whose profile
needs hidden states. SGLang runs mixed batches (``--enable-mixed-chunk``: decode rows
appended to a prefill) as extend batches, and re-prefills a retracted request's outputs as
extend tokens; both keep their hidden states this way, so every output token, whichever
batch produced it, is stamped valid (:class:`~sglang_relay.runtime.side_data.SlotLedger`).

Decode graphs (CUDA graphs, SGLang's CPU graph runner) capture the decode forward once, at
model-runner init, before the relay runtime exists. :class:`DecodeCapture` is the part of
the runtime a decode forward needs (the ledger's static buffers and the capture layer);
:func:`install_decode_capture` builds it and hangs it on the model just before SGLang
captures its decode graphs, so the captured forward already stamps and stores exactly as
eager decode does. Its forward is tensor ops on static buffers indexed by
``out_cache_loc`` (no host sync, no Python state that a replay would freeze), and eager
decode runs the same function, so graph and eager decode store the same side data.
"""

from __future__ import annotations

import logging

import torch

from sglang_relay.runtime.layer_step import run_layer, stream
from sglang_relay.runtime.sglang.model import attach_decode_capture, decode_capture_of, inner_model
from sglang_relay.runtime.side_data import SlotLedger

logger = logging.getLogger(__name__)


class DecodeCapture:
    """What every decode forward writes besides KV: stamps, and the hidden state entering
    ``capture_layer`` (None: stamps only). Graph-safe: see the module doc."""

    def __init__(self, ledger: SlotLedger, capture_layer: int | None) -> None:
        self.ledger = ledger
        self.capture_layer = capture_layer

    def matches(self, capture_layer: int | None, *, influence: bool, slots: int) -> bool:
        """Whether this capture keeps what a runtime with these needs needs (a ledger sized
        before a post-capture shrink of the KV pool still covers every slot)."""
        return (
            self.capture_layer == capture_layer
            and (self.ledger.influence is not None) == influence
            and self.ledger.stamps.shape[0] >= slots
        )

    def forward(self, original, model, input_ids, positions, fb, *args, **kwargs):
        if self.capture_layer is None:
            self.ledger.stamp(fb.out_cache_loc, with_hidden=False)
            return original(model, input_ids, positions, fb, *args, **kwargs)
        return capture_forward(
            model, input_ids, positions, fb, self.ledger, capture_layer=self.capture_layer
        )


def new_ledger(model, pool, capture_layer: int | None, *, influence: bool = False) -> SlotLedger:
    """The side data of ``pool``'s slots: a stamp each, the hidden row entering
    ``capture_layer`` (None: none) and, with ``influence``, an influence score."""
    kbuf = pool.get_key_buffer(model.layers[0].self_attn.attn.layer_id)
    weight = model.embed_tokens.weight
    return SlotLedger(
        kbuf.shape[0],
        kbuf.device,
        hidden_size=weight.shape[-1] if capture_layer is not None else None,
        dtype=weight.dtype,
        influence=influence,
    )


def install_decode_capture(model_runner) -> DecodeCapture | None:
    """Before SGLang captures decode graphs: build the ledger and the decode capture of a
    relay server and attach them to the served model (the runtime adopts them later).
    None when the server is not a relay server, or its settings are refused later anyway
    (the cache factory says why), or influence scores are on (not graph-safe: refused
    with decode graphs)."""
    from sglang_relay.runtime.backend import serves_relay
    from sglang_relay.runtime.budget import side_layers
    from sglang_relay.runtime.settings import server_settings

    args = model_runner.server_args
    if not serves_relay(args) or getattr(model_runner, "is_draft_worker", False):
        return None
    model = inner_model(model_runner)
    try:
        settings = server_settings(args.model_path)
        capture_layer, influence_layer = side_layers(settings, len(model.layers))
    except ValueError:
        return None
    if influence_layer is not None:
        return None
    existing = decode_capture_of(model)
    if existing is not None:
        return existing
    ledger = new_ledger(model, model_runner.token_to_kv_pool, capture_layer)
    capture = DecodeCapture(ledger, capture_layer)
    attach_decode_capture(model, capture)
    logger.info(
        "sglang-relay: decode capture installed before graph capture (capture_layer=%s)",
        capture_layer,
    )
    return capture


def capture_forward(model, input_ids, positions, fb, ledger: SlotLedger, *, capture_layer,
                    influence_layer=None, pool=None, req_to_token=None,
                    decode: bool = True):  # fmt: skip
    """Stock-equivalent forward storing hidden states at ``capture_layer`` (None: none) and,
    when ``decode`` and ``influence_layer`` is set (with ``pool`` and ``req_to_token``),
    accumulating influence scores."""
    loc = fb.out_cache_loc
    ledger.stamp(loc, with_hidden=capture_layer is not None)
    track_influence = decode and influence_layer is not None and ledger.influence is not None
    if ledger.influence is not None:
        ledger.influence[loc] = 0.0  # fresh slots start with no influence
    h = model.embed_tokens(input_ids)
    r = None
    for lid, layer in enumerate(model.layers):
        if lid == capture_layer:
            ledger.store_hidden(loc, stream(h, r))
        track = track_influence and lid == influence_layer

        def attend(q, k, v, radix_attn=layer.self_attn.attn, track=track):
            out = radix_attn(q, k, v, fb)
            if track:
                accumulate_influence(fb, radix_attn, q, ledger.influence, pool, req_to_token)
            return out

        h, r = run_layer(layer, positions, h, r, fb, attend)
    out, _ = model.norm(h, r)
    return out


def accumulate_influence(fb, radix_attn, q, influence: torch.Tensor, pool, req_to_token) -> None:
    """``influence[slot] += sum over heads of the attention probability`` that each decode
    query puts on each context token (after the query's own KV was written)."""
    hq, d = radix_attn.tp_q_head_num, radix_attn.qk_head_dim
    group = hq // radix_attn.tp_k_head_num
    keys = pool.get_key_buffer(radix_attn.layer_id)
    q3 = q.reshape(-1, hq, d).float()
    for i, seq_len in enumerate(fb.seq_lens.tolist()):
        slots = req_to_token[fb.req_pool_indices[i], :seq_len].long()
        k = keys[slots].float().repeat_interleave(group, dim=1)  # [T, Hq, D]
        logits = torch.einsum("hd,thd->ht", q3[i], k) * radix_attn.scaling
        influence.index_add_(0, slots, logits.softmax(dim=-1).sum(dim=0))
