"""Re-rotation of cached (post-RoPE) keys to new positions.

RoPE rotates each 2-D pair ``i`` of a key at position ``p`` by the angle ``p * theta_i``.
Rotations compose, so a key cached at position ``a`` moves to position ``b`` by one more
rotation of ``(b - a) * theta_i``: ``k(b) = R(b - a) k(a)``. Values never rotate.

The angles come from the model's own ``cos_sin_cache`` (``[max_pos, rot_dim]``, cos || sin
as SGLang builds it), which already encodes the RoPE variant: linear/NTK/Llama-3 scaling
change ``theta_i``; YaRN also folds a magnitude scale ``m`` into cos and sin, which we
divide out (row 0 holds ``cos(0) * m = m``) so that only the rotation is applied.

FP8 KV caches (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): the stored keys are read as
float32, rotated, and rounded once back to the cache dtype, saturated at its largest finite
value (a rotation keeps each pair's norm but may grow one coordinate by up to sqrt(2), which
could step past the largest FP8 value a key held before).

Layouts: ``is_neox=True`` pairs dimension ``j`` with ``j + rot_dim/2`` (Llama, Qwen2 in
SGLang and HF); ``False`` pairs ``2j`` with ``2j+1`` (GPT-J). Partial rotary: only the
first ``rot_dim`` dimensions of each head rotate.
"""

from __future__ import annotations

import torch

FP8_DTYPES = frozenset(
    d
    for d in (
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to a KV cache's ``dtype``; FP8 saturates at its largest finite value."""
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def delta_cos_sin(
    cos_sin_cache: torch.Tensor, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * theta`` per row, in float32.

    Args:
        cos_sin_cache: ``[max_pos, rot_dim]``, cos in the first half, sin in the second.
        delta: ``[N]`` integer position shifts (any sign), ``|delta| < max_pos``.

    Returns:
        ``(cos, sin)``, each ``[N, rot_dim // 2]`` float32.
    """
    if delta.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"delta must be an integer tensor, got {delta.dtype}")
    max_pos = cos_sin_cache.shape[0]
    mag = delta.abs().long()
    if mag.numel() and int(mag.max()) >= max_pos:
        raise ValueError(
            f"position shift {int(mag.max())} exceeds the RoPE cache ({max_pos} positions)"
        )
    cache = cos_sin_cache.float()
    half = cache.shape[1] // 2
    scale = cache[0, :half]  # cos(0) * m = m (1 without YaRN)
    rows = cache.index_select(0, mag.to(cache.device))
    cos = rows[:, :half] / scale
    sin = rows[:, half:] / scale
    sign = torch.where(delta < 0, -1.0, 1.0).to(device=sin.device, dtype=sin.dtype)
    return cos, sin * sign.unsqueeze(-1)


def rerotate_keys(
    k: torch.Tensor,
    delta: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> torch.Tensor:
    """Rotate post-RoPE keys by ``delta`` positions; returns a new tensor of ``k``'s dtype.

    Args:
        k: ``[N, H, D]`` keys (any float dtype), ``D >= rot_dim``.
        delta: ``[N]`` integer shifts (new position minus old position).
        cos_sin_cache: ``[max_pos, rot_dim]`` as in SGLang's ``RotaryEmbedding``.
        is_neox: pair layout (see the module docstring).
    """
    rot_dim = cos_sin_cache.shape[1]
    if k.dim() != 3 or k.shape[0] != delta.shape[0] or k.shape[2] < rot_dim:
        raise ValueError(
            f"k must be [N, H, D>={rot_dim}] with N == len(delta); got {tuple(k.shape)} "
            f"and {tuple(delta.shape)}"
        )
    cos, sin = delta_cos_sin(cos_sin_cache, delta)
    return apply_rotation(k, cos, sin, is_neox=is_neox)


def apply_rotation(
    k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, is_neox: bool = True
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``k`` (``[N, H, D]``) by per-row angles
    given as ``cos``/``sin`` (``[N, rot_dim // 2]``, e.g. from :func:`delta_cos_sin`, which
    callers compute once and reuse for every layer). Returns a new tensor of ``k``'s dtype."""
    rot_dim = 2 * cos.shape[-1]
    cos = cos.unsqueeze(1)  # [N, 1, rot_dim/2]
    sin = sin.unsqueeze(1)
    x = k[..., :rot_dim].float()
    half = rot_dim // 2  # the pairs: j and j + half (NeoX), 2j and 2j + 1 (GPT-J)
    first, second = (
        (slice(half), slice(half, None)) if is_neox else (slice(0, None, 2), slice(1, None, 2))
    )
    x1, x2 = x[..., first], x[..., second]
    dtype = torch.promote_types(x.dtype, cos.dtype)  # float32 (float64 angles: float64)
    rotated = torch.empty(x.shape, dtype=dtype, device=x.device)
    # autograd (the MLA reference's inputs) does not take out=: the same arithmetic out of place
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        rotated[..., first] = x1 * cos - x2 * sin
        rotated[..., second] = x2 * cos + x1 * sin
    else:  # written in place: two half-size products, no full-size temporaries or cat
        torch.mul(x1, cos, out=rotated[..., first]).sub_(x2 * sin)
        torch.mul(x2, cos, out=rotated[..., second]).add_(x1 * sin)
    if rot_dim == k.shape[-1]:
        return to_kv_dtype(rotated, k.dtype)
    out = k.clone()
    out[..., :rot_dim] = to_kv_dtype(rotated, k.dtype)
    return out


def apply_rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> torch.Tensor:
    """Reference RoPE at absolute positions (what the model applies), in float64.

    ``x``: ``[N, H, D]`` un-rotated; ``positions``: ``[N]``. Used by tests as ground truth.
    """
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    rows = cos_sin_cache.double().index_select(0, positions.long())
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    y = x.double()
    r = y[..., :rot_dim]
    if is_neox:
        x1, x2 = r.chunk(2, dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    out = y.clone()
    out[..., :rot_dim] = rotated
    return out


def build_cos_sin_cache(
    rot_dim: int,
    max_pos: int,
    base: float = 10000.0,
    *,
    linear_factor: float = 1.0,
    mscale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A ``[max_pos, rot_dim]`` cos||sin cache like SGLang's (plain, linear-scaled, or with a
    YaRN-style magnitude ``mscale`` folded in). For tests and the HF reference executor."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    t = torch.arange(max_pos, dtype=torch.float64) / linear_factor
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1).to(dtype)
