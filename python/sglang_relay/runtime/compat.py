"""The one place that names SGLang internals; checked against the pinned version at import.

This file is the whole contract between sglang-relay and SGLang 0.5.23: every ``sglang``
import, every dotted hook target, and every attribute of an SGLang object the plug-in
reads (``Req``, ``ForwardBatch``, ``ServerArgs``, the model runner) is named here, behind
small typed adapters; the decoder modules each supported architecture has, and the
attributes read off them, are named in its half of the contract, ``runtime/anatomy.py``. At start-up
:func:`check_hooks_installed` verifies that every hook is really in place and
:func:`check_model_anatomy` that the served model has the modules the relay loops call;
either fails loudly instead of serving "nothing relayed, no error".

The plug-in replaces no attribute of an SGLang object. It adds two to the served model,
the runtime reference ``MODEL_RUNTIME_ATTR`` and the decode capture ``MODEL_CAPTURE_ATTR``
(installed before SGLang captures decode graphs), so the model-forward hook reaches them
without a module-level registry. On a CPU-only machine the stand-in (``runtime/cpu.py``,
``runtime/cpu_graph.py``) also re-registers the ``torch_native`` attention backend factory
for servers that compile their decode forwards.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

SUPPORTED_SGLANG = ("0.5.23",)

try:
    SGLANG_VERSION = version("sglang")
except PackageNotFoundError as exc:  # pragma: no cover - packaging error
    raise ImportError("sglang-relay needs SGLang installed (pip install sglang==0.5.23)") from exc

if SGLANG_VERSION not in SUPPORTED_SGLANG:
    raise ImportError(
        f"sglang-relay supports SGLang {', '.join(SUPPORTED_SGLANG)}; found {SGLANG_VERSION}. "
        "Install the supported release or upgrade sglang-relay."
    )

# Hook targets (dotted paths for sglang.srt.plugins.hook_registry).
INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)

# Model architectures whose decoder the relay loops drive (runtime/anatomy.py: per
# architecture, the modules run and the forward hooked).
from sglang_relay.runtime.anatomy import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES  # noqa: E402
from sglang_relay.runtime.modes import ServerView  # noqa: E402

MODEL_RUNTIME_ATTR = "_sglang_relay_runtime"
MODEL_CAPTURE_ATTR = "_sglang_relay_decode_capture"
SUPPORTED_ROPE = frozenset(
    {
        "RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
    }
)


def radix_cache_api():
    """(register_radix_cache_backend, registered_radix_cache_backends,
    create_unified_radix_cache)."""
    from sglang.srt.mem_cache.registry import (
        create_unified_radix_cache,
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    return register_radix_cache_backend, registered_radix_cache_backends, create_unified_radix_cache


def unified_radix_cache_class():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache


def hook_registry():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return HookRegistry, HookType


def attention_backend_name(model_runner) -> str | None:
    """The attention backend the runner resolved for prefill (``--attention-backend`` or
    SGLang's platform default); the raw ``ServerArgs`` value when the runner has none."""
    resolved = getattr(model_runner, "prefill_attention_backend_str", None)
    if resolved:
        return resolved
    args = getattr(model_runner, "server_args", None)
    return getattr(args, "attention_backend", None)


def graphs_enabled(model_runner) -> dict[str, bool]:
    """Whether decode / prefill batches may replay captured graphs (CUDA or CPU runner)."""
    out = {phase: cuda_graphs_enabled(model_runner, phase) for phase in ("decode", "prefill")}
    out["decode"] = out["decode"] or decode_graphs_captured(model_runner)
    return out


def cuda_graphs_enabled(model_runner, phase: str) -> bool:
    """Whether ``phase`` (``"decode"`` or ``"prefill"``) batches may replay captured CUDA
    graphs: the published per-phase graph config (``--cuda-graph-backend-decode``,
    ``--disable-prefill-cuda-graph``, ``--disable-cuda-graph``, ...), else the legacy flag."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase
    from sglang.srt.runtime_context import get_exec

    if phase not in Phase.ALL:
        raise ValueError(f"unknown CUDA graph phase {phase!r}")
    try:
        cfg = get_exec().graph.cuda_graph_config
    except (ValueError, AttributeError):  # not published (e.g. outside a scheduler)
        cfg = None
    if cfg is None:
        args = getattr(model_runner, "server_args", None)
        return not getattr(args, "disable_cuda_graph", True)
    return getattr(cfg, phase).backend != Backend.DISABLED


# ---- CPU graph stand-in (runtime/cpu_graph.py) ---------------------------------------------
def torch_native_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend


def attention_backend_factory(name: str):
    """SGLang's registered factory for attention backend ``name``."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS[name]


def register_attention_backend(name: str, factory) -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(name)(factory)


def torch_compile_enabled(model_runner=None) -> bool:
    """Whether this server compiles its decode forwards (``--enable-torch-compile``: the
    CPU graph runner on a CPU)."""
    from sglang.srt.runtime_context import get_flags

    try:
        return bool(get_flags().capture.enable_torch_compile)
    except (ValueError, AttributeError):  # not published (e.g. outside a scheduler)
        args = getattr(model_runner, "server_args", None)
        return bool(getattr(args, "enable_torch_compile", False))


def kv_write_loc(loc):
    """A KV write target for ``set_kv_buffer`` on SGLang's token-major pools."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc(loc)


# Model classes whose forward the relay loop may take over (dotted hook targets), one per
# adapter: sglang.srt.models.{llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model}.forward
from sglang_relay.runtime.anatomy import MODEL_FORWARD_TARGETS as MODEL_FORWARD_TARGETS  # noqa: E402

PREPARE_FOR_EXTEND_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
MIX_WITH_RUNNING_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running"
ADD_ONE_REQ_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
REQUEST_LEVEL_KEY_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.is_request_level_customized_info_key"
)
META_INFO_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
# every generate request enters here (HTTP, OpenAI, the guard's redo): relay's trust
# boundary (runtime/trust.py); a ValueError raised here is SGLang's 400
GENERATE_REQUEST_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
# the tokenizer manager is built: the trust boundary's gate is built with it (a relay
# server whose settings do not resolve there fails start-up, not each request)
TOKENIZER_INIT_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"
# /abort_request: an abort of a request also reaches its guard redo (runtime/guard.py)
ABORT_REQUEST_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request"
# every response a client gets (streamed or not) comes out of this async generator; a
# streamed chunk that did not carry new relay info gets SGLang's raw accumulated list
STREAM_RESPONSE_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._stream_one_response"
)
# CPU stand-in only (runtime/cpu.py): model-parallel groups without PyNccl
MODEL_PARALLEL_GROUP_TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
# decode graphs are captured here, before the relay runtime exists: the decode capture is
# installed on the model first (runtime/decode.py)
CAPTURE_DECODE_GRAPH_TARGET = (
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_decode_graph"
)
# every forward of the model runner: counts the decode forwards that replayed a graph
MODEL_RUNNER_FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
# data parallel (runtime/dp_routing.py): the controller launches its ranks in __init__, and
# routes every request through maybe_external_dp_rank_routing first
DP_CONTROLLER_INIT_TARGET = (
    "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__"
)
DP_ROUTING_TARGET = (
    "sglang.srt.managers.data_parallel_controller.DataParallelController."
    "maybe_external_dp_rank_routing"
)
# CPU stand-in only: the controller's event loop, which polls its socket without blocking
DP_EVENT_LOOP_TARGET = (
    "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"
)
# CPU stand-in only (runtime/cpu_graph.py): the CPU graph runner registers fake kernels for
# sgl_kernel CPU ops, which must exist as torch operators first
CPU_GRAPH_FAKE_TARGET = "sglang.srt.model_executor.cpu_graph_runner.register_cpu_compile_fake"
# CPU stand-in only, opted in (runtime/cpu.py): SGLang refuses --kv-cache-dtype fp8_e5m2 on
# a CPU here; the stand-in lets its pool hold FP8 as on a GPU, to test relay on FP8 pools
KV_CACHE_DTYPE_TARGET = "sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype"
# the KV pool's byte budget -> token count, for the initial pool and the post-capture resize:
# relay's side memory is taken out of the budget here (:mod:`.budget`)
KV_BUDGET_TARGET = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget"
)


# ---- launcher ------------------------------------------------------------------------------
def run_http_server(argv: list[str]) -> None:
    """SGLang's own HTTP server for ``argv`` (plug-ins loaded first); kills its children on
    exit. Refuses, before any process is spawned, a configuration relay cannot serve."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def parse_server_args(argv: list[str]):
    """SGLang's own parse of ``argv`` as given (argparse namespace with ServerArgs field
    names), before resolution: what the user asked for, without SGLang's checks of other
    options (which would refuse some flags with a less useful message first)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang-relay serve", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def resolved_server_args(argv: list[str]):
    """``argv`` as SGLang resolves it at start-up, without launching anything: the
    ServerArgs record from SGLang's own parse, then ``ServerArgs.resolve_once()`` (the
    resolution pipeline, ``srt/arg_groups/pipeline.py``; it reads the model's config and
    may raise on options SGLang itself refuses)."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs.from_cli_args(parse_server_args(argv))
    args.resolve_once()
    return args


