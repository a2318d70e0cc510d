"""Token runs as numbers, for :mod:`.span_index`: every ``a``-gram of a token array hashed at
once (each token scrambled by a splitmix64 finalizer, then a polynomial hash modulo
2**64), and the length of an equal run of two arrays compared in blocks that grow 4x."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# splitmix64 finalizer constants and the polynomial base (odd, so multiplication is a bijection).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)


_MIX2 = np.uint64(0x94D049BB133111EB)


_BASE = np.uint64(0xD6E8FEB86659FD93)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def as_tokens(tokens: Sequence[int] | np.ndarray, *, copy: bool) -> np.ndarray:
    """``tokens`` as a contiguous 1-D int64 array (a private copy if ``copy``)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence; got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers; got dtype {arr.dtype}")
    if copy:
        return np.array(arr, dtype=np.int64, order="C", copy=True)
    return np.ascontiguousarray(arr, dtype=np.int64)


def gram_hashes(tokens: np.ndarray, gram: int) -> np.ndarray:
    """uint64 hash of ``tokens[i:i + gram]`` for every ``i`` in ``range(len(tokens) - gram + 1)``.

    Deterministic and identical for equal grams; unequal grams may collide (callers verify).
    """
    n = len(tokens) - gram + 1
    if n <= 0:
        return np.empty(0, dtype=np.uint64)
    x = tokens.view(np.uint64) + _GOLDEN
    x = (x ^ (x >> _S30)) * _MIX1
    x = (x ^ (x >> _S27)) * _MIX2
    x ^= x >> _S31
    h = x[:n].copy()
    for j in range(1, gram):
        h *= _BASE
        h += x[j : j + n]
    return h


def equal_run(
    a: np.ndarray, i: int, b: np.ndarray, j: int, limit: int, step: int
) -> tuple[int, int]:
    """Length of the run ``a[i + step*k] == b[j + step*k]`` for ``k = 0, 1, ...`` (at most
    ``limit``) and the number of tokens compared. Compares in blocks that grow 4x from 64,
    so the cost follows the run's length rather than ``limit``."""
    done, block = 0, 64
    while done < limit:
        n = min(block, limit - done)
        if step > 0:
            x, y = a[i + done : i + done + n], b[j + done : j + done + n]
        else:  # backwards: compare a[i-done-n+1 .. i-done] from its end
            x = a[i - done - n + 1 : i - done + 1][::-1]
            y = b[j - done - n + 1 : j - done + 1][::-1]
        bad = np.flatnonzero(x != y)
        if bad.size:
            return done + int(bad[0]), done + n
        done += n
        block *= 4
    return limit, limit
