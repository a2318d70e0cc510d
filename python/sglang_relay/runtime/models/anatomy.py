"""What an architecture adapter is (one file each in :mod:`sglang_relay.runtime.models.adapters`,
looked up through :mod:`.registry`), and the check that a served model has exactly the
modules its adapter drives.

The relay loops (:mod:`sglang_relay.runtime.forward`: extend, probe, decode) run a decoder layer as
SGLang's own modules in SGLang's order: ``input_layernorm``, the attention block's own
q/k/v preparation (``forward_prepare_native``: projection, any per-head q/k norm, RoPE),
attention (relay's, over the request's KV), ``o_proj``, ``post_attention_layernorm``,
``mlp``. Only the attention kernel is relay's. What an architecture adds inside its
attention block therefore comes with SGLang's module, and what the loop would not run
(a module the adapter does not list, a logit cap, a sliding window, KV scales) refuses
the server at start-up instead of being dropped silently. Partial rotary is served: only a
key's rotary dims move with its position.

Pure data plus checks on live modules; SGLang's dotted names live in
:mod:`sglang_relay.runtime.sglang` and the adapters (their forward targets, gathered here
as ``registry.MODEL_FORWARD_TARGETS``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

# the layer modules every adapter's loop calls besides its MLP block (boundaries are plain
# objects, not modules)
LAYER_MODULES = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm"})
# Gemma 3's two more norms: around the MLP, the residual added in the first
SANDWICH_NORMS = frozenset({"pre_feedforward_layernorm", "post_feedforward_layernorm"})
BASE_ATTENTION = frozenset({"qkv_proj", "o_proj", "rotary_emb", "attn"})
# the MLP block's children: a dense gated MLP (its row-parallel ``down_proj`` ends it), a
# sparse mixture of experts (router ``gate``, SGLang's ``topk`` and fused ``experts``), or
# one with a gated shared expert beside the routed ones (Qwen2-MoE); the loop calls the
# block whole, so what it sums comes with SGLang's module
DENSE_MLP = frozenset({"gate_up_proj", "down_proj", "act_fn"})
SPARSE_MLP = frozenset({"gate", "topk", "experts"})
SHARED_EXPERT_MLP = SPARSE_MLP | {"shared_expert", "shared_expert_gate"}
# the name a layer's MLP block goes by (Mixtral: ``block_sparse_moe``)
MLP_NAMES = ("mlp", "block_sparse_moe")


@dataclass(frozen=True, slots=True)
class Anatomy:
    """How the relay loop drives one architecture's SGLang decoder.

    Attributes:
        architecture: the Hugging Face ``architectures`` name SGLang serves it under.
        model_forward: the dotted ``forward`` of its decoder stack (the hook target).
        attention_modules: every child module of a layer's ``self_attn`` the q/k/v
            preparation uses; a model with any other is refused.
        prepare: ``"native"``: SGLang's own ``self_attn.forward_prepare_native(positions,
            x)`` gives post-RoPE q, k, v; ``"split"``: the block has no such method (or
            one that takes the forward batch and may write the KV cache itself, as
            Qwen3-MoE's fused q/k-norm + RoPE + KV-store path does on CUDA) and the loop
            runs SGLang's unfused sequence: ``qkv_proj`` -> split -> SGLang's
            ``apply_qk_norm`` where the block has ``q_norm`` / ``k_norm`` ->
            ``rotary_emb`` (Qwen2, Qwen3-MoE); ``"gemma3"``: Gemma 3's sequence, ``qkv_proj``
            -> split -> per-head ``q_norm`` / ``k_norm`` -> the *model's* RoPE table of
            the layer's type (``rotary_emb_local`` for window layers, ``rotary_emb`` for
            global ones, applied with SGLang's ``apply_rotary_pos_emb``), as SGLang's
            ``forward_native`` does (the layer's own ``rotary_emb`` is not used there);
            ``"mla"``: DeepSeek's multi-head latent attention, absorbed (:func:`mla_qkv`):
            one latent row of ``kv_lora_rank`` + ``qk_rope_head_dim`` values a token is the
            layer's one key head, its first ``kv_lora_rank`` values the value; the output is
            un-absorbed by ``w_vc`` before ``o_proj`` (:func:`mla_out`).
        attention_alternatives: child sets of which the attention block has exactly one
            besides :attr:`attention_modules` (DeepSeek's q through a low-rank projection
            or a direct one); empty: none.
        mlp_blocks: the child sets a layer's MLP block may have (:data:`DENSE_MLP`,
            :data:`SPARSE_MLP`, :data:`SHARED_EXPERT_MLP`; a MoE model may keep dense
            layers); the loop calls SGLang's block whole and sums its tensor-parallel
            partials (:func:`mlp_output`).
        mlp_name: the layer's attribute holding the block (one of :data:`MLP_NAMES`).
        optional_attention: attention children a model of the architecture may have, all
            of them or none (GLM-4.x's per-head ``q_norm`` / ``k_norm`` under
            ``use_qk_norm``); the split preparation runs them where present.
        qk_norm: how the split preparation applies ``q_norm`` / ``k_norm``:
            ``"per_head"``, SGLang's ``apply_qk_norm`` (an RMS per head: Qwen3, GLM-4.x);
            ``"across_heads"``, the block's own ``qk_norm_impl`` (one RMS over all heads of q
            and of k, its sums reduced across attention-TP ranks: MiniMax-M2).
        sinks: the attention block's parameter holding one sink logit per query head
            (gpt-oss: ``"sinks"``, this rank's heads), which relay's attention adds to each
            softmax; None: the block holds no parameter of its own.
        windows: layers may attend through a sliding window (``RadixAttention``'s
            ``sliding_window_size``), which relay's attention and selection apply.
        norms: ``"pre"``: ``input_layernorm`` and ``post_attention_layernorm`` (the
            residual added in each); ``"sandwich"``: Gemma 3's four, the attention output
            normed by ``post_attention_layernorm`` before ``pre_feedforward_layernorm``
            adds the residual, the MLP output by ``post_feedforward_layernorm``.
        residual: where a plain forward keeps the residual stream entering a layer (the
            decode capture reads it there): ``"boundary"``, SGLang's layer boundary (its
            written residual); ``"arguments"``, the decoder layer's own ``hidden_states`` +
            ``residual`` arguments (Gemma 3, which passes its residual by hand).
    """

    architecture: str
    model_forward: str
    attention_modules: frozenset[str] = BASE_ATTENTION
    prepare: str = "native"
    mlp_blocks: tuple[frozenset[str], ...] = (DENSE_MLP,)
    mlp_name: str = "mlp"
    optional_attention: frozenset[str] = frozenset()
    qk_norm: str = "per_head"
    sinks: str | None = None
    windows: bool = False
    norms: str = "pre"
    residual: str = "boundary"
    attention_alternatives: tuple[frozenset[str], ...] = ()


QK_NORMS = ("per_head", "across_heads")
LLAMA_FORWARD = "sglang.srt.models.llama.LlamaModel.forward"  # Llama, Mistral, Phi-3


def native_prepare(attn_mod):
    """The block's ``forward_prepare_native(positions, x) -> (q, k, v)`` if it has that
    contract (Llama, Qwen3), else None (the split sequence runs)."""
    prepare = getattr(attn_mod, "forward_prepare_native", None)
    if prepare is None:
        return None
    kind = type(attn_mod)
    native = _NATIVE_CONTRACT.get(kind)
    if native is None:
        import inspect

        params = list(inspect.signature(prepare).parameters)
        native = _NATIVE_CONTRACT[kind] = len(params) == 2  # (positions, hidden_states)
    return prepare if native else None


_NATIVE_CONTRACT: dict[type, bool] = {}


def gemma3_qkv(model, attn_mod, positions, x):
    """Post-RoPE q, k and v (flat) of a Gemma 3 attention block (``prepare="gemma3"``):
    SGLang's ``Gemma3Attention.forward_native`` up to the attention, with the model's RoPE
    table of the layer's type (:func:`model_rope`)."""
    from sglang.srt.layers.rotary_embedding import apply_rotary_pos_emb

    out, _ = attn_mod.qkv_proj(x)
    q, k, v = out.split([attn_mod.q_size, attn_mod.kv_size, attn_mod.kv_size], dim=-1)
    q = attn_mod.q_norm(q.unflatten(-1, (attn_mod.num_heads, attn_mod.head_dim)))
    k = attn_mod.k_norm(k.unflatten(-1, (attn_mod.num_kv_heads, attn_mod.head_dim)))
    cos, sin = model_rope(model, attn_mod)(x, positions.view(1, -1))
    d = cos.shape[-1]
    q, k = apply_rotary_pos_emb(q, k, cos.reshape(-1, d), sin.reshape(-1, d))
    return q.flatten(1), k.flatten(1), v