def resolved_value(args, name: str, default=None):
    """The value SGLang decided for ServerArgs field ``name``.

    SGLang 0.5.23 keeps the fields as the user typed them and appends its own decisions
    (``srt/arg_groups/overrides.py: declare_resolution``), e.g. ``page_size`` None -> 64
    under ``trtllm_mha``, ``chunked_prefill_size`` None -> 4096 on a CPU.
    ``resolution_result`` reads the last decision, else the raw input, else the field's
    declared fallback (what ``ServerArgs.resolved_dict()`` reports). The record reaching a
    scheduler (``TreeCacheBuildContext.server_args``) carries its decisions; an unresolved
    record or an argparse namespace gives the raw value."""
    from sglang.srt.arg_groups.overrides import resolution_result

    value = resolution_result(args, name, default)
    return default if value is None and default is not None else value


def server_view(obj) -> ServerView:
    """The options relay depends on, as SGLang resolved them, from a ServerArgs (resolved
    or not), an argparse namespace of its fields, or a TreeCacheBuildContext."""
    args = getattr(obj, "server_args", obj)

    def get(name, default):
        return resolved_value(args, name, default)

    hybrid = any(getattr(obj, f, False) for f in ("is_hybrid_swa", "is_hybrid_ssm", "is_dsa"))
    return ServerView(
        model_path=str(get("model_path", "")),
        tp_size=int(get("tp_size", 1)),
        pp_size=int(get("pp_size", 1)),
        dp_size=int(get("dp_size", 1)),
        enable_dp_attention=bool(get("enable_dp_attention", False)),
        attn_dp_size=int(get("attn_dp_size", 1) or 1),
        page_size=int(get("page_size", 1) or 1),
        kv_cache_dtype=str(get("kv_cache_dtype", "auto")),
        quantization=get("quantization", None) or quantization_of(obj),
        load_format=str(get("load_format", "auto")),
        speculative_algorithm=get("speculative_algorithm", None),
        enable_lora=bool(get("enable_lora", False)) or bool(get("lora_paths", None)),
        lora_backend=str(get("lora_backend", "csgmv") or "csgmv"),
        enable_hierarchical_cache=bool(get("enable_hierarchical_cache", False)),
        disaggregation_mode=str(get("disaggregation_mode", "null")),
        enable_deterministic_inference=bool(get("enable_deterministic_inference", False)),
        enable_torch_compile=bool(get("enable_torch_compile", False)),
        disable_radix_cache=bool(get("disable_radix_cache", False)),
        dllm_algorithm=get("dllm_algorithm", None),
        enable_hisparse=bool(get("enable_hisparse", False)),
        hybrid_model=hybrid,
        enable_pdmux=bool(get("enable_pdmux", False)),
        attn_cp_size=int(get("attn_cp_size", 1) or 1),
        enable_prefill_cp=bool(get("enable_prefill_cp", False)),
        dcp_size=int(get("dcp_size", 1) or 1),
        enable_attn_tp_input_scattered=bool(get("enable_attn_tp_input_scattered", False)),
        enable_layernorm_sp=bool(get("enable_layernorm_sp", False)),
        prefill_only_disable_kv_cache=bool(get("prefill_only_disable_kv_cache", False)),
    )


