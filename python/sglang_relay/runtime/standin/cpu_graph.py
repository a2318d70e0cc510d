"""CPU stand-in for what SGLang 0.5.23's CPU graph runner needs from an attention backend.

``--enable-torch-compile`` on the CPU makes SGLang capture decode forwards with
``torch.compile`` (``model_executor/cpu_graph_runner.py``, one compiled forward per batch
size, the CPU analogue of decode CUDA graphs). The runner asks its attention backend for
``init_cpu_graph_state``, ``get_cpu_graph_seq_len_fill_value`` and
``init_forward_metadata_capture_cpu_graph``; only ``intel_amx`` has them, and it calls
sgl-kernel's CPU ops, which need AMX and a CPU build of sgl-kernel that is not on PyPI. On
a CPU without AMX SGLang switches to ``torch_native``, which has neither the methods nor a
decode that compiles (its per-request loop slices by tensor values).

:class:`TorchNativeGraphAttnBackend` is ``torch_native`` plus those three methods, with
decode attention behind one opaque custom op (:func:`paged_decode_attention`) the way the
real ``decode_attention_cpu`` kernel is: the compiled graph calls it like any operator and
its per-request loop runs eagerly inside. Registered over ``torch_native`` only by the
CPU stand-in (:mod:`.cpu`), only for servers started with ``--enable-torch-compile``, so
every other server keeps SGLang's class. Plain SGLang serves with it too (it is not relay
code): it is what lets the CPU prove graph-mode decode for real.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch, ModelRunner


@torch.library.custom_op("sglang_relay::paged_decode_attention", mutates_args=("output",))
def paged_decode_attention(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
) -> None:
    """One decode query per request (``query``/``output``: ``[bs, Hq, D]``) over the
    request's first ``seq_lens[i]`` KV slots (``req_to_token[req_pool_indices[i]]``);
    GQA when ``Hq`` is a multiple of the cache's head count."""
    gqa = query.shape[1] != k_cache.shape[1]
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, :n].long()
        k = k_cache[slots].transpose(0, 1).to(query.dtype)  # [H_kv, n, D]
        v = v_cache[slots].transpose(0, 1).to(query.dtype)
        out = scaled_dot_product_attention(
            query[i].unsqueeze(1).unsqueeze(0),  # [1, Hq, 1, D]
            k.unsqueeze(0),
            v.unsqueeze(0),
            scale=scaling,
            enable_gqa=gqa,
        )
        output[i] = out[0, :, 0]


@paged_decode_attention.register_fake
def _paged_decode_attention_fake(
    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling
) -> None:
    return None


def graph_backend_class():
    """``TorchNativeAttnBackend`` with the CPU graph runner's interface."""
    from sglang_relay.runtime.sglang.model import kv_write_loc
    from sglang_relay.runtime.sglang.server import torch_native_backend_class

    base = torch_native_backend_class()

    class TorchNativeGraphAttnBackend(base):
        """``torch_native`` whose decode can be captured by SGLang's CPU graph runner."""

        def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
            """Nothing to preallocate: decode reads the pool and ``req_to_token``."""

        def get_cpu_graph_seq_len_fill_value(self) -> int:
            # padded rows of a replay attend one slot of req_pool row 0 (all zeros)
            return 1

        def init_forward_metadata_capture_cpu_graph(self, *args, **kwargs) -> None:
            self.swa_out_cache_loc = None

        def forward_decode(
            self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs
        ):
            sinks = kwargs.get("sinks") is not None  # gpt-oss: not applied here
            if layer.is_cross_attention or (layer.sliding_window_size or -1) > -1 or sinks:
                raise NotImplementedError(
                    "sglang-relay's CPU graph stand-in decodes full self-attention without "
                    "sinks only; serve this model without --enable-torch-compile"
                )
            loc = forward_batch.out_cache_loc
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, kv_write_loc(loc), k, v)
            hq, d = layer.tp_q_head_num, layer.qk_head_dim
            q3 = q.reshape(-1, hq, d)
            out = q3.new_empty((q3.shape[0], hq, layer.v_head_dim))
            paged_decode_attention(
                q3,
                out,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                float(layer.scaling),
            )
            return out.reshape(-1, hq * layer.v_head_dim)

    return TorchNativeGraphAttnBackend


def define_missing_kernel(original, op_name: str):
    """Around-hook of the CPU graph runner's ``register_cpu_compile_fake(op_name)``: it
    registers fake (meta) implementations for ~50 ``sgl_kernel`` CPU ops, which must exist
    as torch operators first. Without a CPU build of sgl-kernel they do not, so each missing
    one is defined here with a kernel that raises the stand-in's error if it is ever called
    (the torch_native paths never call them)."""
    if not hasattr(torch.ops.sgl_kernel, op_name):
        if STATE.cpu_graph_library is None:
            STATE.cpu_graph_library = torch.library.Library("sgl_kernel", "FRAGMENT")
        lib = STATE.cpu_graph_library
        lib.define(f"{op_name}(Tensor[] args) -> ()")

        def unavailable(*args, **kwargs):
            import sgl_kernel

            getattr(sgl_kernel, op_name)()  # the stand-in raises a clear error

        lib.impl(op_name, unavailable, "CompositeExplicitAutograd")
    return original(op_name)


def register_graph_backend() -> None:
    """Serve ``--attention-backend torch_native`` with :func:`graph_backend_class` when the
    server compiles its decode forwards (``--enable-torch-compile``); otherwise SGLang's
    own factory runs."""
    from sglang_relay.runtime.sglang.server import (
        attention_backend_factory,
        register_attention_backend,
        torch_compile_enabled,
    )

    stock = attention_backend_factory("torch_native")
    if getattr(stock, "_sglang_relay_graph", False):
        return
    cls: list = []

    def factory(runner: ModelRunner):
        if not torch_compile_enabled(runner):
            return stock(runner)
        if not cls:
            cls.append(graph_backend_class())
        return cls[0](runner)

    factory._sglang_relay_graph = True
    register_attention_backend("torch_native", factory)
