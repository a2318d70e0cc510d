"""Bootstrap intervals for the fidelity measures: per-relay values resampled with replacement.

A fidelity figure over 16-64 relays moves a lot with one relay (one flipped first token is
1/n of top-1), so every figure the benches report carries a 95 % interval, and two methods
are compared on the same relays with a *paired* interval of their difference: a point is
better than a baseline on a measure only where that interval excludes zero in its favour.
Fixed seeds: the same rows give the same intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0


def _stat(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Statistic over the last axis of a ``[resamples, n]`` array."""
    if name == "mean":
        return lambda x: x.mean(axis=-1)
    if name == "median":
        return lambda x: np.median(x, axis=-1)
    raise ValueError(f"unknown statistic {name!r} (mean, median)")


def _percentiles(boot: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_ci(
    values: Sequence[float],
    stat: str = "mean",
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` (``mean`` or ``median``) of ``values``."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    return _percentiles(_stat(stat)(x[_indices(x.size, resamples, seed)]), level)


def cluster_ci(
    groups: Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile interval of the mean of group means, resampling the groups and then each
    chosen group's own values (a two-stage bootstrap): for repeated measurements on units
    that differ among themselves, e.g. rounds on one pair of server instances, where a pair
    can differ from the next by more than its rounds vary."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("no values")
    sizes = np.array([a.size for a in arrays])
    k, width = len(arrays), int(sizes.max())
    table = np.zeros((k, width))
    for j, a in enumerate(arrays):
        table[j, : a.size] = a
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, k, size=(resamples, k))  # the groups of each resample
    n = sizes[picks][..., None]  # [resamples, k, 1]: each picked group's size
    within = (rng.random((resamples, k, width)) * n).astype(np.int64)  # its values, again
    taken = table[picks[..., None], within]
    used = np.arange(width) < n  # a smaller group uses its first `size` draws
    boot = ((taken * used).sum(axis=-1) / n[..., 0]).sum(axis=1)
    return _percentiles(boot / k, level)


def paired_ci(
    a: Sequence[float],
    b: Sequence[float],
    stat: str = "mean",
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> tuple[float, float]:
    """Interval of ``stat(a) - stat(b)`` over the same items (``a[i]``, ``b[i]``: one relay),
    resampling items, not values: what differs between the two methods, not the relays."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.size == 0:
        raise ValueError("need two equally long, non-empty sequences")
    idx = _indices(x.size, resamples, seed)
    f = _stat(stat)
    return _percentiles(f(x[idx]) - f(y[idx]), level)


def verdict(lo: float, hi: float, *, lower_is_better: bool) -> str:
    """``better`` / ``worse`` / ``tie`` for an interval of (method - baseline)."""
    if hi < 0:
        return "better" if lower_is_better else "worse"
    if lo > 0:
        return "worse" if lower_is_better else "better"
    return "tie"