def live_kv_layout(ctx) -> tuple[int, str, str, bool]:
    """(page size, KV buffer dtype, model dtype, scaled) of the pools a
    TreeCacheBuildContext hands the cache: what the allocator and the KV pool really use,
    whatever the arguments said (a checkpoint's own FP8 KV scheme resolves
    ``--kv-cache-dtype auto`` to FP8 in the model runner). ``scaled``: the pool keeps
    quantization scales beside its elements (SGLang's ``is_quantized_kv_cache`` methods)."""
    allocator = ctx.params.token_to_kv_pool_allocator
    page = max(int(ctx.params.page_size or 1), int(getattr(allocator, "page_size", 1) or 1))
    pool = allocator.get_kvcache()
    scaled = bool(getattr(pool, "is_quantized_kv_cache", False)) or (
        getattr(pool, "k_scale_buffer", None) is not None
    )
    return (
        page,
        str(pool.dtype).removeprefix("torch."),
        str(ctx.model_config.dtype).removeprefix("torch."),
        scaled,
    )


def reasoning_end_ids(model_config, req=None) -> tuple[int, ...] | None:
    """The token ids of the reasoning end marker (``</think>``) of ``req``'s output: the
    request's own (SGLang's per-request ``__sglang_reasoning_end_token_ids``, set by its
    chat renderer), counted as SGLang's reasoning accounting counts it (only one of the
    model's selectable sequences), else the served model's, set on the scheduler's model
    config when the server runs ``--reasoning-parser``; None without either. Read when an
    output is recorded (the scheduler sets them after the cache is built)."""
    if req is not None:
        from sglang.srt.sampling.sampling_params import get_request_reasoning_end_token_ids

        ids = get_request_reasoning_end_token_ids(
            getattr(req.sampling_params, "custom_params", None),
            allowed_sequences=getattr(
                model_config, "request_selectable_think_end_id_sequences", None
            ),
        )
        if ids:
            return tuple(int(i) for i in ids)
    ids = getattr(model_config, "think_end_ids", None)
    return tuple(int(i) for i in ids) if ids else None