def gemma3_problems(model, attn_mod) -> str | None:
    """What in a Gemma 3 stack the relay loop would not run as SGLang does: its model-level
    RoPE tables missing or of a type whose frequencies change in the forward (only
    ``default`` and ``linear`` keep them fixed, as the splice assumes); SGLang's AMX CPU path
    (``forward_cpu`` applies the layers' own tables, not the model's); a logit soft-cap
    (SGLang's attention drops the attention one) or bidirectional attention in the config."""
    ropes = [getattr(model, n, None) for n in ("rotary_emb", "rotary_emb_local")]
    if not all(hasattr(r, "inv_freq") for r in ropes) or not hasattr(attn_mod, "is_sliding"):
        return "no model-level RoPE tables for a Gemma 3 layer"
    kinds = {getattr(r, "rope_type", "default") for r in ropes}
    if not kinds <= {"default", "linear"}:
        return f"Gemma 3 RoPE of type {sorted(kinds)} (served: default, linear)"
    from sglang.srt.models import gemma3_causal

    if gemma3_causal._is_cpu and gemma3_causal._is_cpu_amx_available:
        return "Gemma 3 on an AMX CPU (SGLang's forward_cpu applies other RoPE tables)"
    cfg = getattr(model, "config", None)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            return f"Gemma 3 with {name} {getattr(cfg, name)}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "Gemma 3 with bidirectional attention"
    return None


