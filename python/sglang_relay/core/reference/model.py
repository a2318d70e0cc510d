"""The model under the reference loop (:mod:`sglang_relay.core.reference`).

:class:`RefModel` holds the HF Llama-family modules the loop calls and computes with them:
the model's RoPE (and SGLang's cos || sin cache layout), post-RoPE q/k/v (fused
projections, Qwen3's q/k norms), the MLP (sparse MoE blocks too), K/V rounded to the
engine's KV cache dtype, and logits. :func:`load_model` loads a checkpoint for it (fp32,
eager). :class:`KVCache` is the dense per-request KV by absolute position, and
``_run_layer`` runs one layer on a set of active rows: writes their K/V, attends over
all positions causally by position (:func:`positional_causal_attention`) and updates the
residual stream. Every other module of the package runs its layers through these.

MLA models (DeepSeek-V3, Kimi-K2) cache what SGLang's ``MLATokenToKVPool`` holds: one
row a token and layer, ``[kv_a_layernorm(latent) (r) | k_pe after RoPE (p)]``, as one KV
head (key dim ``r + p``; the value is its first ``r`` columns), the rotary part in
SGLang's layout (GPT-J pairs ``(2j, 2j+1)`` with ``rope_interleave``, not the
``cat(evens, odds)`` Hugging Face's ``apply_rotary_pos_emb_interleave`` writes). Every
attention site up-projects the rows it reads with ``kv_b_proj`` (:meth:`RefModel.expand`,
Hugging Face's ``expand_kv``): the non-absorbed attention, an oracle independent of the
runtime's absorbed one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from sglang_relay.core.attention import positional_causal_attention
from sglang_relay.core.rope import apply_rotation

__all__ = ["KVCache", "RefModel", "load_model"]


class RefModel:
    """Handles on a HF Llama-family causal LM (fp32, eager) used by the reference loop.

    Args:
        model: a ``LlamaForCausalLM`` (or any model with the same module names), or a
            ``DeepseekV3ForCausalLM`` (MLA: see the module docstring).
        kv_dtype: the serving engine's KV cache dtype when it differs from the model's
            (``--kv-cache-dtype bf16 / fp8_e4m3 / fp8_e5m2``): every K/V row is rounded to
            it where the engine writes its pool, and read back as the model's dtype, as
            SGLang's unscaled pools do. ``None``: the model's dtype (no rounding).

    Attributes (besides the model's modules and sizes):
        mla: multi-head latent attention (a ``kv_b_proj`` in the attention block).
        num_kv_heads, head_dim, v_dim: the cached rows' heads and key / value dims (MLA:
            1, ``r + p``, ``r``; else the model's KV heads and head dim, twice).
        rot_slice, is_neox: the columns of a cached key row RoPE turns (a prefix of them
            under partial rotary: the table's width) and their pair layout (MLA:
            ``slice(r, r + p)``, GPT-J pairs unless ``rope_interleave`` is False).
        scale: the softmax scale (Hugging Face's ``scaling``; DeepSeek's YaRN folds
            ``mscale_all_dim`` into it).
    """

    def __init__(self, model: Any, kv_dtype: torch.dtype | None = None) -> None:
        model.eval()
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        cfg = model.config
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden_size = cfg.hidden_size
        self.v_dim = self.head_dim
        self.rot_slice, self.is_neox = slice(0, self.head_dim), True
        attn = self.layers[0].self_attn
        self.mla = hasattr(attn, "kv_b_proj")
        if self.mla:  # one latent row a token: [normed latent (r) | k_pe (p)]
            if getattr(cfg, "rope_interleave", None) is None:  # DeepSeek-V2: complex RoPE
                raise NotImplementedError(f"{type(model).__name__}: MLA without rope_interleave")
            r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
            self.kv_lora_rank, self.nope_dim, self.rope_dim = r, cfg.qk_nope_head_dim, p
            self.num_kv_heads, self.head_dim, self.v_dim = 1, r + p, r
            self.rot_slice, self.is_neox = slice(r, r + p), not cfg.rope_interleave
        self.scale = float(attn.scaling)
        # per layer: its sliding window (keys a row sees, itself included; 0: none) and its
        # sink logits (gpt-oss; None: none), as Hugging Face's masks and eager attention
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        width = getattr(cfg, "sliding_window", None) or 0
        self.window = [width if t == "sliding_attention" else 0 for t in types]
        self.sinks = [getattr(layer.self_attn, "sinks", None) for layer in self.layers]
        self.dtype = self.embed.weight.dtype
        self.kv_dtype = None if kv_dtype in (None, self.dtype) else kv_dtype
        self.device = self.embed.weight.device
        # the RoPE table a layer uses: one for the model, or one per layer type where the
        # rotary module takes the type (Gemma 3: local and global)
        by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.rope_kind = [t if by_type else None for t in types]
        self._index = {id(layer): lid for lid, layer in enumerate(self.layers)}
        self._cos_sin_cache: dict[str | None, torch.Tensor] = {}
        self._rope_table: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, positions: torch.Tensor, lid: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own RoPE ``(cos, sin)`` of layer ``lid``, each ``[n, head_dim]``, at
        ``positions`` ``[n]`` (rows of a table the rotary module computes once per size;
        elementwise, so equal to what it gives for any batch of positions)."""
        kind = self.rope_kind[lid]
        table = self._rope_table.get(kind)
        need = int(positions.max()) + 1 if positions.numel() else 1
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * (0 if table is None else len(table[0])), 4096)
            dummy = torch.empty(0, dtype=self.dtype, device=self.device)
            pos = torch.arange(size, device=self.device).view(1, -1)
            cos, sin = self.rotary(dummy, pos, *([] if kind is None else [kind]))
            cos, sin = cos[0], sin[0]
            inv_freq = getattr(self.rotary, "inv_freq" if kind is None else f"{kind}_inv_freq")
            if cos.shape[-1] == inv_freq.numel():  # gpt-oss: half dims, neox
                cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            table = self._rope_table[kind] = (cos, sin)
        cos, sin = table
        return cos[positions], sin[positions]

    def cos_sin_cache(self, max_pos: int, lid: int = 0) -> torch.Tensor:
        """``[>=max_pos, rot_dim]`` cos || sin (half dims) of layer ``lid``'s table,
        SGLang's layout, from the model's rotary module (so its scaling variant is whatever
        the model uses)."""
        kind = self.rope_kind[lid]
        cache = self._cos_sin_cache.get(kind)
        if cache is None or cache.shape[0] < max_pos:
            cos, sin = self.rope(torch.arange(max(max_pos, 1), device=self.device), lid)
            half = cos.shape[-1] // 2
            cache = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float()
            self._cos_sin_cache[kind] = cache
        return cache

    def finish(self, layer: Any, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The stream ``h`` after layer ``layer`` given its attention output ``o`` (flat):
        ``o_proj``, the residual adds and the MLP; Gemma 3's four norms (the attention and
        MLP outputs normed before their adds) where the layer has them."""
        a = layer.self_attn.o_proj(o)
        if hasattr(layer, "pre_feedforward_layernorm"):
            h = h + layer.post_attention_layernorm(a)
            x = layer.pre_feedforward_layernorm(h)
            return h + layer.post_feedforward_layernorm(self.mlp(layer, x))
        h = h + a
        return h + self.mlp(layer, layer.post_attention_layernorm(h))

    def qkv(
        self, layer: Any, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE ``q [n, H_q, D]``, ``k [n, H_kv, D]`` and ``v [n, H_kv, D]`` of normed
        input ``x [n, hidden]`` at ``positions [n]``; MLA: ``q [n, H, c + p]`` (not
        absorbed), the cached rows ``k [n, 1, r + p]`` and ``v [n, 1, r]``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = layer.self_attn
        n = x.shape[0]
        if self.mla:
            return self._mla_qkv(attn, x, positions, self._index[id(layer)])
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, q | k | v
            kv = self.num_kv_heads * self.head_dim
            q, k, v = attn.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        across = hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == q.shape[-1]
        if across:  # MiniMax-M2: one RMSNorm over all heads of q, one over all of k
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm") and not across:  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.rope(positions, self._index[id(layer)])
        rot = cos.shape[-1]  # partial rotary (GLM-4.x): the first rot dims turn, the rest stay
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=1)
        if rot == self.head_dim:
            return q_rot, k_rot, v
        return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1), v

    def _mla_qkv(
        self, attn: Any, x: torch.Tensor, positions: torch.Tensor, lid: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA's ``q [n, H, c + p]`` and cached ``k [n, 1, r + p]``, ``v [n, 1, r]`` (the
        rotary parts of q and k in SGLang's layout)."""
        n, r, c = x.shape[0], self.kv_lora_rank, self.nope_dim
        if attn.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(n, self.num_heads, -1)  # [n, H, c + p]
        latent = attn.kv_a_proj_with_mqa(x)  # [n, r + p]
        v = attn.kv_a_layernorm(latent[:, :r]).unsqueeze(1)  # [n, 1, r]
        cos, sin = self.rope(positions, lid)  # [n, p]
        q_pe, k_pe = _mla_rope(q[..., c:], latent[:, None, r:], cos, sin, self.is_neox)
        return torch.cat((q[..., :c], q_pe), -1), torch.cat((v, k_pe), -1), v

    def expand_keys(self, lid: int, k: torch.Tensor) -> torch.Tensor:
        """The keys layer ``lid``'s queries attend to, from cached key rows ``k [..., T,
        H_kv, D]``: ``k`` itself, or (MLA) the per-head keys ``[..., T, H, c + p]``,
        ``kv_b_proj``'s key part of the latent beside ``k_pe`` (shared by the heads)."""
        if not self.mla:
            return k
        r, c = self.kv_lora_rank, self.nope_dim
        up = self.layers[lid].self_attn.kv_b_proj(k[..., 0, :r])  # [..., T, H * (c + dv)]
        up = up.unflatten(-1, (self.num_heads, -1))  # [..., T, H, c + dv]
        k_pe = k[..., r:].expand(*up.shape[:-1], self.rope_dim)  # [..., T, H, p]
        return torch.cat((up[..., :c], k_pe), -1)

    def expand(
        self, lid: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer ``lid`` attends over, from cached rows ``k [..., T, H_kv,
        D]``, ``v [..., T, H_kv, D_v]``: the rows themselves, or (MLA, Hugging Face's
        ``expand_kv``) per-head keys ``[..., T, H, c + p]`` (:meth:`expand_keys`) and values
        ``[..., T, H, dv]`` up-projected from the latent by ``kv_b_proj``."""
        if not self.mla:
            return k, v
        up = self.layers[lid].self_attn.kv_b_proj(v[..., 0, :])  # [..., T, H * (c + dv)]
        values = up.unflatten(-1, (self.num_heads, -1))[..., self.nope_dim :]
        return self.expand_keys(lid, k), values

    @staticmethod
    def mlp(layer: Any, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s MLP block on rows ``x [n, hidden]``: Hugging Face's sparse MoE
        blocks (``experts``) take ``[batch, seq, hidden]``."""
        if hasattr(layer.mlp, "experts"):
            out = layer.mlp(x.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out).squeeze(0)  # gpt-oss: + router
        return layer.mlp(x)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """K or V rows as the engine's KV pool holds them (rounded to ``kv_dtype``)."""
        return x if self.kv_dtype is None else x.to(self.kv_dtype).to(x.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` float32 logits of last-layer streams ``h [n, hidden]``."""
        return self.lm_head(self.norm(h)).float()


def load_model(
    model_dir: str,
    num_layers: int | None = None,
    device: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> RefModel:
    """Load a checkpoint in fp32 with eager attention (optionally only its first layers),
    on ``device`` (default: the GPU when there is one: an 8B model in fp32 needs 32 GB);
    ``kv_dtype``: the engine's KV cache dtype (:class:`RefModel`)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return RefModel(model.to(device), kv_dtype=kv_dtype)


@dataclass
class KVCache:
    """Dense per-request KV by absolute position: ``k`` is ``[L, T, H_kv, D]``, ``v``
    ``[L, T, H_kv, D_v]`` (MLA: the latent rows ``[L, T, 1, r + p]`` and their first ``r``
    columns)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, ref: RefModel, length: int) -> KVCache:
        shape = (ref.num_layers, length, ref.num_kv_heads)
        return cls(
            torch.zeros(*shape, ref.head_dim, dtype=ref.dtype, device=ref.device),
            torch.zeros(*shape, ref.v_dim, dtype=ref.dtype, device=ref.device),
        )

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def grown(self, length: int) -> KVCache:
        """A copy with room for ``length`` positions (the first ``self.length`` kept)."""
        if length <= self.length:
            return KVCache(self.k.clone(), self.v.clone())
        pad = (self.k.shape[0], length - self.length, self.k.shape[2])
        return KVCache(
            torch.cat((self.k, self.k.new_zeros(*pad, self.k.shape[3])), 1),
            torch.cat((self.v, self.v.new_zeros(*pad, self.v.shape[3])), 1),
        )


def _run_layer(
    ref: RefModel,
    lid: int,
    hs: torch.Tensor,
    rows: torch.Tensor,
    cache: KVCache,
    ctx: int,
) -> None:
    """Layer ``lid`` on the active ``rows`` (row = position): writes their K/V into
    ``cache`` (``[L, T, H_kv, D]``), attends over positions ``< ctx`` causally by position
    (the cached rows expanded by :meth:`RefModel.expand`), and updates the residual stream
    ``hs [T, hidden]`` in place."""
    layer = ref.layers[lid]
    full = rows.numel() == hs.shape[0]
    h = hs if full else hs[rows]
    x = layer.input_layernorm(h)
    q, k, v = ref.qkv(layer, x, rows)
    cache.k[lid, rows] = ref.stored(k)
    cache.v[lid, rows] = ref.stored(v)
    keys, values = ref.expand(lid, cache.k[lid, :ctx], cache.v[lid, :ctx])
    o = positional_causal_attention(
        q, keys, values, rows, ref.scale, ref.window[lid], ref.sinks[lid]
    )
    h = ref.finish(layer, h, o.reshape(rows.numel(), -1))
    if full:
        hs.copy_(h)
    else:
        hs[rows] = h


def _mla_rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_pe [n, H, p]`` and ``k_pe [n, 1, p]`` rotated by ``cos``, ``sin`` (``[n, p]``,
    Hugging Face's ``cat(freqs, freqs)``), in SGLang's layout: GPT-J pairs ``(2j, 2j + 1)``
    rotated in place (the same products Hugging Face's interleaved RoPE writes as
    ``cat(evens, odds)``), or neox halves (:func:`~sglang_relay.core.rope.apply_rotation`)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, :half], sin[:, :half]
    return (apply_rotation(q_pe, cos, sin, is_neox=is_neox),
            apply_rotation(k_pe, cos, sin, is_neox=is_neox))  # fmt: skip
