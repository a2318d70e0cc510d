"""Fingerprints of token runs: 32-token window hashes salted with a relay namespace, the
same in every process (no Python ``hash``). The DP controller routes by the fingerprints
ranks publish of their spans (:mod:`sglang_relay.runtime.scale.dp_fingerprints`); the span
store remembers those of the spans it dropped for room
(:mod:`sglang_relay.runtime.cache.evicted`)."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import numpy as np

WINDOW = 32  # tokens per fingerprint (the span store's min_span)


STRIDE = 16  # a span publishes the window at every 16th token


_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial hash is a bijection per term


def _powers() -> np.ndarray:
    out = np.empty(WINDOW, dtype=np.uint64)
    acc = np.uint64(1)
    with np.errstate(over="ignore"):
        for i in range(WINDOW - 1, -1, -1):
            out[i] = acc
            acc = acc * _BASE
    return out


_POWERS = _powers()


def namespace_salt(namespace: Hashable) -> np.uint64:
    """A 64-bit salt per relay namespace (:func:`sglang_relay.runtime.sched.options.namespace`:
    SGLang's ``extra_key`` and ``cache_salt`` and the relay key), mixed into every
    fingerprint: a prompt only matches the spans of its own namespace, so routing (and its
    timing) does not tell one tenant whether another holds a text. The default namespace
    (nothing set) has salt 0."""
    if namespace is None or all(part is None for part in namespace):
        return np.uint64(0)
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def window_hashes(tokens, stride: int = 1, salt: int = 0) -> np.ndarray:
    """``uint64`` hashes of the ``WINDOW``-token windows of ``tokens`` starting at every
    ``stride``-th position (none if shorter than a window), XOR ``salt`` (the namespace's);
    identical in every process."""
    ids = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    if ids.shape[0] < WINDOW:
        return np.empty(0, dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, WINDOW)[::stride]
    with np.errstate(over="ignore"):
        return (windows * _POWERS).sum(axis=1, dtype=np.uint64) ^ np.uint64(salt)


def span_fingerprints(tokens, salt: int = 0) -> np.ndarray:
    """The fingerprints a rank publishes for a stored span: the windows at every
    ``STRIDE``-th token and the span's last window (so the windows published cover every
    token of the span: a prompt that pastes it whole is credited with all of it)."""
    n = len(tokens)
    if n < WINDOW:
        return np.empty(0, dtype=np.uint64)
    hashes = window_hashes(tokens, STRIDE, salt)
    if (n - WINDOW) % STRIDE:
        hashes = np.append(hashes, window_hashes(tokens[n - WINDOW :], 1, salt))
    return hashes
