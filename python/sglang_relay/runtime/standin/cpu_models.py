"""GPU-only pieces inside SGLang's model classes, in torch, for the CPU stand-in: what a
model class launches itself (not through an attention backend or ``sgl_kernel``) and only
on CUDA.

* MiniMax-M2's q/k RMSNorm (``MiniMaxM2QKRMSNorm``): one RMS over all heads of q and one
  over all heads of k, its sums of squares reduced across the attention-TP ranks (each holds
  a shard of the heads). SGLang's path off CUDA and AMX launches two Triton kernels
  (``rms_sumsq_serial``, ``rms_apply_serial``) whose wrappers assert CUDA tensors; this is
  the same two steps, checked against those kernels under the Triton interpreter
  (``test/unit/test_cpu_models.py``).
* gpt-oss's attention sinks on ``torch_native`` (SGLang's gpt-oss check refuses that
  backend; its Triton kernels are the reference: the same test file).
* DeepSeek-V2/V3's MLA on ``torch_native``: every forward absorbed (attention over the
  latent rows the MLA pool keeps), the form SGLang's own CPU and Triton decode paths take;
  SGLang's Triton MLA kernels are the reference (the same test file).
"""

from __future__ import annotations

import torch


def qk_sums_of_squares(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[2n]`` float32: each row's sum of squares of ``q [n, Dq]``, then of ``k [n, Dk]``
    (the layout of SGLang's ``rms_sumsq_serial``, without its padding)."""
    return torch.cat((q.float().square().sum(-1), k.float().square().sum(-1)))


def qk_rms_apply(q, k, q_weight, k_weight, sums, tp_world: int, eps: float):
    """``q`` and ``k`` normalized by the (all-rank) ``sums`` of :func:`qk_sums_of_squares`
    over the full width ``D * tp_world``, times their weight shards, in float32, cast back."""
    n = q.shape[0]
    inv_q = torch.rsqrt(sums[:n] / q.shape[1] / tp_world + eps).unsqueeze(-1)
    inv_k = torch.rsqrt(sums[n : 2 * n] / k.shape[1] / tp_world + eps).unsqueeze(-1)
    out_q = (q.float() * inv_q * q_weight.float()).to(q.dtype)
    out_k = (k.float() * inv_k * k_weight.float()).to(k.dtype)
    return out_q, out_k


def minimax_qk_norm(original, norm, q: torch.Tensor, k: torch.Tensor):
    """Around-hook of ``MiniMaxM2QKRMSNorm._forward_naive`` on the CPU stand-in: SGLang's
    two steps in torch (the sums all-reduced over the attention-TP group, as SGLang does)."""
    sums = qk_sums_of_squares(q, k)
    if norm._world_size > 1:
        from sglang.srt.layers.dp_attention import attn_tp_all_reduce

        sums = attn_tp_all_reduce(sums)
    return qk_rms_apply(
        q, k, norm._q_norm.weight, norm._k_norm.weight, sums, norm._world_size, norm._eps
    )


# ---- gpt-oss on torch_native -----------------------------------------------------------------
# SGLang 0.5.23 refuses torch_native for gpt-oss ("neither sliding window nor attention sinks",
# arg_groups/model_hook.py): its windows it does apply (``_make_sliding_window_mask``, the
# same ``W`` keys as Hugging Face), its sinks it does not take (``forward_extend`` /
# ``forward_decode`` have no ``sinks`` argument, which gpt-oss's attention passes). The
# stand-in lets the check through and adds the sinks after SGLang's own attention: each
# row's output times ``sigmoid(lse - sink[h])``, ``lse`` over the keys SGLang's mask showed it.


def gpt_oss_check_sees_torch_native_with_sinks(original, server_args, *args, **kwargs):
    """Around-hook of ``model_hook.handle_model_specific_adjustments``: during it (and only
    there: the backend choice elsewhere reads the same function), SGLang's backend lookup
    reports torch_native, which the stand-in gives sinks, as the Triton backend whose
    semantics it then has; read by the gpt-oss and Gemma 4 checks alone."""
    from sglang.srt.arg_groups import model_hook

    lookup = model_hook.attention_backends_of

    def as_triton(cfg):
        return tuple("triton" if b == "torch_native" else b for b in lookup(cfg))

    model_hook.attention_backends_of = as_triton
    try:
        return original(server_args, *args, **kwargs)
    finally:
        model_hook.attention_backends_of = lookup


def torch_native_extend_with_sinks(original, backend, q, k, v, layer, forward_batch, *args,
                                   sinks=None, **kwargs):  # fmt: skip
    """Around-hook of ``TorchNativeAttnBackend.forward_extend``: SGLang's attention (it
    writes the KV), then the sinks, if the layer passes any."""
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    if sinks is None:
        return out
    counts = forward_batch.extend_seq_lens.tolist()
    return _with_sinks(backend, out, q, layer, forward_batch, counts, sinks)


def torch_native_decode_with_sinks(original, backend, q, k, v, layer, forward_batch, *args,
                                   sinks=None, **kwargs):  # fmt: skip
    """Around-hook of ``TorchNativeAttnBackend.forward_decode``: as the extend's, one row
    per request."""
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    if sinks is None:
        return out
    counts = [1] * forward_batch.batch_size
    return _with_sinks(backend, out, q, layer, forward_batch, counts, sinks)


def _with_sinks(backend, out, q, layer, fb, counts, sinks):
    """``out`` (SGLang's sink-free attention, ``[rows, Hq * Dv]``) with the sinks added:
    per request, its ``counts[i]`` last positions' log-sum-exp over the keys they see."""
    from sglang_relay.core.attention import attention_lse, sink_rescale, visible
    from sglang_relay.runtime.sglang.model import attention_window

    hq = layer.tp_q_head_num
    q3 = q.reshape(-1, hq, layer.qk_head_dim)
    o3 = out.reshape(-1, hq, layer.v_head_dim)
    kbuf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    window = attention_window(layer)
    row = 0
    for i, (n, seq_len) in enumerate(zip(counts, fb.seq_lens.tolist(), strict=True)):
        if n:
            slots = req_to_token[fb.req_pool_indices[i], :seq_len].long()
            pos = torch.arange(seq_len - n, seq_len, device=q.device)
            lse = attention_lse(q3[row : row + n], kbuf[slots], visible(pos, seq_len, window),
                                layer.scaling)  # fmt: skip
            o3[row : row + n] = sink_rescale(o3[row : row + n], lse, sinks)
        row += n
    return out


# ---- MLA on torch_native --------------------------------------------------------------------
# SGLang's MLA block asks a registry which forward method the serving backend takes; a backend
# it does not list gets Triton's handler, which picks the up-projected MHA for a prefill with
# no cached prefix. torch_native's extend ignores the up-projected k / v it is then given and
# attends over the pool's rows, which are latent rows (kv_lora_rank + rope dims), not heads:
# the shapes fail. The absorbed method (MLA) hands torch_native the latent rows as one KV head
# (q [n, H, r + p], k [n, 1, r + p], v = the latent [n, 1, r]), which its SDPA path attends
# exactly; the stand-in registers it for every torch_native forward.


def mla_absorbed_on_torch_native(attn, forward_batch):
    """The forward method of an MLA attention block on torch_native: SGLang's own MLA
    sub-type choice (absorbed; the AMX-fused variant where SGLang would take it)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype(attn, forward_batch)


def register_mla_on_torch_native() -> None:
    """Register :func:`mla_absorbed_on_torch_native` as torch_native's MLA handler."""
    from sglang_relay.runtime.sglang.hooks import resolve
    from sglang_relay.runtime.sglang.targets import CPU_MLA_HANDLER_REGISTRY_TARGET

    resolve(CPU_MLA_HANDLER_REGISTRY_TARGET).register("torch_native", mla_absorbed_on_torch_native)