def model_rope(model, attn_mod):
    """The model-level RoPE module Gemma 3 applies in a layer: the local table for a window
    layer, the global one otherwise."""
    return model.rotary_emb_local if attn_mod.is_sliding else model.rotary_emb


def sinks_of(attn_mod, anatomy: Anatomy):
    """The block's sink logits (the parameter :attr:`Anatomy.sinks` names), or None."""
    return None if anatomy.sinks is None else getattr(attn_mod, anatomy.sinks)


def split_qkv(attn_mod, positions, x, across_heads: bool = False):
    """Post-RoPE q, k and v (flat ``[n, heads*dim]``) of an attention block without a
    native preparation (``prepare="split"``): SGLang's unfused sequence; ``across_heads``:
    the q/k norm is the block's own ``qk_norm_impl`` (:attr:`Anatomy.qk_norm`)."""
    out, _ = attn_mod.qkv_proj(x)
    q, k, v = out.split([attn_mod.q_size, attn_mod.kv_size, attn_mod.kv_size], dim=-1)
    if across_heads and hasattr(attn_mod, "q_norm"):
        q, k = attn_mod.qk_norm_impl.forward(q.contiguous(), k.contiguous())
    elif hasattr(attn_mod, "q_norm"):
        q, k = apply_qk_norm(attn_mod, q, k)
    q, k = attn_mod.rotary_emb(positions, q, k)
    return q, k, v


def radix_of(attn_mod):
    """The ``RadixAttention`` an attention block attends and stores KV through: an MLA
    block's absorbed one (``attn_mqa``: one latent key head), else ``attn``."""
    mqa = getattr(attn_mod, "attn_mqa", None)
    return mqa if mqa is not None else attn_mod.attn


