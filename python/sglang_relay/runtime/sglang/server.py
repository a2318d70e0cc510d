"""SGLang's launcher and its options as SGLang resolved them (``ServerArgs``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sglang_relay.runtime.sglang.server_view import ServerView

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import ModelRunner, TreeCacheBuildContext


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


def attention_backend_name(model_runner: ModelRunner) -> str | None:
    """The attention backend the runner resolved for prefill (``--attention-backend`` or
    SGLang's platform default); the raw ``ServerArgs`` value when the runner has none."""
    resolved = getattr(model_runner, "prefill_attention_backend_str", None)
    if resolved:
        return resolved
    args = getattr(model_runner, "server_args", None)
    return getattr(args, "attention_backend", None)


def cuda_graphs_enabled(model_runner: ModelRunner, phase: str) -> bool:
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


def torch_compile_enabled(model_runner: ModelRunner = None) -> bool:
    """Whether this server compiles its decode forwards (``--enable-torch-compile``: the
    CPU graph runner on a CPU)."""
    from sglang.srt.runtime_context import get_flags

    try:
        return bool(get_flags().capture.enable_torch_compile)
    except (ValueError, AttributeError):  # not published (e.g. outside a scheduler)
        args = getattr(model_runner, "server_args", None)
        return bool(getattr(args, "enable_torch_compile", False))


def load_sglang_plugins() -> None:
    """SGLang's general plug-ins (relay's ``register`` among them) run and their hooks
    applied in this process, as every SGLang process does first; once per process (SGLang's
    own guard), and inherited by a process forked after it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


# SGLang's general plug-ins (entry-point group ``sglang.srt.plugins``) whose ``register`` only
# registers hooks, chosen from the environment: relay's two (the plug-in and its CPU
# stand-in, which also patches SGLang's CPU paths as its environment asks), the two of
# smg-grpc-servicer (an SGLang dependency). Loaded in a process its children fork from, they
# give the children what loading them in each child gives; an unknown plug-in might start a
# thread or read which process it runs in, so with one installed each child loads the
# plug-ins itself.
ENV_ONLY_PLUGINS = frozenset({"relay", "relay-cpu", "smg-servicer", "smg-zmq"})


def installed_general_plugins() -> set[str]:
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    return {ep.name for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}


def plugins_load_once_for_children(installed: set[str]) -> bool:
    """Whether a process the server's children fork from may load the plug-ins for them."""
    return installed <= ENV_ONLY_PLUGINS


def import_server_modules() -> None:
    """Import what :func:`run_http_server` runs (SGLang's HTTP server, its engine and
    launcher), without loading the plug-ins or starting anything."""
    import sglang.launch_server  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401


def import_http_server() -> None:
    """:func:`import_server_modules`, then the plug-ins loaded."""
    import_server_modules()
    load_sglang_plugins()


def run_http_server(argv: list[str]) -> None:
    """SGLang's own HTTP server for ``argv`` (plug-ins loaded first); kills its children on
    exit. Refuses, before any process is spawned, a configuration relay cannot serve."""
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_sglang_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def server_parser(prog: str = "sglang-relay serve"):
    """SGLang's server argument parser as its launcher builds it: SGLang's plugins loaded
    first (its entry points load them before they parse), since a plugin may add options
    (smg-grpc-servicer adds ``--servicer-impl``) or choices (relay's CPU quantization
    stand-in adds a ``--quantization``)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    load_sglang_plugins()
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str]):
    """SGLang's own parse of ``argv`` as given (argparse namespace with ServerArgs field
    names), before resolution: what the user asked for, without SGLang's checks of other
    options (which would refuse some flags with a less useful message first)."""
    return server_parser().parse_args(argv)


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


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


def server_view(obj) -> ServerView:
    """The options relay depends on, as SGLang resolved them, from a ServerArgs (resolved
    or not), an argparse namespace of its fields, or a TreeCacheBuildContext."""
    args = getattr(obj, "server_args", obj)

    def get(name, default):
        return resolved_value(args, name, default)

    hybrid = any(getattr(obj, f, False) for f in ("is_hybrid_ssm", "is_dsa"))
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
        bnb_8bit=bool(checkpoint_quantization(str(get("model_path", ""))).get("load_in_8bit")),
        load_format=str(get("load_format", "auto")),
        speculative_algorithm=get("speculative_algorithm", None),
        speculative_eagle_topk=_int_or_none(get("speculative_eagle_topk", None)),
        speculative_num_steps=_int_or_none(get("speculative_num_steps", None)),
        device=str(get("device", "") or ""),
        disable_overlap_schedule=bool(get("disable_overlap_schedule", False)),
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
        hybrid_swa=bool(getattr(obj, "is_hybrid_swa", False)),
        enable_pdmux=bool(get("enable_pdmux", False)),
        attn_cp_size=int(get("attn_cp_size", 1) or 1),
        enable_prefill_cp=bool(get("enable_prefill_cp", False)),
        dcp_size=int(get("dcp_size", 1) or 1),
        enable_attn_tp_input_scattered=bool(get("enable_attn_tp_input_scattered", False)),
        enable_layernorm_sp=bool(get("enable_layernorm_sp", False)),
        prefill_only_disable_kv_cache=bool(get("prefill_only_disable_kv_cache", False)),
    )


def live_kv_layout(ctx: TreeCacheBuildContext) -> tuple[int, str, str, bool]:
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


def checkpoint_quantization(model_path: str) -> dict:
    """The ``quantization_config`` of the checkpoint at ``model_path`` ({} when it has none
    or is not a local directory)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else {}


def quantization_of(obj) -> str | None:
    """A pre-quantized checkpoint's method (ServerArgs.quantization stays None for it)."""
    config = getattr(obj, "model_config", None)
    return getattr(config, "quantization", None) if config is not None else None


def chunk_size(model_runner: ModelRunner) -> int | None:
    """The prefill chunk size SGLang resolved (``--chunked-prefill-size``, or its default
    when unset: 4096 on a CPU); None when prefill is not chunked."""
    size = resolved_value(model_runner.server_args, "chunked_prefill_size")
    return int(size) if size is not None and int(size) > 0 else None


def per_child_process_setup(server_args) -> str | None:
    """What SGLang sets up per child process at its start (a NUMA binding through the
    interpreter it executes, one visible device per process, the memory saver's preload),
    which a child forked from a preloaded process would not get; None when nothing is."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.numa_utils import get_numa_node_if_available

    ranks = server_args.tp_size * server_args.pp_size
    gpu_ids = [server_args.base_gpu_id + r * server_args.gpu_id_step for r in range(ranks)]
    if envs.SGLANG_NUMA_BIND_V2.get() and any(
        get_numa_node_if_available(server_args, g) is not None for g in gpu_ids
    ):
        return "a NUMA binding (--numa-node, SGLANG_AUTO_NUMA_BIND)"
    if envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get():
        return "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"
    if getattr(server_args, "enable_memory_saver", False):
        return "--enable-memory-saver"
    return None