def quantization_of(obj) -> str | None:
    """A pre-quantized checkpoint's method (ServerArgs.quantization stays None for it)."""
    config = getattr(obj, "model_config", None)
    return getattr(config, "quantization", None) if config is not None else None


# ---- the surface: what the plug-in reads of SGLang's objects -------------------------------
# Attribute names per SGLang type, checked where an instance first appears (start-up for the
# model runner and the dataclasses; the first planned request and the first admission for
# the scheduler's objects). A missing name fails loudly, never as "nothing relayed".
SURFACE: dict[str, tuple[str, ...]] = {
    "ModelRunner": (
        "model", "token_to_kv_pool", "req_to_token_pool", "server_args",
        "decode_cuda_graph_captured",
    ),
    "ModelRunnerOutput": ("can_run_graph",),
    "ForwardBatch": (
        "forward_mode", "rids", "out_cache_loc", "positions", "req_pool_indices", "seq_lens",
        "extend_prefix_lens_cpu", "extend_seq_lens_cpu",
    ),
    "ScheduleBatch": ("reqs", "tree_cache", "forward_mode"),
    "Req": (
        "rid", "prefix_len", "extend_len", "origin_input_ids", "output_ids",
        "full_untruncated_fill_ids", "get_fill_ids", "finished", "kv", "extra_key",
        "cache_salt", "return_logprob", "logprob_start_len", "multimodal_inputs",
        "sampling_params", "customized_info", "session_id", "return_hidden_states", "lora_id",
    ),
    # a row subset's LoRA info (runtime/lora_rows.py; read and replaced on backend.batch_info)
    "TorchNativeLoRABatchInfo": (
        "bs", "num_segments", "max_len", "seg_lens", "seg_indptr", "weight_indices",
        "seg_lens_cpu", "seg_indptr_cpu", "weight_indices_cpu", "expected_tokens", "permutation",
    ),
    # the DP controller's routing namespace (tokenized_isolation)
    "TokenizedGenerateReqInput": ("input_ids", "extra_key", "lora_id", "cache_salt"),
    "PrefillAdder": ("tree_cache", "can_run_list"),
    "GroupCoordinator": ("world_size", "rank_in_group", "cpu_group", "all_reduce"),
    "KVCacheConfigurator": ("server_args", "model_config", "model_dtype", "is_draft_worker"),
    "MemoryPoolConfig": ("max_total_num_tokens",),
    "DataParallelController": ("dp_budget", "_active_workers", "refresh_load_budget"),
    "DataParallelControllerLoop": (
        "recv_from_tokenizer", "_request_dispatcher", "soft_watchdog",
    ),
    "TreeCacheBuildContext": (
        "server_args", "params", "model_config", "tp_worker", "is_hybrid_swa", "is_hybrid_ssm",
    ),
    # the early-stop guard (runtime/guard.py), in the tokenizer manager
    "TokenizerManager": ("generate_request", "abort_request", "server_args", "model_config"),
    "TokenizerModelConfig": ("num_hidden_layers", "vocab_size"),
    "GenerateReqInput": ("rid", "sampling_params", "session_params", "stream"),
    "ReqState": ("time_stats",),
    "ReqTimeStats": ("created_time", "first_token_time"),
}  # fmt: skip