def mla_qkv(attn_mod, positions, x):
    """Absorbed q, the latent row and its value part (flat) of a DeepSeek MLA block
    (``prepare="mla"``): SGLang's ``forward_absorb_prepare`` sequence without its fused and
    quantized variants (refused by :func:`mla_problems`). ``q`` is ``[n, H * (r + p)]``
    (each head's nope part absorbed through ``w_kc`` into the latent space, then its RoPE
    part), ``k`` ``[n, r + p]`` (the normed latent, then the rotated shared key part), ``v``
    ``[n, r]`` (the normed latent), ``r`` = ``kv_lora_rank``, ``p`` = ``qk_rope_head_dim``."""
    import torch

    r, p = attn_mod.kv_lora_rank, attn_mod.qk_rope_head_dim
    if attn_mod.q_lora_rank is not None:
        q, latent = attn_mod.prepare_qkv_latent(x, None).split([attn_mod.q_lora_rank, r + p], -1)
        q = attn_mod.q_b_proj_forward(attn_mod.q_a_layernorm(q))
    else:
        q = attn_mod.q_proj(x)[0].view(-1, attn_mod.num_local_heads, attn_mod.qk_head_dim)
        latent = attn_mod.kv_a_proj_with_mqa(x)[0]
    k_nope = attn_mod.kv_a_layernorm(latent[..., :r])
    q_nope, q_pe = q.split([attn_mod.qk_nope_head_dim, p], dim=-1)
    q_nope = torch.bmm(q_nope.transpose(0, 1), attn_mod.w_kc).transpose(0, 1)
    q_pe, k_pe = attn_mod.rotary_emb(positions, q_pe, latent[..., r:].unsqueeze(1))
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe.reshape(-1, p)), dim=-1)
    return q.flatten(1), k, k_nope


def mla_out(attn_mod, o):
    """An MLA block's attention output in latent space (``[n, H * r]``) un-absorbed per
    head through ``w_vc`` (``[n, H * v_head_dim]``), as SGLang's ``forward_absorb_core``
    does before ``o_proj``."""
    import torch

    o = o.view(-1, attn_mod.num_local_heads, attn_mod.kv_lora_rank).transpose(0, 1)
    return torch.bmm(o, attn_mod.w_vc).transpose(0, 1).flatten(1, 2)


def mla_problems(attn_mod, ra, rope) -> str | None:
    """What in a DeepSeek MLA block the absorbed loop (:func:`mla_qkv`, :func:`mla_out`)
    would not run as SGLang does: a latent KV geometry other than one key head of
    ``r + p`` values with the value its first ``r``; a RoPE over other dims; a sparse (DSA)
    indexer or context-parallel decode; the absorbed weights quantized or in DeepGEMM's
    fp8 form; GGUF's split ``kv_b``; Mistral-Large-3's Llama-4 attention scaling."""
    import torch

    r, p = getattr(attn_mod, "kv_lora_rank", None), getattr(attn_mod, "qk_rope_head_dim", None)
    if not isinstance(r, int) or not isinstance(p, int):
        return "an MLA block without kv_lora_rank / qk_rope_head_dim"
    if (ra.tp_k_head_num, ra.qk_head_dim, ra.v_head_dim) != (1, r + p, r):
        return (f"MLA attention of {ra.tp_k_head_num} key heads, dims {ra.qk_head_dim} / "
                f"{ra.v_head_dim} (relay reads one latent head of {r + p} / {r})")  # fmt: skip
    if rope is None or getattr(rope, "head_size", None) != p:
        return f"MLA RoPE not over the {p} rotary dims"
    for flag in ("use_dsa", "use_deep_gemm_bmm", "_kimi_split_gguf_kv_b"):
        if getattr(attn_mod, flag, False):
            return f"MLA with {flag.strip('_')}"
    if getattr(attn_mod, "dcp_size", 1) not in (1, None):
        return "MLA with decode context parallelism"
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for name in ("w_kc", "w_vc"):
        w = getattr(attn_mod, name, None)
        if not isinstance(w, torch.Tensor) or w.dtype not in floats:
            return f"MLA {name} of {getattr(w, 'dtype', None)} (served: fp32, bf16, fp16)"
    return None


