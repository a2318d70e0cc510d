"""The capture forward: SGLang's own per-layer calls (its attention backend included) that
also store, for every token the forward writes, the residual stream entering ``l_start``
at the token's KV slot, and (with influence scores on, in pure decode batches) the
attention mass each context token receives.

It runs for every decode and extend batch without relay work on a server whose profile
needs hidden states. SGLang runs mixed batches (``--enable-mixed-chunk``: decode rows
appended to a prefill) as extend batches, and re-prefills a retracted request's outputs as
extend tokens; both keep their hidden states this way, so every output token, whichever
batch produced it, is stamped valid (:class:`~sglang_relay.runtime.side_data.SlotLedger`).
"""

from __future__ import annotations

import torch

from sglang_relay.runtime.llama import run_layer, stream
from sglang_relay.runtime.side_data import SlotLedger


def capture_forward(model, input_ids, positions, fb, ledger: SlotLedger, *, capture_layer,
                    influence_layer, pool, req_to_token, decode: bool):  # fmt: skip
    """Stock-equivalent forward storing hidden states at ``capture_layer`` (None: none) and,
    when ``decode`` and ``influence_layer`` is set, accumulating influence scores."""
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