def missing_surface(kind: str, obj) -> list[str]:
    """Names of ``SURFACE[kind]`` that ``obj`` (an instance or a dataclass) lacks."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else None
    return [a for a in SURFACE[kind] if not (hasattr(obj, a) or (names and a in names))]


def check_surface(kind: str, obj) -> None:
    missing = missing_surface(kind, obj)
    if missing:
        raise RuntimeError(
            f"sglang-relay: SGLang {SGLANG_VERSION}'s {kind} lacks {', '.join(missing)}; this "
            "sglang-relay release does not support it (see runtime/compat.py SURFACE)"
        )


def lora_backend(model_runner):
    """SGLang's LoRA backend of a model runner serving LoRA (its layers read
    ``backend.batch_info``), else None."""
    manager = getattr(model_runner, "lora_manager", None)
    return None if manager is None else manager.lora_backend


def check_router_surface() -> None:
    """The DP controller's start-up check: the tokenized request it routes by namespace."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    check_surface("TokenizedGenerateReqInput", TokenizedGenerateReqInput)


def check_startup_surface(ctx, model_runner) -> None:
    """The parts of the contract checkable before any request: fail the start-up if not."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.sampling.sampling_params import (  # noqa: F401 - reasoning_end_ids
        get_request_reasoning_end_token_ids,
    )

    check_surface("TreeCacheBuildContext", ctx)
    check_surface("ModelRunner", model_runner)
    check_surface("ModelRunnerOutput", ModelRunnerOutput)
    check_surface("ForwardBatch", ForwardBatch)
    check_surface("ScheduleBatch", ScheduleBatch)


# ---- the served model ----------------------------------------------------------------------
def inner_model(model_runner):
    """The decoder stack (``LlamaModel`` / ``Qwen2Model``) of the runner's model."""
    outer = model_runner.model
    return getattr(outer, "model", outer)


def check_model_anatomy(model_runner) -> None:
    """Fail loudly unless the served decoder stack has exactly the modules its
    architecture's adapter drives (``runtime/anatomy.py``), in every layer."""
    from sglang_relay.runtime.anatomy import anatomy_of, anatomy_problems

    architecture = type(model_runner.model).__name__
    problems = anatomy_problems(anatomy_of(architecture), inner_model(model_runner), SUPPORTED_ROPE)
    if problems:
        raise ValueError(
            f"sglang-relay cannot run the layer loop of this {architecture} model: "
            + "; ".join(problems[:4])
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        )


