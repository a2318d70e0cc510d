"""The one object through which relay's own forwards drive the served decoder stack.

Plain forwards are SGLang's (:mod:`.decode`). Three relay paths run SGLang's modules in an
order of their own: the relay extend (:class:`.extend.ExtendPlan`, with its detection
step), the last-row probe (:class:`.probe.ProbePlan`) and the context masses of a finished
output (:func:`span_context`). The first two are a :class:`LayerPlan` each, run by the one
layer loop, :meth:`LayerDriver.run`. They reach the model only through a
:class:`LayerDriver`, whose small interface says what they do with it:

* ``embed(ids)`` / ``final_norm(h, r)``: the stack's ends;
* ``norm_in(l, h, r)``: layer ``l``'s input norm, ``(x, h + r)`` (``r`` None: the first
  layer, or a stored stream that already is the residual);
* ``qkv(l, positions, x)``: post-RoPE (and post q/k-norm) q, k, v of layer ``l``;
* ``layer(l, positions, h, r, fb, attend)``: the whole layer on the given rows, with the
  caller's attention (``attend(q, k, v)``); returns ``(h, r)``;
* ``run(plan, stream, fb)``: every layer on the rows a :class:`LayerPlan` says;
* ``heads(l)``, ``kv(l)``, ``write_kv(l, loc, k, v)``: layer ``l``'s attention geometry and
  KV buffers;
* ``splice(src, dst, delta)``: every layer's KV of ``src`` slots copied to ``dst`` with
  keys re-rotated by ``delta`` positions, each layer with its own RoPE table (one for the
  whole stack, or Gemma 3's local and global ones).

Which SGLang behaviour this reproduces by hand, and the SGLang function each piece
mirrors: docs/architecture.md ("What relay runs itself"). The per-architecture parts (q/k/v
preparation, MLP block) are bound per layer when the driver is built, from the
architecture's adapter (:mod:`.anatomy`); the start-up check has verified the model has
what the adapter names, and that the SGLang functions this driver mirrors are the ones it
was verified on (:mod:`.sglang.mirrors`). No state per batch: rows, positions and LoRA info
stay with the plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglang_relay.core.rope import delta_cos_sin
from sglang_relay.core.selection import context_mass
from sglang_relay.runtime.forward.lora_rows import base_only, installed
from sglang_relay.runtime.forward.scratch import head_maxima
from sglang_relay.runtime.models.anatomy import (
    Anatomy,
    gemma3_qkv,
    mla_out,
    mla_qkv,
    mlp_output,
    mlp_takes_batch,
    model_rope,
    native_prepare,
    radix_of,
    rotation_table,
    sinks_of,
    split_qkv,
)
from sglang_relay.runtime.sglang.model import (
    attention_window,
    finish_row_parallel,
    kv_write_loc,
)
from sglang_relay_kernels import gather_rows, scatter_rows, splice_rerotate

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Heads:
    """One layer's attention geometry on this rank (SGLang's ``RadixAttention``)."""

    q: int  # query heads
    kv: int  # key heads
    v: int  # value heads
    d: int  # qk head dim
    dv: int  # v head dim
    scale: float
    layer_id: int  # the KV pool's layer index
    window: int = 0  # keys a row sees, itself included (0: no sliding window)
    # this rank's ``[q]`` sink logits (gpt-oss; SGLang's parameter, bf16 or fp32, read
    # live), None: no sinks
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def of(cls, radix_attn, sinks: torch.Tensor | None = None) -> Heads:
        return cls(
            radix_attn.tp_q_head_num,
            radix_attn.tp_k_head_num,
            radix_attn.tp_v_head_num,
            radix_attn.qk_head_dim,
            radix_attn.v_head_dim,
            radix_attn.scaling,
            radix_attn.layer_id,
            attention_window(radix_attn),
            None if sinks is None else sinks.detach(),  # live: read at each use
        )


@dataclass(frozen=True, slots=True)
class RopeGroup:
    """Layers whose keys turn with one RoPE table: ``delta_cos_sin(delta)`` gives the
    float32 ``(cos, sin)`` of each row's shift (``[N, rot_dim // 2]`` each). ``latent``: the
    pool rows are MLA latent rows of ``latent`` values before the rotated ones (0: the
    rotated dims lead each key head)."""

    layers: tuple[int, ...]
    delta_cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    is_neox: bool
    latent: int = 0


def rope_groups(model, layers, gemma3: bool) -> tuple[RopeGroup, ...]:
    """One group for the whole stack (SGLang's rotary module of layer 0, its float32 table:
    :func:`.anatomy.rotation_table`), or Gemma 3's two (the model's local and global
    tables, the module a layer uses in :func:`.anatomy.model_rope`)."""
    if not gemma3:
        attn = layers[0].self_attn
        rope = attn.rotary_emb
        table = lambda delta: delta_cos_sin(rotation_table(rope), delta)  # noqa: E731
        latent = getattr(attn, "kv_lora_rank", 0) if hasattr(attn, "attn_mqa") else 0
        return (RopeGroup(tuple(range(len(layers))), table, bool(rope.is_neox_style), latent),)
    groups: dict[int, list[int]] = {}
    modules = {}
    for lid, layer in enumerate(layers):
        rope = model_rope(model, layer.self_attn)
        groups.setdefault(id(rope), []).append(lid)
        modules[id(rope)] = rope
    return tuple(
        RopeGroup(tuple(lids), _angle_rotation(modules[key].inv_freq), True)
        for key, lids in groups.items()
    )


def _angle_rotation(inv_freq: torch.Tensor):
    """``delta -> (cos, sin)`` of ``delta * inv_freq`` computed in float64 (Gemma 3's
    model-level tables are computed per forward, not kept: no table to index; any
    attention scaling multiplies a key once, at its first rotation, not at a shift)."""
    freq = inv_freq.detach().double()

    def rotation(delta: torch.Tensor):
        angle = delta.to(freq.device).double()[:, None] * freq[None, :]
        return angle.cos().float(), angle.sin().float()

    return rotation


def stream(h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """The residual stream entering a layer, from its ``(h, r)`` pair."""
    return h if r is None else h + r


@dataclass(slots=True)
class Stream:
    """The residual stream of the rows a relay forward computes: ``h`` ``[rows, H]`` and
    ``r`` (same shape; None until some layer ran: a layer's input norm then starts it)."""

    h: torch.Tensor
    r: torch.Tensor | None = None

    def residual(self) -> torch.Tensor:
        """``r``, zeros where no layer ran yet."""
        if self.r is None:
            self.r = torch.zeros_like(self.h)
        return self.r


# a row set's attention: (layer, its heads, q [n, q_heads, d], key and value buffers) ->
# [n, q_heads, dv]; the rows' own K/V are in the buffers already
RowAttention = Callable[[int, "Heads", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class RowSet:
    """The rows that run one layer of a relay forward.

    Attributes:
        index: ``[n]`` int64 rows of the :class:`Stream`, ascending.
        positions: ``[n]`` their token positions.
        loc: ``[n]`` the KV slots their fresh K/V is written to.
        attention: what their queries attend (:data:`RowAttention`).
        lora: SGLang's LoRA batch info of these rows (None: no LoRA in this forward).
    """

    index: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor
    attention: RowAttention
    lora: Any = None


class LayerPlan(ABC):
    """What one relay forward does with the stack, layer by layer: which rows run each
    layer and what happens at its entry (a stored hidden row injected into the stream, the
    stream stored for later forwards, fresh K/V observed for detection).

    :meth:`LayerDriver.run` calls :meth:`enter` once per layer, in order; a plan may decide
    later layers' rows from what it observed at earlier ones (the detection layer's
    selection). A plan that returns the same :class:`RowSet` object for consecutive layers
    lets the driver keep those rows' stream compact between them (see :meth:`LayerDriver.run`);
    :meth:`uses_stream` says at which layers its entry reads or writes the stream."""

    lora_backend: Any = None  # SGLang's LoRA backend on a LoRA server

    @abstractmethod
    def enter(self, lid: int, stream: Stream) -> RowSet | None:
        """Layer ``lid``'s entry events applied to ``stream``; the rows that run the layer
        (None: no row does)."""

    def uses_stream(self, lid: int) -> bool:
        """Whether :meth:`enter` at layer ``lid`` reads or writes ``stream`` (the driver then
        brings it up to date first). The default, every layer, is always right."""
        return True


def _settle(stream: Stream, live: tuple[RowSet, torch.Tensor, torch.Tensor]) -> None:
    """A row set's compact ``(h, r)`` scattered back into ``stream``."""
    rows, h, r = live
    scatter_rows(stream.h, rows.index, h)
    scatter_rows(stream.residual(), rows.index, r)


class LayerDriver:
    """Relay's view of one served decoder stack (``model.{embed_tokens, layers, norm}``)
    and its KV pool. Built once per relay runtime."""

    stream = staticmethod(stream)

    def __init__(self, model, kv_pool, anatomy: Anatomy) -> None:
        self.model = model
        self.pool = kv_pool
        self.layers = list(model.layers)
        self.num_layers = len(self.layers)
        self._radix = tuple(radix_of(layer.self_attn) for layer in self.layers)
        self._heads = tuple(
            Heads.of(radix, sinks_of(layer.self_attn, anatomy))
            for radix, layer in zip(self._radix, self.layers, strict=True)
        )
        self.head_max = head_maxima(self._heads)  # what relay's scratch is sized by
        native = anatomy.prepare == "native"
        self._prepare = tuple(
            native_prepare(layer.self_attn) if native else None for layer in self.layers
        )
        self._qk_across = anatomy.qk_norm == "across_heads"
        self._gemma3 = anatomy.prepare == "gemma3"
        self._mla = anatomy.prepare == "mla"
        self._sandwich = anatomy.norms == "sandwich"
        self._rope_groups = rope_groups(model, self.layers, self._gemma3)
        self._mlp = tuple(getattr(layer, anatomy.mlp_name) for layer in self.layers)
        self._mlp_out = tuple(mlp_output(block) for block in self._mlp)
        self._mlp_batch = tuple(mlp_takes_batch(block) for block in self._mlp)

    # ---- the stack's ends ----------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def final_norm(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        out, _ = self.model.norm(h, r)
        return out

    # ---- one layer -----------------------------------------------------------------------
    def norm_in(self, l: int, h: torch.Tensor, r: torch.Tensor | None):  # noqa: E741
        """Layer ``l``'s input norm: ``(x, h + r)``; ``r`` None: ``(norm(h), h)``."""
        norm = self.layers[l].input_layernorm
        if r is None:
            return norm(h), h
        return norm(h, r)

    def qkv(self, l: int, positions: torch.Tensor, x: torch.Tensor):  # noqa: E741
        """Post-RoPE q, k, v (flat ``[n, heads * dim]``) of layer ``l`` for normed ``x``:
        SGLang's own ``forward_prepare_native`` where the adapter says the block has one,
        else its unfused sequence (:func:`.anatomy.split_qkv`)."""
        prepare = self._prepare[l]
        if prepare is not None:
            return prepare(positions, x)
        if self._gemma3:
            return gemma3_qkv(self.model, self.layers[l].self_attn, positions, x)
        if self._mla:
            return mla_qkv(self.layers[l].self_attn, positions, x)
        return split_qkv(self.layers[l].self_attn, positions, x, self._qk_across)

    def mlp(self, l: int, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:  # noqa: E741
        """Layer ``l``'s MLP block (SGLang's, called whole) on rows ``x``, TP-summed."""
        block = self._mlp[l]
        out = block(x, forward_batch=fb) if self._mlp_batch[l] else block(x)
        return finish_row_parallel(self._mlp_out[l], out)

    def layer(self, l: int, positions, h, r, fb: ForwardBatch, attend: Attend):  # noqa: E741
        """Layer ``l`` on the given rows (``r`` None: no residual yet); ``attend(q, k, v)``
        does the attention. ``h`` and ``r`` must be the caller's own row copies (SGLang's
        norms may write in place). Returns ``(h, r)``."""
        attn = self.layers[l].self_attn
        x, r = self.norm_in(l, h, r)
        o = attend(*self.qkv(l, positions, x))
        if self._mla:  # the latent-space output through w_vc
            o = mla_out(attn, o)
        h, _ = attn.o_proj(o)
        h = finish_row_parallel(attn.o_proj, h)
        layer = self.layers[l]
        if self._sandwich:  # Gemma 3: normed attention output, then the residual added
            x, r = layer.pre_feedforward_layernorm(layer.post_attention_layernorm(h), r)
            return layer.post_feedforward_layernorm(self.mlp(l, x, fb)), r
        x, r = layer.post_attention_layernorm(h, r)
        return self.mlp(l, x, fb), r

    def run(self, plan: LayerPlan, stream: Stream, fb: ForwardBatch) -> Stream:
        """The one loop of every relay forward: each layer on the rows ``plan`` says, their
        fresh K/V written to their slots, then their attention. The rows' ``(h, r)`` are
        gathered from ``stream`` when a row set starts and stay compact while the plan
        returns the same :class:`RowSet` (one gather and one scatter per row set, not per
        layer); they are scattered back into ``stream`` when the row set changes, before an
        entry that uses the stream (:meth:`LayerPlan.uses_stream`) and at the end."""
        live: tuple[RowSet, torch.Tensor, torch.Tensor] | None = None  # not yet in ``stream``
        for lid in range(self.num_layers):
            if live is not None and plan.uses_stream(lid):
                _settle(stream, live)
                live = None
            rows = plan.enter(lid, stream)
            if live is not None and rows is not live[0]:  # another row set from here on
                _settle(stream, live)
                live = None
            if rows is None:
                continue
            hd = self._heads[lid]

            def attend(q, k, v, lid=lid, hd=hd, rows=rows):
                self.write_kv(lid, rows.loc, k, v)
                kbuf, vbuf = self.kv(lid)
                out = rows.attention(lid, hd, q.reshape(-1, hd.q, hd.d), kbuf, vbuf)
                return out.reshape(q.shape[0], -1)

            if live is None:  # gather: Triton on CUDA, plain indexing elsewhere
                h = gather_rows(stream.h, rows.index)
                r = None if stream.r is None else gather_rows(stream.r, rows.index)
            else:
                _, h, r = live
            with installed(plan.lora_backend, rows.lora):
                h, r = self.layer(lid, rows.positions, h, r, fb, attend)
            live = (rows, h, r)
        if live is not None:
            _settle(stream, live)
        return stream

    # ---- KV --------------------------------------------------------------------------------
    def heads(self, l: int) -> Heads:  # noqa: E741
        return self._heads[l]

    def kv(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """Layer ``l``'s key and value buffers, fetched per call (the pool may be resized
        after start-up)."""
        lid = self._heads[l].layer_id
        return self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid)

    def write_kv(self, l: int, loc, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: E741
        """Write flat ``k`` / ``v`` rows into the pool slots ``loc`` of layer ``l``."""
        hd = self._heads[l]
        k = k.reshape(-1, hd.kv, hd.d)
        v = v.reshape(-1, hd.v, hd.dv)
        self.pool.set_kv_buffer(self._radix[l], kv_write_loc(loc), k, v)

    def splice(self, src, dst, delta: torch.Tensor) -> None:
        """Every layer's KV of slots ``src`` copied into ``dst``, keys rotated by ``delta``
        positions with their layers' table (Triton on CUDA, the torch reference
        elsewhere). An MLA row (one buffer: the latent, then the rotated part) goes through
        two views of it: the rotated part as the keys, the latent as the values (copied
        bit-identical)."""
        for group in self._rope_groups:
            cos, sin = group.delta_cos_sin(delta)
            ids = [self._heads[lid].layer_id for lid in group.layers]
            keys = [self.pool.get_key_buffer(i) for i in ids]
            values = [self.pool.get_value_buffer(i) for i in ids]
            if group.latent:
                values = [k[..., : group.latent] for k in keys]
                keys = [k[..., group.latent :] for k in keys]
            splice_rerotate(
                keys,
                values,
                src,
                dst,
                cos,
                sin,
                is_neox=group.is_neox,
            )


def span_context(
    driver: LayerDriver,
    stored: torch.Tensor | None,
    lid: int,
    lora,
    row: torch.Tensor,
    prompt_len: int,
    tokens: list[int],
    answer_start: int = 0,
) -> torch.Tensor:
    """``[n]`` context masses of a finished request's output tokens ``tokens`` (slots
    ``row[prompt_len : prompt_len + n]``, prompt slots before them): each token's decode
    query at layer ``lid``, rebuilt from the stream stored entering it (``stored``, indexed
    by slot; the embedding at layer 0), over the row's keys, mass on prompt positions
    ``1..prompt_len-1`` (:func:`~sglang_relay.core.selection.context_mass`). The answer of
    a reasoning output (tokens from ``answer_start``) counts its reasoning as context too:
    a paste of the answer alone replaces both. Runs outside any batch, so on the base
    weights of a LoRA server (``lora``: SGLang's LoRA backend or None). Under tensor
    parallelism each rank averages its own heads; selection averages the ranks."""
    hd = driver.heads(lid)
    n = len(tokens)
    kbuf = driver.kv(lid)[0]
    device = kbuf.device
    slots = row[: prompt_len + n].to(device=device, dtype=torch.int64)
    if lid == 0:
        h = driver.embed(torch.tensor(tokens, dtype=torch.int64, device=device))
    else:
        h = stored[slots[prompt_len:]]  # the stored stream is the residual
    pos = torch.arange(prompt_len, prompt_len + n, device=device)
    with base_only(lora):  # outside any batch: no row-to-adapter info applies
        q, _, _ = driver.qkv(lid, pos, driver.norm_in(lid, h, None)[0])
    keys = kbuf[slots]
    q = q.reshape(n, hd.q, hd.d)
    keys = keys.reshape(prompt_len + n, hd.kv, hd.d)
    shape = {"window": hd.window, "sinks": hd.sinks}
    if answer_start <= 0:
        return context_mass(q, keys, pos, prompt_len, hd.scale, **shape)
    a = answer_start
    return torch.cat(
        (
            context_mass(q[:a], keys, pos[:a], prompt_len, hd.scale, **shape),
            context_mass(q[a:], keys, pos[a:], prompt_len + a, hd.scale, **shape),
        )
    )