def apply_qk_norm(attn_mod, q, k):
    """SGLang's own per-head q/k RMSNorm (``models.utils.apply_qk_norm``), as the
    non-fused path of a Qwen3-style attention block runs it before RoPE."""
    from sglang.srt.models.utils import apply_qk_norm as norm

    alt_stream = getattr(attn_mod, "alt_stream", None)
    return norm(q=q, k=k, q_norm=attn_mod.q_norm, k_norm=attn_mod.k_norm,
                head_dim=attn_mod.head_dim, alt_stream=alt_stream)  # fmt: skip


def mlp_takes_batch(block) -> bool:
    """Whether SGLang's MLP block takes the forward batch (Llama, Qwen MoE) or not
    (Mixtral)."""
    import inspect

    return "forward_batch" in inspect.signature(block.forward).parameters


def mlp_output(block):
    """The module whose ``reduce_results`` says whether the block's output is still a
    tensor-parallel partial: a dense block's row-parallel ``down_proj``; a sparse block's
    ``experts`` (the shared expert is summed into their output inside the block), unless
    the block reduces itself (``reduce_results`` on the block)."""
    if hasattr(block, "experts"):
        return block if getattr(block, "reduce_results", False) else block.experts
    return block.down_proj


def rotation_table(rope):
    """The ``[max_pos, rot_dim]`` cos || sin table keys are re-rotated with, in float32:
    SGLang's own ``cos_sin_cache`` where it keeps it in float32 (CUDA, HIP, XPU), else the
    module's own ``_compute_cos_sin_cache()`` (float32; SGLang casts its cache to the model
    dtype elsewhere, e.g. bf16 on a CPU, which would round every re-rotation angle).
    Computed once per module (kept here, not on SGLang's object)."""
    import torch

    cache = rope.cos_sin_cache
    if cache.dtype == torch.float32:
        return cache
    table = _ROTATION_TABLES.get(rope)
    if table is None or table.device != cache.device:
        table = rope._compute_cos_sin_cache().float().to(cache.device)
        _ROTATION_TABLES[rope] = table
    return table


_ROTATION_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rotates_a_prefix(rope) -> bool:
    """Whether ``rope`` rotates pairs within the first ``rotary_dim`` (even, at most the head
    size) dims of each head, all of them (full rotary) or a prefix (partial rotary: GLM-4.x,
    MiniMax-M2); the re-rotation then turns those alone (``core/rope.py``)."""
    rot, head = getattr(rope, "rotary_dim", None), getattr(rope, "head_size", None)
    return isinstance(rot, int) and isinstance(head, int) and 0 < rot <= head and rot % 2 == 0


