"""The served model as relay reaches it: its decoder stack, TP group and graph state, and
the two attributes relay adds to it (the runtime, the decode capture)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_relay.runtime.sglang.server import cuda_graphs_enabled
from sglang_relay.runtime.sglang.views import check_surface
from sglang_relay.runtime.state import STATE

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ForwardBatch, ModelRunner

MODEL_RUNTIME_ATTR = "_sglang_relay_runtime"


MODEL_CAPTURE_ATTR = "_sglang_relay_decode_capture"


SUPPORTED_ROPE = frozenset(
    {
        "RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
        "DeepseekScalingRotaryEmbedding",  # MLA's YaRN (its magnitude folded into the table)
    }
)


def kv_write_loc(loc):
    """A KV write target for ``set_kv_buffer`` on SGLang's token-major pools."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc(loc)


def lora_backend(model_runner: ModelRunner):
    """SGLang's LoRA backend of a model runner serving LoRA (its layers read
    ``backend.batch_info``), else None."""
    manager = getattr(model_runner, "lora_manager", None)
    return None if manager is None else manager.lora_backend


def inner_model(model_runner: ModelRunner):
    """The decoder stack (``LlamaModel`` / ``Qwen2Model``) of the runner's model."""
    outer = model_runner.model
    return getattr(outer, "model", outer)


def check_model_anatomy(model_runner: ModelRunner):
    """Fail loudly unless the served decoder stack has exactly the modules its
    architecture's adapter drives (``runtime/models/anatomy.py``), in every layer, and the SGLang
    functions the layer driver mirrors are the ones it was verified on (``mirrors.py``).
    Returns the architecture's adapter (``anatomy.Anatomy``)."""
    from sglang_relay.runtime.models.anatomy import anatomy_problems
    from sglang_relay.runtime.models.registry import anatomy_of
    from sglang_relay.runtime.sglang.mirrors import check_served_mirrors

    architecture = type(model_runner.model).__name__
    anatomy, model = anatomy_of(architecture), inner_model(model_runner)
    problems = anatomy_problems(anatomy, model, SUPPORTED_ROPE)
    if problems:
        raise ValueError(
            f"sglang-relay cannot run the layer loop of this {architecture} model: "
            + "; ".join(problems[:4])
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        )
    check_served_mirrors(model, anatomy.mlp_name)
    return anatomy


def tp_group():
    """SGLang's tensor-parallel GroupCoordinator of this process, or None under tp 1."""
    if STATE.tp_group_known:
        return STATE.tp_group
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group is None:  # not initialised yet: ask again next time
        return None
    if int(group.world_size) > 1:
        check_surface("GroupCoordinator", group)
    STATE.tp_group = group if int(group.world_size) > 1 else None
    STATE.tp_group_known = True
    return STATE.tp_group


def finish_row_parallel(linear, out):
    """The TP sum of a row-parallel linear's partial output. SGLang 0.5.23 builds a dense
    layer's ``o_proj`` / ``down_proj`` with ``reduce_results=False`` and all-reduces in its
    layer boundaries (``layers/layer_boundary``); the relay loops call the modules
    themselves, so they reduce here (a no-op under tp 1)."""
    if getattr(linear, "reduce_results", True):
        return out
    group = tp_group()
    return out if group is None else group.all_reduce(out)


def attention_window(radix_attn) -> int:
    """Keys a row of this ``RadixAttention`` sees, itself included (0: no sliding window):
    SGLang keeps ``W - 1`` in ``sliding_window_size`` (-1 or None: none)."""
    w = getattr(radix_attn, "sliding_window_size", -1)
    return w + 1 if w is not None and w > -1 else 0


