"""Reference executor of the relay semantics on a Hugging Face Llama-family causal LM
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``).

This is the plain, per-request twin of :mod:`sglang_relay.runtime.extend`: the same
layer loop with explicit per-layer active rows, written on the HF modules of the model
(``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, the model's rotary embedding,
``post_attention_layernorm``, ``mlp``) and :func:`positional_causal_attention`. It owns its
KV tensors (one dense ``[L, T, H_kv, D]`` pair per request, row = absolute position) and
never uses HF's cache classes, so both paths can be compared and the relay's fidelity
measured without a server. It imports no sglang.

Pieces:

* :func:`generate` runs requests greedily (batched decode) and returns, per request, an
  :class:`UpstreamRecord`: the output tokens, and for the span tokens (the outputs that
  were fed back, i.e. all but the last sampled token) the decode-phase KV of every layer
  (post-RoPE keys), the residual stream entering every layer and the influence score
  (attention mass received from decode queries) at every layer.
* :func:`relay_prefill` computes a downstream prompt whose span occurrences
  (:class:`SpanOccurrence`) reuse upstream KV under a :class:`RelayConfig` (any of the
  five methods; ``standard`` is the exact full prefill, also :func:`exact_prefill`).
  Optional teacher-forced tokens after the prompt run as normal rows in the same pass,
  which equals prefilling and then extending with them.
* :func:`extend`, :func:`greedy_continue`, :func:`teacher_forced` continue from a prefill.
* :func:`fidelity` compares a method's logits with the exact ones (first-token KL and
  top-1, teacher-forced top-1, free-running greedy prefix and first divergence).

Semantics (identical to the runtime): span rows first get the upstream KV in all layers,
keys re-rotated by ``new_pos - old_pos``. At ``l_start`` (if ``0 < l_start < L`` and the
schedule recomputes anything) their stream is replaced by the stored one; at ``l_det`` (if
``l_det <= l_end``) their fresh K/V are compared with the stored K/V (value or key
deviation), written into that layer, and tokens are selected per span occurrence
(deviation, influence at ``l_det`` if ``tau_inf`` is set, first/last tokens, cap). Active
rows per layer: normal rows, all span rows in ``[l_start, l_det)``, the selected span rows
in ``[l_det, l_end]``. Active rows write their K/V, then attend over all positions, causal
by position. The last prompt token is always a normal row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.nn.functional as F

from sglang_relay.core.attention import attention_probs, positional_causal_attention
from sglang_relay.core.config import RelayConfig
from sglang_relay.core.rope import apply_rotation, delta_cos_sin
from sglang_relay.core.selection import (
    context_mass,
    kv_deviation,
    probe_layers,
    probe_pays,
    probed_mass,
    select_runs,
)

__all__ = [
    "KVCache",
    "RefModel",
    "RelayResult",
    "SpanOccurrence",
    "UpstreamRecord",
    "exact_prefill",
    "extend",
    "fidelity",
    "first_token_kl",
    "generate",
    "greedy_continue",
    "last_row_probe",
    "span_context_mass",
    "load_model",
    "record_context_mass",
    "record_decode_queries",
    "relay_prefill",
    "teacher_forced",
]


# ----------------------------------------------------------------------------- model


class RefModel:
    """Handles on a HF Llama-family causal LM (fp32, eager) used by the reference loop.

    Args:
        model: a ``LlamaForCausalLM`` (or any model with the same module names).
        kv_dtype: the serving engine's KV cache dtype when it differs from the model's
            (``--kv-cache-dtype bf16 / fp8_e4m3 / fp8_e5m2``): every K/V row is rounded to
            it where the engine writes its pool, and read back as the model's dtype, as
            SGLang's unscaled pools do. ``None``: the model's dtype (no rounding).
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
        self.scale = float(self.layers[0].self_attn.scaling)
        self.dtype = self.embed.weight.dtype
        self.kv_dtype = None if kv_dtype in (None, self.dtype) else kv_dtype
        self.device = self.embed.weight.device
        self._cos_sin_cache: torch.Tensor | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own RoPE ``(cos, sin)``, each ``[n, head_dim]``, at ``positions`` ``[n]``
        (rows of a table the rotary module computes once per size; elementwise, so equal to
        what it gives for any batch of positions)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need:
            size = max(need, 2 * (0 if self._rope_table is None else len(self._rope_table[0])))
            size = max(size, 4096)
            dummy = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(dummy, torch.arange(size, device=self.device).view(1, -1))
            self._rope_table = (cos[0], sin[0])
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def cos_sin_cache(self, max_pos: int) -> torch.Tensor:
        """``[>=max_pos, rot_dim]`` cos || sin (half dims), SGLang's layout, from the model's
        rotary module (so its scaling variant is whatever the model uses)."""
        cache = self._cos_sin_cache
        if cache is None or cache.shape[0] < max_pos:
            cos, sin = self.rope(torch.arange(max(max_pos, 1), device=self.device))
            half = cos.shape[-1] // 2
            cache = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float()
            self._cos_sin_cache = cache
        return cache

    def qkv(
        self, layer: Any, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE ``q [n, H_q, D]``, ``k [n, H_kv, D]`` and ``v [n, H_kv, D]`` of normed
        input ``x [n, hidden]`` at ``positions [n]``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = layer.self_attn
        n = x.shape[0]
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, q | k | v
            kv = self.num_kv_heads * self.head_dim
            q, k, v = attn.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.rope(positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    @staticmethod
    def mlp(layer: Any, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s MLP block on rows ``x [n, hidden]``: Hugging Face's sparse MoE
        blocks (``experts``) take ``[batch, seq, hidden]``."""
        if hasattr(layer.mlp, "experts"):
            return layer.mlp(x.unsqueeze(0)).squeeze(0)
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
    """Dense per-request KV by absolute position: ``k``, ``v`` are ``[L, T, H_kv, D]``."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, ref: RefModel, length: int) -> KVCache:
        shape = (ref.num_layers, length, ref.num_kv_heads, ref.head_dim)
        return cls(
            torch.zeros(shape, dtype=ref.dtype, device=ref.device),
            torch.zeros(shape, dtype=ref.dtype, device=ref.device),
        )

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def grown(self, length: int) -> KVCache:
        """A copy with room for ``length`` positions (the first ``self.length`` kept)."""
        if length <= self.length:
            return KVCache(self.k.clone(), self.v.clone())
        pad = (self.k.shape[0], length - self.length, *self.k.shape[2:])
        return KVCache(
            torch.cat((self.k, self.k.new_zeros(pad)), 1),
            torch.cat((self.v, self.v.new_zeros(pad)), 1),
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
    ``cache`` (``[L, T, H_kv, D]``), attends over positions ``< ctx`` causally by position,
    and updates the residual stream ``hs [T, hidden]`` in place."""
    layer = ref.layers[lid]
    full = rows.numel() == hs.shape[0]
    h = hs if full else hs[rows]
    x = layer.input_layernorm(h)
    q, k, v = ref.qkv(layer, x, rows)
    cache.k[lid, rows] = ref.stored(k)
    cache.v[lid, rows] = ref.stored(v)
    o = positional_causal_attention(q, cache.k[lid, :ctx], cache.v[lid, :ctx], rows, ref.scale)
    h = h + layer.self_attn.o_proj(o.reshape(rows.numel(), -1))
    h = h + ref.mlp(layer, layer.post_attention_layernorm(h))
    if full:
        hs.copy_(h)
    else:
        hs[rows] = h


# ----------------------------------------------------------------------------- upstream


@dataclass
class UpstreamRecord:
    """What an upstream request leaves behind for relays.

    Attributes:
        prompt: the prompt token ids ``P_A``.
        output: every sampled token (the last one never got KV).
        k, v: ``[L, n, H_kv, D]`` decode-phase KV of the span tokens ``output[:n]``
            (keys post-RoPE at their upstream positions), ``n = len(output) - 1``.
        hidden: ``[n, L, hidden]`` residual stream entering each layer during decode
            (layer 0: the embedding), or ``None`` when not captured.
        influence: ``[n, L]`` float32 attention mass each span token received at each
            layer from the decode queries (its own and every later fed token), summed over
            query heads: METHOD.md's ``s_inf``, as the runtime accumulates it at ``l_det``.
        context: context masses by layer, filled by :func:`record_context_mass`.
    """

    prompt: list[int]
    output: list[int]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    influence: torch.Tensor | None = None
    context: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def span_tokens(self) -> list[int]:
        """The tokens that have KV: all outputs but the last sampled one."""
        return self.output[:-1]

    @property
    def span_start_pos(self) -> int:
        """Absolute position of the first span token in the upstream request."""
        return len(self.prompt)


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
    probabilities the outputs use.
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
    num_l, hkv, d = ref.num_layers, ref.num_kv_heads, ref.head_dim
    dev = ref.device
    # [L, B, H_kv, T, D]: the layout SDPA wants per layer
    kb = torch.zeros(num_l, bsz, hkv, tmax, d, dtype=ref.dtype, device=dev)
    vb = torch.zeros_like(kb)
    first = []
    for b, prompt in enumerate(prompts):
        res = relay_prefill(ref, prompt, [], None)
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
    group = ref.num_heads // hkv
    base = torch.tensor(lens, device=dev)
    arange_b = torch.arange(bsz, device=dev)
    t_idx = torch.arange(tmax, device=dev)
    for step in range(max_new_tokens - 1):
        done = [
            len(o) >= limit[b] or (force is None and o[-1] in stop_set)
            for b, o in enumerate(outputs)
        ]
        if all(done):
            break
        pos = base + step  # [B] position of the token fed now (output index ``step``)
        visible = (t_idx[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, T]
        live = torch.tensor([not d for d in done], dtype=torch.float32, device=dev)  # [B]
        hs = ref.embed(tok)  # [B, hidden]
        for lid, layer in enumerate(ref.layers):
            if hidden is not None:
                hidden[:, step, lid] = hs
            x = layer.input_layernorm(hs)
            q, k, v = ref.qkv(layer, x, pos)  # q [B, Hq, D], k/v [B, Hkv, D]
            kb[lid, arange_b, :, pos] = ref.stored(k)
            vb[lid, arange_b, :, pos] = ref.stored(v)
            # eager attention with explicit probabilities: [B, H_kv, group, T]
            qg = q.view(bsz, hkv, group, d)
            scores = torch.einsum("bgrd,bgtd->bgrt", qg, kb[lid]) * ref.scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            if influence is not None:  # attention mass each position receives (all heads)
                influence[lid] += probs.sum(dim=(1, 2)).float() * live[:, None]
            o = torch.einsum("bgrt,bgtd->bgrd", probs, vb[lid])
            hs = hs + layer.self_attn.o_proj(o.reshape(bsz, -1))
            hs = hs + ref.mlp(layer, layer.post_attention_layernorm(hs))
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
        records.append(rec)
    return records


def record_context_mass(ref: RefModel, rec: UpstreamRecord, layer: int) -> torch.Tensor:
    """``[n]`` context mass of the span tokens at ``layer`` (:func:`~sglang_relay.core.
    selection.context_mass`): their decode queries (from the stored stream entering
    ``layer``) over the upstream prompt's KV and the span's own, as the runtime computes it
    when it records the span. Cached on the record."""
    if layer not in rec.context:
        q, keys, pos = record_decode_queries(ref, rec, layer)
        rec.context[layer] = context_mass(q, keys, pos, len(rec.prompt), ref.scale)
    return rec.context[layer]


def span_context_mass(ref: RefModel, spans: Sequence[SpanOccurrence], layer: int) -> torch.Tensor:
    """``[S]``: :func:`record_context_mass` of the span occurrences' tokens, in ``spans``'
    order."""
    return torch.cat(
        [
            record_context_mass(ref, s.record, layer)[s.span_start : s.span_start + s.length]
            for s in spans
        ]
    )


def record_decode_queries(
    ref: RefModel, rec: UpstreamRecord, layer: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [n, H_q, D], keys [P + n, H_kv, D], positions [n])`` at ``layer``: the span
    tokens' decode queries rebuilt from the stored stream entering ``layer``, and the keys
    of the upstream prompt and the span they attended to."""
    if rec.hidden is None or rec.k is None:
        raise ValueError("the context mass needs the upstream record's hidden states and KV")
    p, n = len(rec.prompt), rec.k.shape[1]
    prompt = relay_prefill(ref, rec.prompt, [], None).cache
    keys = torch.cat((prompt.k[layer, :p], rec.k[layer]))
    pos = torch.arange(p, p + n, device=ref.device)
    lyr = ref.layers[layer]
    q, _, _ = ref.qkv(lyr, lyr.input_layernorm(rec.hidden[:, layer].to(ref.dtype)), pos)
    return q, keys, pos


# ----------------------------------------------------------------------------- downstream


@dataclass(frozen=True)
class SpanOccurrence:
    """``prompt[prompt_start : prompt_start + length]`` reuses
    ``record.span_tokens[span_start : span_start + length]``."""

    prompt_start: int
    record: UpstreamRecord
    span_start: int
    length: int


@dataclass
class RelayResult:
    """Outcome of :func:`relay_prefill`.

    Attributes:
        logits: ``[1 + m, vocab]`` float32: the last prompt row, then one row per forced token.
        cache: final KV of the prompt and the forced tokens, ``[L, T + m, H_kv, D]``.
        prompt_len: ``T``.
        span_lengths, selected: per span occurrence (prompt order), tokens and selected ones.
        reuse_rate: METHOD.md's token-layer reuse over all spans (0 for standard).
        deviation: ``[S]`` detection scores over the span tokens in prompt order,
            ``S = sum(span_lengths)`` (``None`` if none computed).
        selected_mask: ``[S]`` bool, the span tokens selected at ``l_det``.
        hidden: ``[L, T + m, hidden]`` stream entering each layer if captured.
    """

    logits: torch.Tensor
    cache: KVCache
    prompt_len: int
    span_lengths: list[int] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)
    reuse_rate: float = 0.0
    deviation: torch.Tensor | None = None
    selected_mask: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def recomputed_fraction(self) -> float:
        """Recomputed span token-layers over all span token-layers (``1 - reuse``)."""
        return 1.0 - self.reuse_rate if self.span_lengths else 0.0

    @property
    def selected_fraction(self) -> float:
        """Selected span tokens over all span tokens."""
        total = sum(self.span_lengths)
        return sum(self.selected) / total if total else 0.0


def _check_spans(prompt: Sequence[int], spans: Sequence[SpanOccurrence]) -> None:
    end = 0
    for s in spans:
        if s.length <= 0 or s.prompt_start < end:
            raise ValueError("span occurrences must be non-empty, sorted and non-overlapping")
        if s.prompt_start + s.length > len(prompt) - 1:
            raise ValueError("the last prompt token must not be part of a span")
        if s.record.k is None or s.span_start + s.length > s.record.k.shape[1]:
            raise ValueError("span occurrence exceeds the upstream record's KV")
        want = s.record.span_tokens[s.span_start : s.span_start + s.length]
        if list(prompt[s.prompt_start : s.prompt_start + s.length]) != list(want):
            raise ValueError(f"prompt tokens at {s.prompt_start} differ from the span tokens")
        end = s.prompt_start + s.length


@torch.no_grad()
def relay_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    spans: Sequence[SpanOccurrence],
    cfg: RelayConfig | None,
    *,
    forced: Sequence[int] = (),
    capture_hidden: bool = False,
    selection: torch.Tensor | None = None,
) -> RelayResult:
    """Prefill ``prompt`` (``T`` tokens) reusing upstream KV for ``spans`` under ``cfg``.

    ``cfg`` ``None`` or method ``standard``: exact full prefill (spans ignored). ``forced``
    tokens (``m``) follow the prompt as normal rows, all layers, in the same pass; that
    equals a prefill followed by an extend with them (the cache at each layer is final
    once that layer ran). ``selection`` (``[S]`` bool over the span tokens in prompt
    order) replaces the rule's choice at ``l_det`` (oracle studies); the detection still
    runs and writes its fresh K/V. See the module docstring for the semantics.
    """
    spans = sorted(spans, key=lambda s: s.prompt_start)
    use_spans = cfg is not None and cfg.method != "standard" and len(spans) > 0
    if use_spans:
        _check_spans(prompt, spans)
    ids = list(prompt) + list(forced)
    total = len(ids)
    num_l = ref.num_layers
    dev = ref.device
    cache = KVCache.empty(ref, total)
    hs = ref.embed(torch.tensor(ids, dtype=torch.long, device=dev))  # [T + m, hidden]
    hidden = torch.empty(num_l, total, ref.hidden_size, dtype=ref.dtype) if capture_hidden else None
    all_rows = torch.arange(total, device=dev)
    result = RelayResult(logits=torch.empty(0), cache=cache, prompt_len=len(prompt))

    if not use_spans:
        for lid in range(num_l):
            if hidden is not None:
                hidden[lid] = hs
            _run_layer(ref, lid, hs, all_rows, cache, total)
        result.logits = ref.logits(hs[len(prompt) - 1 :])
        result.hidden = hidden
        return result

    assert cfg is not None
    sched = cfg.schedule(num_l)
    span_rows = _span_rows(spans, dev)  # [S] ascending
    bounds = [0]
    for s in spans:
        bounds.append(bounds[-1] + s.length)
    normal = torch.ones(total, dtype=torch.bool, device=dev)
    normal[span_rows] = False
    normal_rows = all_rows[normal]

    _splice(ref, cache, spans, span_rows)
    probing = probe_pays(cfg, span_rows.numel())  # the last-row probe runs (cfg.probe)

    selected_rows = span_rows[:0]
    counts = [0] * len(spans)
    for lid in range(num_l):
        if lid == sched.l_start and lid > 0 and sched.needs_hidden():
            stored = [s.record.hidden for s in spans]
            if any(h is None for h in stored):
                raise ValueError("this schedule needs the upstream hidden states")
            hs[span_rows] = torch.cat(
                [s.record.hidden[s.span_start : s.span_start + s.length, lid] for s in spans]
            ).to(hs.dtype)
        if lid == sched.l_det and sched.l_det <= sched.l_end:
            infl = _influence(spans, lid) if cfg.tau_inf is not None else None
            if cfg.ranks_context:
                ctx = span_context_mass(ref, spans, cfg.context_layer(num_l))
            else:
                ctx = None
            if probing:
                att = last_row_probe(ref, prompt, spans)[list(probe_layers(num_l))].mean(0)
                ctx = probed_mass(ctx, att, cfg.probe)
            mask, counts, result.deviation = _detect(
                ref, cfg, lid, hs, span_rows, bounds, cache, infl, ctx, reserve=int(probing)
            )
            if selection is not None:
                _check_selection(selection, span_rows.numel())
                mask = selection.to(mask.device)
                counts = [int(mask[lo:hi].sum()) for lo, hi in pairwise(bounds)]
            selected_rows = span_rows[mask]
            result.selected_mask = mask
        if hidden is not None:
            hidden[lid] = hs
        parts = [normal_rows]
        if sched.l_start <= lid < sched.l_det:
            parts.append(span_rows)
        elif sched.l_det <= lid <= sched.l_end:
            parts.append(selected_rows)
        rows = torch.cat(parts).sort().values
        _run_layer(ref, lid, hs, rows, cache, total)

    recomputed = sum(
        n * sched.dense_layers + c * sched.sparse_layers
        for n, c in zip([s.length for s in spans], counts, strict=True)
    )
    if probing:  # the probe's row, charged to the request's cap
        recomputed += num_l
    span_total = sum(s.length for s in spans)
    result.logits = ref.logits(hs[len(prompt) - 1 :])
    result.span_lengths = [s.length for s in spans]
    result.selected = counts
    result.reuse_rate = 1.0 - recomputed / (span_total * num_l)
    result.hidden = hidden
    return result


@torch.no_grad()
def last_row_probe(
    ref: RefModel, prompt: Sequence[int], spans: Sequence[SpanOccurrence], *, heads: bool = False
) -> torch.Tensor:
    """``[L, S]``: the attention (mean over query heads) the last prompt row gives each span
    token (prompt order) in a *probe* pass, in every layer: the span KV spliced as is, and
    only the rows before the first span (their KV does not depend on the spans, so it is
    final) and the last prompt row computed; the rows between are left out of the probe's
    attention (``cfg.probe``). ``heads``: ``[L, H_q, S]``, per query head (studies)."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    span_rows = _span_rows(spans, ref.device)
    total = len(prompt)
    if int(span_rows.max()) >= total - 1:
        raise ValueError("the last prompt row must come after the spans")
    cache = KVCache.empty(ref, total)
    _splice(ref, cache, spans, span_rows)
    dev = ref.device
    first = int(span_rows.min())
    rows = torch.cat([torch.arange(first, device=dev), torch.tensor([total - 1], device=dev)])
    known = torch.zeros(total, dtype=torch.bool, device=dev)
    known[span_rows] = known[rows] = True
    visible = (torch.arange(total, device=dev)[None, :] <= rows[:, None]) & known[None, :]
    h = ref.embed(torch.tensor(list(prompt), dtype=torch.long, device=dev)[rows])
    out = []
    for lid, layer in enumerate(ref.layers):
        q, k, v = ref.qkv(layer, layer.input_layernorm(h), rows)
        cache.k[lid, rows], cache.v[lid, rows] = ref.stored(k), ref.stored(v)
        probs = attention_probs(q, cache.k[lid], visible, ref.scale)  # [n, G, R, T]
        last = probs[-1][..., span_rows]  # [G, R, S]
        out.append(last.reshape(-1, span_rows.numel()) if heads else last.mean((0, 1)))
        o = torch.einsum("ngrt,tgd->ngrd", probs, cache.v[lid]).reshape(rows.numel(), -1)
        h = h + layer.self_attn.o_proj(o)
        h = h + ref.mlp(layer, layer.post_attention_layernorm(h))
    return torch.stack(out)


def _check_selection(selection: torch.Tensor, n: int) -> None:
    if selection.dtype != torch.bool or selection.shape != (n,):
        raise ValueError(f"selection must be a bool tensor of shape [{n}] (the span tokens)")


def _span_rows(spans: Sequence[SpanOccurrence], device: torch.device) -> torch.Tensor:
    return torch.cat(
        [torch.arange(s.prompt_start, s.prompt_start + s.length, device=device) for s in spans]
    )


def _upstream_kv(spans: Sequence[SpanOccurrence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode-phase ``(K, V)`` ``[L, S, H_kv, D]`` of ``spans``, concatenated in order."""
    k = torch.cat([s.record.k[:, s.span_start : s.span_start + s.length] for s in spans], 1)
    v = torch.cat([s.record.v[:, s.span_start : s.span_start + s.length] for s in spans], 1)
    return k, v


def _splice(
    ref: RefModel, cache: KVCache, spans: Sequence[SpanOccurrence], span_rows: torch.Tensor
) -> None:
    """Upstream KV of ``spans`` (prompt order) into ``cache`` at ``span_rows`` in every
    layer, keys re-rotated by new - old position."""
    src_k, src_v = _upstream_kv(spans)
    old_pos = torch.cat(
        [
            s.record.span_start_pos + torch.arange(s.span_start, s.span_start + s.length)
            for s in spans
        ]
    ).to(span_rows.device)
    delta = span_rows - old_pos
    cos, sin = delta_cos_sin(ref.cos_sin_cache(int(delta.abs().max()) + 1), delta)
    for lid in range(ref.num_layers):
        # stored keys rotated in float32, then rounded once more into the engine's pool
        cache.k[lid, span_rows] = ref.stored(apply_rotation(src_k[lid], cos, sin, is_neox=True))
        cache.v[lid, span_rows] = src_v[lid]


def true_value_deviation(
    ref: RefModel,
    spans: Sequence[SpanOccurrence],
    exact: RelayResult,
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """``[S]`` per span token (prompt order): value deviation of the reused upstream KV from
    the exact prefill's, averaged over ``layers`` (default: all). The ground truth a
    detector approximates."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    rows = _span_rows(spans, ref.device)
    _, src_v = _upstream_kv(spans)
    layers = range(ref.num_layers) if layers is None else layers
    return torch.stack([kv_deviation(src_v[lid], exact.cache.v[lid, rows]) for lid in layers]).mean(
        0
    )


def exact_kv_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    spans: Sequence[SpanOccurrence],
    exact: RelayResult,
    selection: torch.Tensor,
    *,
    forced: Sequence[int] = (),
) -> RelayResult:
    """Oracle: the spliced upstream KV, except the ``selection`` (``[S]`` bool, span tokens
    in prompt order) whose KV is the exact prefill's in every layer; only the non-span rows
    are computed. ``exact``: :func:`exact_prefill` of the same prompt and ``forced``.
    Reports the reuse of recomputing the selected tokens in every layer."""
    spans = sorted(spans, key=lambda s: s.prompt_start)
    _check_spans(prompt, spans)
    ids = list(prompt) + list(forced)
    total = len(ids)
    if exact.cache.length != total:
        raise ValueError("exact must be the exact prefill of the same prompt and forced tokens")
    cache = KVCache.empty(ref, total)
    hs = ref.embed(torch.tensor(ids, dtype=torch.long, device=ref.device))
    span_rows = _span_rows(spans, ref.device)
    _check_selection(selection, span_rows.numel())
    _splice(ref, cache, spans, span_rows)
    rows = span_rows[selection.to(span_rows.device)]
    cache.k[:, rows] = exact.cache.k[:, rows]
    cache.v[:, rows] = exact.cache.v[:, rows]
    normal = torch.ones(total, dtype=torch.bool, device=ref.device)
    normal[span_rows] = False
    normal_rows = torch.arange(total, device=ref.device)[normal]
    for lid in range(ref.num_layers):
        _run_layer(ref, lid, hs, normal_rows, cache, total)
    result = RelayResult(
        logits=ref.logits(hs[len(prompt) - 1 :]), cache=cache, prompt_len=len(prompt)
    )
    result.span_lengths = [s.length for s in spans]
    result.selected_mask = selection
    bounds = [0, *accumulate(result.span_lengths)]
    result.selected = [int(selection[lo:hi].sum()) for lo, hi in pairwise(bounds)]
    result.reuse_rate = 1.0 - float(selection.sum()) / span_rows.numel()
    return result


def _influence(spans: Sequence[SpanOccurrence], lid: int) -> torch.Tensor | None:
    """``[S]`` influence at layer ``lid`` of the span tokens (``None`` if any span has none;
    then selection ignores influence, as the runtime does without scores)."""
    if any(s.record.influence is None for s in spans):
        return None
    return torch.cat(
        [s.record.influence[s.span_start : s.span_start + s.length, lid] for s in spans]
    )


def _detect(
    ref: RefModel,
    cfg: RelayConfig,
    lid: int,
    hs: torch.Tensor,
    span_rows: torch.Tensor,
    bounds: list[int],
    cache: KVCache,
    influence: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
    *,
    reserve: int = 0,
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Detection at ``l_det``: deviation of fresh vs stored K/V of the span rows (``[S]``),
    fresh K/V written into layer ``lid``, selection per span occurrence (``bounds``: segment
    offsets into ``span_rows``; ``influence``: ``[S]`` scores or ``None``). With
    ``signal="context"`` the ``[S]`` recorded ``context`` masses rank instead (no pass).
    ``reserve``: tokens of the cap spent on the probe row.
    Returns the ``[S]`` selection mask, counts per span and the scores."""
    deviation = context
    if cfg.detects:
        x = ref.layers[lid].input_layernorm(hs[span_rows])
        _, k, v = ref.qkv(ref.layers[lid], x, span_rows)
        if cfg.signal == "key":
            deviation = kv_deviation(k, cache.k[lid, span_rows])
        else:
            deviation = kv_deviation(v, cache.v[lid, span_rows])
        cache.k[lid, span_rows] = ref.stored(k)
        cache.v[lid, span_rows] = ref.stored(v)
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    masks = select_runs(cfg, lengths, deviation, influence, reserve=reserve)
    keep = [m.to(span_rows.device) for m in masks]
    return torch.cat(keep), [int(m.sum()) for m in keep], deviation


def exact_prefill(
    ref: RefModel,
    prompt: Sequence[int],
    *,
    forced: Sequence[int] = (),
    capture_hidden: bool = False,
) -> RelayResult:
    """The exact full prefill (every row, every layer); ``forced`` as in :func:`relay_prefill`."""
    return relay_prefill(ref, prompt, [], None, forced=forced, capture_hidden=capture_hidden)


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