def anatomy_problems(anatomy: Anatomy, model, supported_rope: frozenset[str]) -> list[str]:
    """What in the served decoder stack ``model`` the relay loop of ``anatomy`` would not
    run as SGLang does (empty: nothing). Checks every layer."""
    problems = [f"no {a}" for a in ("embed_tokens", "layers", "norm") if not hasattr(model, a)]
    if problems or not len(model.layers):
        return problems or ["no decoder layers"]
    for lid, layer in enumerate(model.layers):
        where = f"layers[{lid}]"
        expected = LAYER_MODULES | {anatomy.mlp_name}
        if anatomy.norms == "sandwich":
            expected |= SANDWICH_NORMS
        extra = {n for n, _ in layer.named_children()} - expected
        missing = expected - {n for n, _ in layer.named_children()}
        if extra or missing:
            problems.append(f"{where} has modules {sorted(extra)} / lacks {sorted(missing)}")
            continue
        attn_mod = layer.self_attn
        children = {n for n, _ in attn_mod.named_children()}
        optional = anatomy.optional_attention
        runs = anatomy.attention_modules | (optional if children & optional else frozenset())
        if anatomy.attention_alternatives:  # the one alternative the block comes closest to
            runs |= min(anatomy.attention_alternatives, key=lambda a: len(a ^ (children - runs)))
        if children != runs:
            problems.append(
                f"{where}.self_attn has {sorted(children - runs)} / lacks "
                f"{sorted(runs - children)} (the {anatomy.architecture} adapter runs exactly "
                f"{sorted(anatomy.attention_modules)}"
                + (f", with or without {sorted(optional)})" if optional else ")")
            )
            continue
        if anatomy.qk_norm == "across_heads" and "q_norm" in children:
            if not callable(getattr(getattr(attn_mod, "qk_norm_impl", None), "forward", None)):
                problems.append(f"{where}.self_attn has q_norm but no qk_norm_impl.forward")
                continue
        own = sorted(n for n, _ in attn_mod.named_parameters(recurse=False))
        if anatomy.sinks is not None:
            if own != [anatomy.sinks]:
                problems.append(f"{where}.self_attn holds parameters {own}, not the adapter's "
                                f"[{anatomy.sinks!r}]")  # fmt: skip
                continue
            heads = radix_of(attn_mod).tp_q_head_num
            if tuple(getattr(attn_mod, anatomy.sinks).shape) != (heads,):
                problems.append(f"{where}.self_attn.{anatomy.sinks}: not one per query head "
                                f"({heads})")  # fmt: skip
                continue
        elif own:  # e.g. gpt-oss's per-head attention sinks: the loop's attention has none
            problems.append(f"{where}.self_attn holds parameters {own} the adapter does not run")
            continue
        if anatomy.prepare == "gemma3":
            gemma = gemma3_problems(model, attn_mod)
            if gemma:
                problems.append(f"{where}: {gemma}")
                continue
        native = native_prepare(attn_mod) is not None
        if native != (anatomy.prepare == "native"):
            problems.append(
                f"{where}.self_attn ({type(attn_mod).__name__}): the {anatomy.architecture} "
                f"adapter expects {'a' if anatomy.prepare == 'native' else 'no'} "
                "forward_prepare_native(positions, hidden_states)"
            )
        block = getattr(layer, anatomy.mlp_name)
        mlp_children = frozenset(n for n, _ in block.named_children())
        if mlp_children not in anatomy.mlp_blocks:
            closest = min(anatomy.mlp_blocks, key=lambda b: len(b ^ mlp_children))
            problems.append(
                f"{where}.{anatomy.mlp_name} ({type(block).__name__}) has "
                f"{sorted(mlp_children - closest)} / lacks {sorted(closest - mlp_children)} "
                f"(the {anatomy.architecture} adapter runs "
                f"{' or '.join(str(sorted(b)) for b in anatomy.mlp_blocks)})"
            )
        ra, rope = radix_of(attn_mod), attn_mod.rotary_emb
        if anatomy.prepare == "mla":
            mla = mla_problems(attn_mod, ra, rope)
            if mla:
                problems.append(f"{where}: {mla}")
                continue
        if type(rope).__name__ not in supported_rope:
            problems.append(
                f"{where}: cannot re-rotate keys of {type(rope).__name__} "
                f"(supported: {', '.join(sorted(supported_rope))})"
            )
        elif getattr(rope, "position_start", 0) != 0:  # the table's row p is not angle p
            problems.append(f"{where}: RoPE positions start at {rope.position_start}")
        elif not _rotates_a_prefix(rope):  # partial rotary: the dims after rotary_dim stay
            problems.append(f"{where}: rotary_dim {getattr(rope, 'rotary_dim', None)} of head "
                            f"size {getattr(rope, 'head_size', None)}")  # fmt: skip
        if getattr(ra, "logit_cap", 0) not in (0, 0.0, None):
            problems.append(f"{where}: attention logit cap {ra.logit_cap}")
        if getattr(ra, "sliding_window_size", -1) not in (-1, None) and not anatomy.windows:
            problems.append(f"{where}: sliding-window attention ({ra.sliding_window_size})")
        if getattr(ra, "k_scale", None) is not None or getattr(ra, "v_scale", None) is not None:
            problems.append(f"{where}: scaled (quantized) KV")
        if getattr(ra, "is_cross_attention", False) or getattr(ra, "use_irope", False):
            problems.append(f"{where}: cross attention / iRoPE")
        if ra.qk_head_dim != ra.v_head_dim and anatomy.prepare != "mla":
            problems.append(f"{where}: qk head dim {ra.qk_head_dim} != v head dim")
    return problems