def attention_inputs(args: tuple, kwargs: dict):
    """``(hidden_states, forward_batch)`` of a call to a decoder layer's ``self_attn``:
    every supported model calls ``self_attn(positions=, hidden_states=, forward_batch=)``
    (by keyword; positionally in that order otherwise)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    fb = kwargs["forward_batch"] if "forward_batch" in kwargs else args[2]
    return hidden, fb


def attention_entry_residual(fb: ForwardBatch):
    """The residual stream entering the current layer's attention, as SGLang's attention
    boundary has just written it (``layer_boundary.residual.batch.written_residual``:
    the residual after the previous layer's adds, complete under TP, one row per token
    of the batch). Borrowed: SGLang updates it in place at the next boundary, so copy it
    before the attention returns."""
    from sglang.srt.layers.layer_boundary.residual.batch import written_residual

    return written_residual(fb)


def _first_projection(model):
    attn = model.layers[0].self_attn
    proj = getattr(attn, "qkv_proj", None) or getattr(attn, "o_proj", None)
    return getattr(proj, "base_layer", proj)  # under LoRA: the wrapped SGLang linear


def linear_method_name(model) -> str:
    """The class name of the linear method SGLang runs in the first layer's attention
    projection (``UnquantizedLinearMethod``, or a quantized checkpoint's method)."""
    return type(getattr(_first_projection(model), "quant_method", None)).__name__


def linear_rows(model) -> str:
    """Whether a row's result of the served linear method depends on the other rows of
    its matmul: ``"independent"`` (unquantized, weight-only, static or per-row activation
    scales) or ``"batch-coupled"`` (an activation scale or outlier split computed over the
    whole input: dynamic per-tensor FP8 on ROCm, LLM.int8's fp16 outlier columns).
    Measured, not looked up, on the first layer's attention projection only (not MoE
    experts, not per-layer schemes): its ``apply`` runs five ordinary rows alone, beside a
    sixth ordinary row (the control: what the kernel's choice for another row count alone
    changes) and beside a sixth row far larger with one outlier column; coupled when the
    outlier moves the five rows ten times more than the control does. Relay runs layers
    on row subsets of a batch; what that means under each: docs/limitations.md."""
    import torch

    proj = _first_projection(model)
    method = getattr(proj, "quant_method", None)
    if method is None or not hasattr(method, "apply"):
        return "unknown"
    weight = next(proj.parameters())
    n_in = getattr(proj, "input_size_per_partition", None) or proj.input_size
    dtype = getattr(proj, "params_dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        dtype = next(p for p in model.parameters() if p.dtype.itemsize >= 2).dtype
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, n_in, generator=g).to(dtype=dtype, device=weight.device)
    x[0] *= 16.0
    x[0, 3] = 64.0
    with torch.no_grad():
        alone = method.apply(proj, x[2:].clone()).float()
        control = method.apply(proj, x[1:].clone())[1:].float()
        outlier = method.apply(proj, torch.cat([x[:1], x[2:]]))[1:].float()
    floor = 1e-6 * float(alone.abs().max().clamp_min(1e-12))
    noise = float((control - alone).abs().max())
    moved = float((outlier - alone).abs().max())
    return "batch-coupled" if moved > 10.0 * noise + floor else "independent"


def attach_runtime(model, runtime) -> None:
    setattr(model, MODEL_RUNTIME_ATTR, runtime)


def runtime_of(model):
    """The relay runtime serving ``model`` in this process, if any."""
    return getattr(model, MODEL_RUNTIME_ATTR, None)


def attach_decode_capture(model, capture) -> None:
    setattr(model, MODEL_CAPTURE_ATTR, capture)


def decode_capture_of(model):
    """The decode capture installed on ``model`` before graph capture, if any."""
    return getattr(model, MODEL_CAPTURE_ATTR, None)


def capturing_graph() -> bool:
    """Whether this forward is being traced or captured into a graph (torch.compile by the
    CPU graph runner, or a CUDA graph capture): only tensor ops may run."""
    import torch

    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def decode_graphs_captured(model_runner: ModelRunner) -> bool:
    """Whether the runner captured decode graphs (CUDA graphs or the CPU graph runner)."""
    return bool(model_runner.decode_cuda_graph_captured)


def forward_mode_name(fb: ForwardBatch) -> str:
    """``EXTEND``, ``DECODE``, ``MIXED``, ``TARGET_VERIFY``, ... of a ForwardBatch."""
    return fb.forward_mode.name


def graphs_enabled(model_runner: ModelRunner) -> dict[str, bool]:
    """Whether decode / prefill batches may replay captured graphs (CUDA or CPU runner)."""
    out = {phase: cuda_graphs_enabled(model_runner, phase) for phase in ("decode", "prefill")}
    out["decode"] = out["decode"] or decode_graphs_captured(model_runner)
    return out
