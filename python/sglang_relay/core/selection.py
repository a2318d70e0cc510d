"""Token selection at the detection layer: which span tokens are rectified.

All functions work on one span occurrence at a time (thresholds are relative to that
span's mean) and never loop over tokens in Python.
"""

from __future__ import annotations

import torch

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


def select_tokens(
    cfg: RelayConfig,
    n: int,
    deviation: torch.Tensor | None = None,
    influence: torch.Tensor | None = None,
    *,
    head: int = 0,
) -> torch.Tensor:
    """Boolean mask ``[n]`` of the span tokens to rectify in ``[l_det, l_end]``.

    ``head``: how many tokens of the same occurrence precede this run (a span continued
    from the previous prefill chunk); the forced ``first_k`` tokens count from the
    occurrence's start, not the run's.

    ``deviation``/``influence``: ``[n]`` scores (``None`` when the rule needs none). The rule:
    ``top_ratio`` (top fraction by deviation) if set, else ``deviation >= tau_dev * mean``;
    union ``influence >= tau_inf * mean`` (if ``tau_inf`` and scores are given), the first
    ``first_k`` and last ``l_suf`` tokens; then the ``max_ratio`` cap, which keeps the
    forced edge tokens first and the highest-deviation tokens after them.
    """
    device = deviation.device if deviation is not None else None
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if n == 0 or cfg.method in ("standard", "naive"):
        return mask
    if cfg.detects:
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
    forced = torch.zeros_like(mask)
    forced[: max(0, cfg.first_k - head)] = True
    if cfg.l_suf:
        forced[max(0, n - cfg.l_suf) :] = True
    mask |= forced
    if cfg.max_ratio is not None:
        cap = int(cfg.max_ratio * n)  # floor: the span keeps its reuse guarantee
        if int(mask.sum()) > cap:
            score = deviation.float().clone() if deviation is not None else torch.zeros(n)
            score = score.to(mask.device)
            # forced tokens first, the earliest of them first (a cap below first_k keeps
            # the span's first tokens, not an arbitrary tie-broken subset)
            idx = torch.arange(n, device=mask.device, dtype=score.dtype)
            top = float(score[mask].max()) if bool(mask.any()) else 0.0
            score[forced] = top + 1.0 + (n - idx[forced])
            score[~mask] = float("-inf")
            keep = score.topk(cap).indices
            mask = torch.zeros_like(mask)
            mask[keep] = True
    return mask