_TP_GROUP: list = []  # this process's TP group, looked up once (it is called per layer)


def apply_qk_norm(attn_mod, q, k):
    """SGLang's own per-head q/k RMSNorm (``models.utils.apply_qk_norm``), as the
    non-fused path of a Qwen3-style attention block runs it before RoPE."""
    from sglang.srt.models.utils import apply_qk_norm as norm

    alt_stream = getattr(attn_mod, "alt_stream", None)
    return norm(q=q, k=k, q_norm=attn_mod.q_norm, k_norm=attn_mod.k_norm,
                head_dim=attn_mod.head_dim, alt_stream=alt_stream)  # fmt: skip


def tp_group():
    """SGLang's tensor-parallel GroupCoordinator of this process, or None under tp 1."""
    if _TP_GROUP:
        return _TP_GROUP[0]
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group is None:  # not initialised yet: ask again next time
        return None
    if int(group.world_size) > 1:
        check_surface("GroupCoordinator", group)
    _TP_GROUP.append(group if int(group.world_size) > 1 else None)
    return _TP_GROUP[0]


def finish_row_parallel(linear, out):
    """The TP sum of a row-parallel linear's partial output. SGLang 0.5.23 builds a dense
    layer's ``o_proj`` / ``down_proj`` with ``reduce_results=False`` and all-reduces in its
    layer boundaries (``layers/layer_boundary``); the relay loops call the modules
    themselves, so they reduce here (a no-op under tp 1)."""
    if getattr(linear, "reduce_results", True):
        return out
    group = tp_group()
    return out if group is None else group.all_reduce(out)


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


def decode_graphs_captured(model_runner) -> bool:
    """Whether the runner captured decode graphs (CUDA graphs or the CPU graph runner)."""
    return bool(model_runner.decode_cuda_graph_captured)


def dp_loads(controller) -> tuple[list[int], list[int]]:
    """(running + waiting requests per DP rank, the ranks that take work) as SGLang's
    controller sees them (its load snapshot, refreshed at most every 20 ms)."""
    check_surface("DataParallelController", controller)
    controller.refresh_load_budget()
    return list(controller.dp_budget.total_requests), list(controller._active_workers)


def dp_controller_receiver(controller):
    """(the controller's socket from the tokenizer, receive one message without blocking,
    dispatch one message, feed the controller's soft watchdog), for an event loop that
    waits on the socket (:func:`sglang_relay.runtime.dp_routing.blocking_event_loop`)."""
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    check_surface("DataParallelControllerLoop", controller)
    sock = controller.recv_from_tokenizer

    def recv():
        return dpc.sock_recv(sock, flags=zmq.NOBLOCK)

    return sock, recv, controller._request_dispatcher, controller.soft_watchdog.feed


DP_ROUTE_KEY = "__sglang_relay_dp_route"  # private custom_params key: controller -> rank


def tag_dp_route(req, decision: str) -> None:
    """Record the DP controller's routing decision on a tokenized request."""
    sp = req.sampling_params
    params = sp.custom_params if isinstance(sp.custom_params, dict) else {}
    params[DP_ROUTE_KEY] = decision
    sp.custom_params = params


GUARD_KEY = "__sglang_relay_guard"  # private custom_params key: guard redo -> scheduler


