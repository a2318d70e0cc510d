"""Continuation and fidelity measures of the reference executor
(:mod:`sglang_relay.core.reference`).

Continuation from a prefill's KV (a :class:`~.relay.RelayResult`): :func:`extend` runs
tokens over a cache, :func:`teacher_forced` gives the logits along a given continuation,
:func:`greedy_continue` decodes greedily, and :func:`greedy_after_forced` does so from a
prefill that already teacher-forced the continuation. Metrics: :func:`first_token_kl`, and
:func:`fidelity`, which compares a method's logits with the exact ones (first-token KL and
top-1, teacher-forced top-1, free-running greedy prefix and first divergence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang_relay.core.reference.model import KVCache, RefModel, _run_layer
from sglang_relay.core.reference.spans import RelayResult

__all__ = [
    "extend",
    "fidelity",
    "first_token_kl",
    "greedy_after_forced",
    "greedy_continue",
    "teacher_forced",
]


# ----------------------------------------------------------------------------- continuation


@torch.no_grad()
def extend(ref: RefModel, cache: KVCache, start: int, tokens: Sequence[int]) -> torch.Tensor:
    """Run ``tokens`` at positions ``start..start+m-1`` over ``cache`` (positions ``< start``
    are context), writing their K/V into ``cache`` (must hold ``start + m`` positions).
    Returns ``[m, vocab]`` float32 logits."""
    m = len(tokens)
    if cache.length < start + m:
        raise ValueError(f"cache holds {cache.length} positions; need {start + m}")
    rows = torch.arange(start, start + m, device=ref.device)
    full = torch.zeros(start + m, ref.hidden_size, dtype=ref.dtype, device=ref.device)
    full[rows] = ref.embed(torch.tensor(list(tokens), dtype=torch.long, device=ref.device))
    for lid in range(ref.num_layers):
        _run_layer(ref, lid, full, rows, cache, start + m)
    return ref.logits(full[rows])


def teacher_forced(ref: RefModel, result: RelayResult, continuation: Sequence[int]) -> torch.Tensor:
    """Logits ``[m, vocab]`` predicting ``continuation[0..m-1]`` after everything in the
    prefill's KV: row 0 is the prefill's last logits row, row ``i`` follows feeding
    ``continuation[:i]``. Does not modify ``result``."""
    m = len(continuation)
    start = result.cache.length
    cache = result.cache.grown(start + max(m - 1, 0))
    rest = extend(ref, cache, start, continuation[: m - 1]) if m > 1 else None
    first = result.logits[-1:]
    return first if rest is None else torch.cat((first, rest))


def greedy_continue(
    ref: RefModel, result: RelayResult, max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> list[int]:
    """Free-running greedy decode (one token per step) from a prefill's KV and last logits."""
    start = result.cache.length
    cache = result.cache.grown(start + max_new_tokens)
    tok = int(result.logits[-1].argmax())
    out = [tok]
    while len(out) < max_new_tokens and tok not in stop_ids:
        tok = int(extend(ref, cache, start + len(out) - 1, [tok])[0].argmax())
        out.append(tok)
    return out


@torch.no_grad()
def greedy_after_forced(
    ref: RefModel,
    result: RelayResult,
    continuation: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[int]:
    """Free-running greedy decode from a prefill that teacher-forced ``continuation[:-1]``
    (``result.logits``: ``[1 + m, vocab]``, as :func:`relay_prefill` returns with
    ``forced``): greedy decoding repeats ``continuation`` until the first step whose argmax
    differs, so only the steps after it run, over the cache cut at that point (positions
    past it are overwritten before anything attends to them). Equals
    :func:`greedy_continue` on the same prefill without the forced tokens. Does not modify
    ``result``."""
    m = result.logits.shape[0]
    if m != len(continuation):
        raise ValueError("need one logits row per continuation token")
    mine = result.logits.argmax(-1).tolist()
    out: list[int] = []
    for i, want in enumerate(continuation[:max_new_tokens]):
        out.append(int(mine[i]))
        if mine[i] != want or mine[i] in stop_ids:
            break
    if len(out) >= max_new_tokens or out[-1] in stop_ids:
        return out
    start = result.prompt_len + len(out) - 1  # position of the last token, not yet in KV
    cache = result.cache.grown(result.prompt_len + max_new_tokens)
    tok = out[-1]
    while len(out) < max_new_tokens and tok not in stop_ids:
        tok = int(extend(ref, cache, start, [tok])[0].argmax())
        out.append(tok)
        start += 1
    return out


# ----------------------------------------------------------------------------- metrics


def first_token_kl(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """``KL(softmax(exact) || softmax(approx))`` of two ``[vocab]`` logit rows (nats)."""
    p = F.log_softmax(exact.double(), -1)
    q = F.log_softmax(approx.double(), -1)
    return float((p.exp() * (p - q)).sum())


def fidelity(
    exact_logits: torch.Tensor, logits: torch.Tensor, continuation: Sequence[int]
) -> dict[str, float | int | None]:
    """Compare teacher-forced logits ``[m, vocab]`` of a method with the exact ones along
    the exact greedy ``continuation`` (``m`` tokens).

    Free-running greedy decoding from the method's context produces exactly the exact
    continuation until the first step whose argmax differs (before that it is fed the
    same tokens as teacher forcing), so the greedy figures follow from the teacher-forced
    argmaxes: ``greedy_prefix`` is the share of the ``m`` tokens before the first
    divergence, ``first_divergence`` its index (``None``: no divergence).
    """
    m = len(continuation)
    if exact_logits.shape[0] != m or logits.shape[0] != m or m == 0:
        raise ValueError("need one logits row per continuation token")
    cont = torch.tensor(list(continuation), device=logits.device)
    mine = logits.argmax(-1)
    agree_tf = (mine == exact_logits.argmax(-1)).float().mean()
    diff = (mine != cont).nonzero()
    first_div = int(diff[0]) if diff.numel() else None
    return {
        "first_token_kl": first_token_kl(exact_logits[0], logits[0]),
        "top1": int(mine[0] == exact_logits[0].argmax()),
        "tf_top1": float(agree_tf),
        "greedy_prefix": (m if first_div is None else first_div) / m,
        "first_divergence": first_div,
        "tf_tokens": m,
    }
