"""Token selection at the detection layer: which span tokens are rectified.

All functions work on one span occurrence at a time (thresholds are relative to that
span's mean) and never loop over tokens in Python.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sglang_relay.core.attention import attention_probs, visible
from sglang_relay.core.config import RelayConfig


def kv_deviation(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per-token deviation ``1 - cos(fresh, reused)``, averaged over KV heads.

    Args:
        fresh, reused: ``[S, H_kv, D]`` (keys or values of one layer).

    Returns:
        ``[S]`` float32 in ``[0, 2]``.
    """
    cos = torch.nn.functional.cosine_similarity(fresh.float(), reused.float(), dim=-1, eps=1e-8)
    return (1.0 - cos).mean(dim=-1)


SCORE_BLOCK_BYTES = 1 << 28  # 256 MB of float32 scores per step of context_mass


def context_mass(
    q: torch.Tensor,
    keys: torch.Tensor,
    q_pos: torch.Tensor,
    prompt_len: int,
    scale: float,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """Per query row, the attention mass it puts on the prompt positions ``1..prompt_len-1``
    (position 0, the attention sink, every prompt shares), averaged over query heads.

    For the output tokens of a request, queried with their own decode queries, this is how
    much of what a token's KV holds came from the prompt a relay replaces: the token whose
    KV changes most when the span is pasted elsewhere (``signal="context"``).

    Args:
        q: ``[n, H_q, D]`` post-RoPE queries at absolute positions ``q_pos`` (``[n]``).
        keys: ``[T, H_kv, D]`` post-RoPE keys of positions ``0..T-1`` (GQA: ``H_q`` a
            multiple of ``H_kv``); row ``i`` attends to positions ``<= q_pos[i]`` (within
            its ``window`` where the layer has one; ``sinks`` join the softmax and take
            their share: :func:`~sglang_relay.core.attention.positional_causal_attention`).
        chunk: query rows per step at most; fewer when ``[chunk, H_q, T]`` float32 scores
            would exceed :data:`SCORE_BLOCK_BYTES` (long rows).

    Returns:
        ``[n]`` float32 in ``[0, 1]``.
    """
    n, hq = q.shape[0], q.shape[1]
    t = keys.shape[0]
    chunk = max(1, min(chunk, SCORE_BLOCK_BYTES // (4 * hq * max(t, 1))))
    k = keys.float()
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    cols = torch.arange(t, device=q.device)
    in_prompt = (cols >= 1) & (cols < prompt_len)
    for lo in range(0, n, chunk):
        seen = visible(q_pos[lo : lo + chunk].to(q.device), t, window)
        probs = attention_probs(q[lo : lo + chunk].float(), k, seen, scale, sinks)
        out[lo : lo + chunk] = (probs * in_prompt).sum(-1).mean(dim=(1, 2))
    return out


def _candidates(
    cfg: RelayConfig,
    n: int,
    deviation: torch.Tensor | None,
    influence: torch.Tensor | None,
    head: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, forced)`` ``[n]``: the tokens the rule selects before its cap, and which of
    them are forced (the first ``first_k`` / last ``l_suf`` tokens)."""
    device = deviation.device if deviation is not None else None
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    forced = torch.zeros_like(mask)
    if n == 0 or cfg.method in ("standard", "naive"):
        return mask, forced
    if cfg.detects or cfg.ranks_context:
        if deviation is None:
            raise ValueError(f"method {cfg.method!r} needs deviation scores")
        if deviation.shape != (n,):
            raise ValueError(f"deviation must have shape [{n}]; got {tuple(deviation.shape)}")
        if cfg.top_ratio is not None:
            k = max(1, round(cfg.top_ratio * n))
            mask[deviation.topk(min(k, n)).indices] = True
        else:
            mask |= deviation >= cfg.tau_dev * deviation.mean()
    if cfg.tau_inf is not None and influence is not None:
        if influence.shape != (n,):
            raise ValueError(f"influence must have shape [{n}]; got {tuple(influence.shape)}")
        mask |= influence.to(mask.device) >= cfg.tau_inf * influence.mean()
    forced[: max(0, cfg.first_k - head)] = True
    if cfg.l_suf:
        forced[max(0, n - cfg.l_suf) :] = True
    return mask | forced, forced


def _capped(
    mask: torch.Tensor, forced: torch.Tensor, deviation: torch.Tensor | None, cap: int
) -> torch.Tensor:
    """``mask`` cut to ``cap`` tokens: the forced ones first (the earliest of them first: a
    cap below ``first_k`` keeps a span's first tokens, not an arbitrary tie-broken subset),
    then the highest ``deviation``."""
    if int(mask.sum()) <= cap:
        return mask
    n = mask.numel()
    score = deviation.float().clone() if deviation is not None else torch.zeros(n)
    score = score.to(mask.device)
    idx = torch.arange(n, device=mask.device, dtype=score.dtype)
    top = float(score[mask].max()) if bool(mask.any()) else 0.0
    score[forced] = top + 1.0 + (n - idx[forced])
    score[~mask] = float("-inf")
    out = torch.zeros_like(mask)
    out[score.topk(cap).indices] = True
    return out


def select_tokens(
    cfg: RelayConfig,
    n: int,
    deviation: torch.Tensor | None = None,
    influence: torch.Tensor | None = None,
    *,
    head: int = 0,
    reserve: int = 0,
) -> torch.Tensor:
    """Boolean mask ``[n]`` of the span tokens to rectify in ``[l_det, l_end]``.

    ``head``: how many tokens of the same occurrence precede this run (a span continued
    from the previous prefill chunk); the forced ``first_k`` tokens count from the
    occurrence's start, not the run's. ``reserve``: tokens of the cap spent elsewhere (the
    probe row of ``cfg.probe``).

    ``deviation``/``influence``: ``[n]`` scores (``None`` when the rule needs none); for
    ``signal="context"`` ``deviation`` holds the tokens' context masses. The rule:
    ``top_ratio`` (top fraction by deviation) if set, else ``deviation >= tau_dev * mean``;
    union ``influence >= tau_inf * mean`` (if ``tau_inf`` and scores are given), the first
    ``first_k`` and last ``l_suf`` tokens; then the ``max_ratio`` cap, which keeps the
    forced edge tokens first and the highest-deviation tokens after them.
    """
    mask, forced = _candidates(cfg, n, deviation, influence, head)
    if cfg.max_ratio is None or n == 0:
        return mask
    cap = max(0, int(cfg.max_ratio * n) - reserve)  # floor: reuse kept
    return _capped(mask, forced, deviation, cap)


def select_runs(
    cfg: RelayConfig,
    lengths: list[int],
    deviation: torch.Tensor | None = None,
    influence: torch.Tensor | None = None,
    *,
    heads: list[int] | None = None,
    reserve: int = 0,
    answers: list[bool] | None = None,
) -> list[torch.Tensor]:
    """Masks of one request's matched runs in one prefill chunk (``lengths``; the scores
    are the runs' concatenated, ``heads`` and ``reserve`` as in :func:`select_tokens`;
    ``reserve`` comes off the first run's cap with ``budget="span"``, else off the pool
    holding the first run). ``answers``: which runs are reasoning answers, capped at
    ``cfg.answer_max_ratio`` when it is set (:class:`RelayConfig`).

    ``budget="span"``: each run on its own (:func:`select_tokens`). ``budget="request"``:
    each run's candidates as :func:`select_tokens` finds them, then one cap per pool of
    runs sharing a cap ratio (the answers', the others'), ``floor(ratio * pool tokens)``
    tokens, the highest scores wherever they are in the pool. The reuse target then holds
    for the request's relayed tokens as a whole rather than for each span: a span whose
    tokens barely looked at their context gives its share to one whose tokens did."""
    heads = heads or [0] * len(lengths)
    answers = answers or [False] * len(lengths)
    ratios = [
        cfg.answer_max_ratio if a and cfg.answer_max_ratio is not None else cfg.max_ratio
        for a in answers
    ]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)

    def part(x: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if x is None else x[bounds[i] : bounds[i + 1]]

    if cfg.budget == "span" or len(lengths) < 2:
        return [
            select_tokens(
                cfg if ratios[i] == cfg.max_ratio else replace(cfg, max_ratio=ratios[i]),
                n,
                part(deviation, i),
                part(influence, i),
                head=heads[i],
                reserve=reserve if i == 0 else 0,
            )
            for i, n in enumerate(lengths)
        ]
    found = [
        _candidates(cfg, n, part(deviation, i), part(influence, i), heads[i])
        for i, n in enumerate(lengths)
    ]
    masks = [m for m, _ in found]
    for ratio in dict.fromkeys(ratios):  # one pool per cap ratio, in run order
        if ratio is None:
            continue  # uncapped: every candidate
        pool = [i for i, r in enumerate(ratios) if r == ratio]
        mask = torch.cat([masks[i] for i in pool])
        forced = torch.cat([found[i][1] for i in pool])
        scores = None if deviation is None else torch.cat([part(deviation, i) for i in pool])
        charged = reserve if pool[0] == 0 else 0
        cap = max(0, int(ratio * sum(lengths[i] for i in pool)) - charged)
        mask = _capped(mask, forced, scores, cap)
        at = 0
        for i in pool:
            masks[i] = mask[at : at + lengths[i]]
            at += lengths[i]
    return masks


PROBE_LAYERS_FROM = 0.5  # the probe's attention is averaged over layers >= this share of L


PROBE_MIN_CAP = 2  # the probe runs only where the cap leaves it a choice to make


def probe_pays(cfg: RelayConfig, tokens: int) -> bool:
    """Whether ``cfg``'s last-row probe runs for a request relaying ``tokens`` span tokens
    in one chunk: only when the cap selects at least :data:`PROBE_MIN_CAP` of them (below,
    its charged row would leave nothing to choose, or cost the reuse target)."""
    return cfg.probes and cfg.max_ratio is not None and int(cfg.max_ratio * tokens) >= PROBE_MIN_CAP


def probe_layers(num_layers: int) -> range:
    """The layers whose last-row attention the probe averages (the upper half)."""
    return range(int(num_layers * PROBE_LAYERS_FROM), num_layers)


def probed_mass(mass: torch.Tensor, attention: torch.Tensor, power: float) -> torch.Tensor:
    """``signal="context"`` scores with a probe: each span token's context mass times the
    ``power`` of the attention the downstream's last prompt row gave it (``[S]`` each): a
    token whose KV changed *and* that the new prompt's next token reads ranks first."""
    return mass.float() * attention.float().clamp_min(0).pow(power)