def guard_redo_of(req) -> dict | None:
    """The early-stop guard's note on a scheduler request that redoes a relayed one
    (``{"of": rid, "reused_tokens": n}``), else None. The tokenizer removes private keys
    from client requests (:mod:`.trust`); a note not shaped as the guard writes it is
    ignored here all the same, never raised on (a scheduler exception ends the server)."""
    params = getattr(req.sampling_params, "custom_params", None)
    note = params.get(GUARD_KEY) if isinstance(params, dict) else None
    if not isinstance(note, dict):
        return None
    of, n = note.get("of"), note.get("reused_tokens")
    if not isinstance(of, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return None
    return {"of": of[:256], "reused_tokens": min(n, 1 << 40)}


def check_tokenizer_surface(manager, state) -> None:
    """The tokenizer manager's part of the contract (the early-stop guard and the
    server-measured TTFT), checked on a relay server's first response."""
    check_surface("TokenizerManager", manager)
    check_surface("ReqState", state)
    check_surface("ReqTimeStats", state.time_stats)


def submit_request(manager, obj, request):
    """Send a new generate request through the tokenizer manager as the HTTP server
    would; its responses (an async generator)."""
    check_surface("GenerateReqInput", obj)
    return manager.generate_request(obj, request)


def request_times(state) -> tuple[float, float] | None:
    """(arrival, first output) of a tokenizer-manager request state, on the monotonic
    clock SGLang stamps them with (``time.perf_counter``); None before its first output."""
    stats = getattr(state, "time_stats", None)
    created = getattr(stats, "created_time", 0.0)
    first = getattr(stats, "first_token_time", 0.0)
    return (float(created), float(first)) if created and first else None


def scheduler_times_sent(manager) -> bool:
    """Whether the schedulers send their per-request time stats (``--enable-metrics``), the
    only source of a non-streamed request's first-token time in the tokenizer manager."""
    return bool(getattr(manager.server_args, "enable_metrics", False))


# every routing decision the DP controller tags (runtime/dp_routing.py): a fixed label set
DP_DECISIONS = frozenset(
    {"matched", "key", "explicit", "fallback", "fallback_overloaded", "fallback_error"}
)


def dp_route(req) -> str | None:
    """The DP controller's routing decision for a scheduler request (None: no DP routing,
    or a value the controller does not write)."""
    params = getattr(req.sampling_params, "custom_params", None)
    route = params.get(DP_ROUTE_KEY) if isinstance(params, dict) else None
    return route if isinstance(route, str) and route in DP_DECISIONS else None


def dp_rank() -> tuple[int, int]:
    """(this scheduler's DP rank, its TP rank)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.dp_rank or 0), int(parallel.tp_rank or 0)


def forward_mode_name(fb) -> str:
    """``EXTEND``, ``DECODE``, ``MIXED``, ``TARGET_VERIFY``, ... of a ForwardBatch."""
    return fb.forward_mode.name


def evict_result():
    from sglang.srt.mem_cache.base_prefix_cache import EvictResult

    return EvictResult()


# ---- requests ------------------------------------------------------------------------------
class IsolationError(ValueError):
    """A scheduler request whose ``extra_key`` cannot be split into the user's key and its
    LoRA adapter id: it neither stores nor reuses spans."""


def request_isolation(req, lora: str = "adapter") -> tuple:
    """SGLang's cache isolation keys of a scheduler ``Req``: ``(extra_key the user set,
    LoRA adapter id, cache_salt)``. ``Req.__init__`` stores ``extra_key`` as the user's
    key with the adapter id appended and keeps ``lora_id`` apart, so the two are split
    here (a concatenation would let ``"x" + id`` under the base model meet ``"x"`` under
    the adapter). ``lora``: ``"adapter"`` keeps adapters apart, ``"shared"`` drops the id.
    Raises :class:`IsolationError` if the key does not end with the id."""
    key, lora_id = req.extra_key or None, getattr(req, "lora_id", None) or None
    if lora_id is not None:
        if key is None or not key.endswith(lora_id):
            raise IsolationError("extra_key does not end with the request's lora_id")
        key = key[: len(key) - len(lora_id)] or None
    return _isolation(key, lora_id, req.cache_salt, lora)


def tokenized_isolation(recv, lora: str = "adapter") -> tuple:
    """The same keys of a tokenized request (``TokenizedGenerateReqInput``, where the DP
    controller routes it): it carries ``extra_key`` and ``lora_id`` as separate fields.
    An embedding request has no ``extra_key`` (AttributeError: the router leaves it to
    SGLang's own routing, counted)."""
    return _isolation(recv.extra_key or None, recv.lora_id or None, recv.cache_salt, lora)


def _isolation(key, lora_id, salt, lora: str) -> tuple:
    return (key, lora_id if lora == "adapter" else None, salt)


def request_refusal(req) -> str | None:
    """Why this request must not relay (it runs standard prefill), else None."""
    # SGLang sets logprob_start_len to the input length for output-only logprobs; -1 asks
    # for none; anything inside the prompt asks for input-token logprobs
    if req.return_logprob and 0 <= req.logprob_start_len < len(req.origin_input_ids) - 1:
        return "input_logprobs"
    if getattr(req, "return_hidden_states", False):
        return "return_hidden_states"
    if getattr(req, "input_embeds", None) is not None or req.multimodal_inputs is not None:
        return "unsupported_input"
    if getattr(req, "session_id", None) is not None:
        return "session"  # the row becomes the next turn's exact prefix
    if beam_search(req):
        return "beam_search"
    return None


def beam_search(req) -> bool:
    """Beam requests share slots between rows (SGLang remaps them): never relay or record."""
    return (getattr(req.sampling_params, "beam_width", 1) or 1) > 1


def extend_chunk(req) -> tuple[list[int], int, bool]:
    """The tokens this extend computes, the row position of the first, and whether the
    chunk ends the request's input (chunked prefill truncates ``get_fill_ids()`` to the
    chunk, so the full length comes from the untruncated ids)."""
    start = req.prefix_len
    end = start + req.extend_len
    tokens = list(req.get_fill_ids()[start:end])
    total = len(req.origin_input_ids) + len(req.output_ids)
    return tokens, start, end >= total


def remaining_input(req, limit: int | None = None) -> list[int]:
    """The input tokens a waiting request still has to prefill (after its prefix match),
    at most ``limit`` of them."""
    end = None if limit is None else req.prefix_len + limit
    return list(req.full_untruncated_fill_ids[req.prefix_len : end])


def chunk_size(model_runner) -> int | None:
    """The prefill chunk size SGLang resolved (``--chunked-prefill-size``, or its default
    when unset: 4096 on a CPU); None when prefill is not chunked."""
    size = resolved_value(model_runner.server_args, "chunked_prefill_size")
    return int(size) if size is not None and int(size) > 0 else None


def adder_tree_cache(adder):
    """The tree cache of a ``PrefillAdder``."""
    return adder.tree_cache


def adder_admitted(adder) -> list:
    """Requests a ``PrefillAdder`` admitted to the batch so far."""
    return adder.can_run_list


def add_req_stop():
    """``add_one_req``'s "stop adding to this batch" result (the request stays queued)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult.OTHER


def set_request_info(req, info: dict) -> None:
    """Publish ``info`` as the request's ``meta_info["relay"]`` (request-level info)."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info["relay"] = [info]


# ---- hooks ---------------------------------------------------------------------------------
def _resolve(target: str):
    import importlib

    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(target)


def hook_installed(target: str, hook) -> bool:
    """Whether ``hook`` wraps ``target`` now (walks the hook registry's wrapper chain)."""
    fn = _resolve(target)
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is hook for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


_REGISTERED: list[tuple[str, object]] = []


def register_hook(target: str, hook, kind: str) -> None:
    """Register ``hook`` on ``target`` (``before``/``after``/``around``) and remember it for
    :func:`check_hooks_installed`."""
    registry, hook_type = hook_registry()
    registry.register(target, hook, getattr(hook_type, kind.upper()))
    _REGISTERED.append((target, hook))


def check_hooks_installed() -> None:
    """Raise unless every hook the plug-in registered wraps its target in this process."""
    missing = [t for t, h in _REGISTERED if not hook_installed(t, h)]
    if not _REGISTERED or missing:
        raise RuntimeError(
            "sglang-relay hooks are not installed"
            + (f" ({', '.join(missing)})" if missing else " (register() never ran)")
            + "; is the plug-in loaded (pip show sglang-relay, SGLANG_PLUGINS)?"
        )
