"""Upstream generation for the reference executor (:mod:`sglang_relay.core.reference`).

:func:`generate` runs requests greedily (each prompt prefilled alone, then a batched
decode, optionally teacher-forced) and returns, per request, an :class:`UpstreamRecord`:
the output tokens, and for the span tokens (the outputs that were fed back, i.e. all but
the last sampled token) the decode-phase KV of every layer (post-RoPE keys), the residual
stream entering every layer and the influence score (attention mass received from decode
queries) at every layer: what a relay reuses (:mod:`.relay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sglang_relay.core.attention import softmax_with_sinks, visible
from sglang_relay.core.reference.model import RefModel
from sglang_relay.core.reference.record import UpstreamRecord
from sglang_relay.core.reference.relay import relay_prefill

__all__ = ["generate"]


@torch.no_grad()
def generate(
    ref: RefModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    min_new_tokens: int = 0,
    capture: bool = True,
    force: Sequence[Sequence[int]] | None = None,
    relayed: Sequence[tuple[Sequence[Any], Any] | None] | None = None,
) -> list[UpstreamRecord]:
    """Greedy generation of several requests, decoded as one batch.

    Each prompt is prefilled alone (all rows active); then one token per request and step
    runs through the layers, attending over that request's positions only (row = position,
    as in the prefill). A request stops after sampling a stop token (stop ids are masked
    while fewer than ``min_new_tokens`` tokens exist) or after ``max_new_tokens`` tokens.
    ``force`` (one token list per prompt) replaces sampling by those tokens: a
    teacher-forced decode that records the decode-phase KV of a given text.

    Returns one :class:`UpstreamRecord` per prompt; with ``capture`` it holds the decode KV,
    the stream entering every layer and the influence score of each fed (span) token.
    Attention is eager (explicit softmax) so that the influence comes from the same
    probabilities the outputs use. ``relayed`` (one entry per prompt, ``None`` or ``(span
    occurrences, RelayConfig)``) prefills that prompt by :func:`relay_prefill` instead of
    exactly: the decode then attends to the relayed prompt KV, as a chain's later agent
    does on a relay server, and the record keeps those prompt keys (``prompt_k``).
    """
    bsz = len(prompts)
    if bsz == 0:
        return []
    if force is not None:
        if len(force) != bsz or any(len(f) == 0 for f in force):
            raise ValueError("force needs one non-empty token list per prompt")
        max_new_tokens = max(len(f) for f in force)
    lens = [len(p) for p in prompts]
    tmax = max(lens) + max_new_tokens
    num_l, hkv = ref.num_layers, ref.num_kv_heads
    dev = ref.device
    # [L, B, H_kv, T, D] and [L, B, H_kv, T, D_v]: the layout SDPA wants per layer
    kb = torch.zeros(num_l, bsz, hkv, tmax, ref.head_dim, dtype=ref.dtype, device=dev)
    vb = torch.zeros(num_l, bsz, hkv, tmax, ref.v_dim, dtype=ref.dtype, device=dev)
    first = []
    if relayed is not None and len(relayed) != bsz:
        raise ValueError("relayed needs one entry (None or (spans, config)) per prompt")
    plans = list(relayed) if relayed is not None else [None] * bsz
    for b, prompt in enumerate(prompts):
        res = relay_prefill(ref, prompt, *(plans[b] or ([], None)))
        kb[:, b, :, : lens[b]] = res.cache.k.transpose(1, 2)
        vb[:, b, :, : lens[b]] = res.cache.v.transpose(1, 2)
        first.append(res.logits[0])
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
    stop_set = set(stop_ids)
    limit = [len(f) for f in force] if force is not None else [max_new_tokens] * bsz

    def choose(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        """Next token per request (``[B]``) from ``logits [B, V]``."""
        if 0 < min_new_tokens and stop.numel():
            short = torch.tensor([len(o) < min_new_tokens for o in outputs], device=dev)
            banned = torch.zeros_like(logits, dtype=torch.bool)
            banned[:, stop] = short[:, None]
            logits = logits.masked_fill(banned, float("-inf"))
        tok = logits.argmax(-1)
        if force is not None:
            idx = [min(len(o), limit[b] - 1) for b, o in enumerate(outputs)]
            tok = torch.tensor([force[b][i] for b, i in enumerate(idx)], device=dev)
        return tok

    tok = choose(torch.stack(first), [[] for _ in range(bsz)])  # [B]
    outputs = [[int(t)] for t in tok]
    hidden = (
        torch.zeros(bsz, max_new_tokens, num_l, ref.hidden_size, dtype=ref.dtype, device=dev)
        if capture
        else None
    )
    # [L, B, T] float32 attention mass received from later decode queries, per layer
    influence = torch.zeros(num_l, bsz, tmax, device=dev) if capture else None
    base = torch.tensor(lens, device=dev)
    arange_b = torch.arange(bsz, device=dev)
    for step in range(max_new_tokens - 1):
        done = [
            len(o) >= limit[b] or (force is None and o[-1] in stop_set)
            for b, o in enumerate(outputs)
        ]
        if all(done):
            break
        pos = base + step  # [B] position of the token fed now (output index ``step``)
        live = torch.tensor([not d for d in done], dtype=torch.float32, device=dev)  # [B]
        hs = ref.embed(tok)  # [B, hidden]
        for lid, layer in enumerate(ref.layers):
            if hidden is not None:
                hidden[:, step, lid] = hs
            x = layer.input_layernorm(hs)
            q, k, v = ref.qkv(layer, x, pos)  # q [B, Hq, D], k/v [B, Hkv, D]
            kb[lid, arange_b, :, pos] = ref.stored(k)
            vb[lid, arange_b, :, pos] = ref.stored(v)
            # the keys and values attended over, [B, G, T, *] (MLA: G = H, up-projected)
            keys, values = ref.expand(lid, kb[lid].transpose(1, 2), vb[lid].transpose(1, 2))
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            # eager attention with explicit probabilities: [B, G, group, T]
            qg = q.view(bsz, keys.shape[1], -1, q.shape[-1])
            scores = torch.einsum("bgrd,bgtd->bgrt", qg, keys) * ref.scale
            seen = visible(pos, tmax, ref.window[lid])[:, None, None]  # [B, 1, 1, T]
            probs = softmax_with_sinks(scores.masked_fill(~seen, float("-inf")), ref.sinks[lid])
            if influence is not None:  # attention mass each position receives (all heads)
                influence[lid] += probs.sum(dim=(1, 2)).float() * live[:, None]
            o = torch.einsum("bgrt,bgtd->bgrd", probs, values)
            hs = ref.finish(layer, hs, o.reshape(bsz, -1))
        tok = choose(ref.logits(hs), outputs)
        for b in range(bsz):
            if not done[b]:
                outputs[b].append(int(tok[b]))
    records = []
    for b in range(bsz):
        out = outputs[b]
        n = len(out) - 1
        rec = UpstreamRecord(list(prompts[b]), out)
        if capture:
            span = slice(lens[b], lens[b] + n)
            rec.k = kb[:, b, :, span].transpose(1, 2).contiguous()  # [L, n, Hkv, D]
            rec.v = vb[:, b, :, span].transpose(1, 2).contiguous()
            rec.hidden = hidden[b, :n].clone() if hidden is not None else None
            rec.influence = influence[:, b, span].T.contiguous()  # [n, L]
            if plans[b] is not None:
                rec.prompt_k = kb[:, b, :, : lens[b]].transpose(1, 2).contiguous()
        records.append(rec)
    return records
