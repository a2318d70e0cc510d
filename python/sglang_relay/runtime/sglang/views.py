"""The contract: what relay reads of each SGLang object, checked where an instance first
appears (start-up for the model runner and the dataclasses; the first planned request and
the first admission for the scheduler's objects). A missing name fails loudly, never as
"nothing relayed"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from sglang_relay.runtime.sglang import SGLANG_VERSION

# One view per SGLang object relay reads: the attributes relay touches, typed as relay uses
# them (the annotations document; the check, :func:`check_surface`, is by name). Relay's
# functions that take an SGLang object annotate it with its view (imported for type
# checking only).


class ModelRunner(Protocol):
    """``sglang.srt.model_executor.model_runner.ModelRunner``"""

    model: Any
    token_to_kv_pool: Any
    req_to_token_pool: Any
    server_args: Any
    decode_cuda_graph_captured: bool


class ModelRunnerOutput(Protocol):
    """``sglang.srt.model_executor.model_runner.ModelRunnerOutput``"""

    can_run_graph: bool


class ForwardBatch(Protocol):
    """``sglang.srt.model_executor.forward_batch_info.ForwardBatch``"""

    forward_mode: Any
    rids: list[str] | None
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens_cpu: list[int] | None
    extend_seq_lens_cpu: list[int] | None
    residual_stream: Any  # the layer boundaries' residual (decode.DecodeCapture reads it)


class ScheduleBatch(Protocol):
    """``sglang.srt.managers.schedule_batch.ScheduleBatch``"""

    reqs: list[Req]
    tree_cache: Any
    forward_mode: Any
    out_cache_loc: torch.Tensor | None  # the slots an extend batch writes (host tier)


class Req(Protocol):
    """``sglang.srt.managers.schedule_batch.Req``: a request in the scheduler."""

    rid: str
    prefix_len: int
    extend_len: int
    origin_input_ids: list[int]
    output_ids: list[int]
    full_untruncated_fill_ids: list[int]
    get_fill_ids: Callable[[], list[int]]
    finished: Callable[[], bool]
    kv: Any
    extra_key: str | None
    cache_salt: str | None
    return_logprob: bool
    logprob_start_len: int
    multimodal_inputs: Any
    sampling_params: Any
    customized_info: dict[str, Any] | None
    session_id: str | None
    return_hidden_states: bool
    lora_id: str | None


class TorchNativeLoRABatchInfo(Protocol):
    """A LoRA backend's ``batch_info``: read and replaced for a row subset
    (``runtime/forward/lora_rows.py``)."""

    bs: int
    num_segments: int
    max_len: int
    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    seg_lens_cpu: torch.Tensor
    seg_indptr_cpu: torch.Tensor
    weight_indices_cpu: torch.Tensor
    expected_tokens: int
    permutation: torch.Tensor | None


class TokenizedGenerateReqInput(Protocol):
    """``sglang.srt.managers.io_struct.TokenizedGenerateReqInput``: what the DP controller
    routes by namespace."""

    input_ids: list[int]
    extra_key: str | None
    lora_id: str | None
    cache_salt: str | None


class PrefillAdder(Protocol):
    """``sglang.srt.managers.schedule_policy.PrefillAdder``"""

    tree_cache: Any
    can_run_list: list[Req]


class GroupCoordinator(Protocol):
    """``sglang.srt.distributed.parallel_state.GroupCoordinator`` (TP > 1)"""

    world_size: int
    rank_in_group: int
    cpu_group: Any
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


class KVCacheConfigurator(Protocol):
    """``sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator``"""

    server_args: Any
    model_config: Any
    model_dtype: Any
    is_draft_worker: bool


class MemoryPoolConfig(Protocol):
    """What ``KVCacheConfigurator.config_from_budget`` returns."""

    max_total_num_tokens: int


class DataParallelController(Protocol):
    """``sglang.srt.managers.data_parallel_controller.DataParallelController``: its load."""

    dp_budget: Any
    _active_workers: list[int]
    refresh_load_budget: Callable[[], None]


class DataParallelControllerLoop(Protocol):
    """The same controller, as the CPU stand-in's blocking event loop reads it."""

    recv_from_tokenizer: Any
    _request_dispatcher: Callable[[Any], Any]
    soft_watchdog: Any


class TreeCacheBuildContext(Protocol):
    """``sglang.srt.mem_cache.registry``'s build context of a radix cache backend."""

    server_args: Any
    params: Any
    model_config: Any
    tp_worker: Any
    is_hybrid_swa: bool
    is_hybrid_ssm: bool


class TokenizerManager(Protocol):
    """``sglang.srt.managers.tokenizer_manager.TokenizerManager`` (the early-stop guard)."""

    generate_request: Callable[..., Any]
    abort_request: Callable[..., Any]
    server_args: Any
    model_config: Any


class TokenizerModelConfig(Protocol):
    """The tokenizer manager's ``model_config``."""

    num_hidden_layers: int
    vocab_size: int


class GenerateReqInput(Protocol):
    """``sglang.srt.managers.io_struct.GenerateReqInput``"""

    rid: str | list[str] | None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None
    session_params: Any
    stream: bool


class ReqState(Protocol):
    """The tokenizer manager's state of one request."""

    time_stats: ReqTimeStats


class ReqTimeStats(Protocol):
    """Its time stamps (``time.perf_counter``)."""

    created_time: float
    first_token_time: float


class HiCacheController(Protocol):
    """``sglang.srt.managers.cache_controller.HiCacheController`` (the relay host tier
    moves span KV with its transfer engine, its index rule and its layer count)."""

    l2_transfer_engine: Any
    io_backend: str
    device: Any
    move_indices: Callable[..., Any]
    _move_op_indices: Callable[..., Any]
    _move_write_operation: Callable[..., Any]
    transfer_layer_id_max: int


class HostKVCache(Protocol):
    """``sglang.srt.mem_cache.pool_host.base.HostKVCache``: the relay host tier's pool."""

    size: int
    page_size: int
    layout: str
    kv_buffer: (
        torch.Tensor
    )  # read by span shipping (runtime/scale/ship/pages.py): [2, L, size, ...]
    dtype: torch.dtype
    layer_num: int
    head_num: int
    head_dim: int
    alloc: Callable[[int], torch.Tensor | None]
    free: Callable[[torch.Tensor], int]
    available_size: Callable[[], int]


VIEWS: dict[str, type] = {
    view.__name__: view
    for view in (
        ModelRunner, ModelRunnerOutput, ForwardBatch, ScheduleBatch, Req,
        TorchNativeLoRABatchInfo, TokenizedGenerateReqInput, PrefillAdder, GroupCoordinator,
        KVCacheConfigurator, MemoryPoolConfig, DataParallelController,
        DataParallelControllerLoop, TreeCacheBuildContext, TokenizerManager,
        TokenizerModelConfig, GenerateReqInput, ReqState, ReqTimeStats, HiCacheController,
        HostKVCache,
    )
}  # fmt: skip


def attributes(kind: str) -> tuple[str, ...]:
    """The attributes relay reads of SGLang's ``kind`` (its view's annotated names)."""
    return tuple(VIEWS[kind].__annotations__)


def missing_surface(kind: str, obj) -> list[str]:
    """The attributes of ``kind``'s view that ``obj`` (an instance or a dataclass) lacks."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else None
    return [a for a in attributes(kind) if not (hasattr(obj, a) or (names and a in names))]


def check_surface(kind: str, obj) -> None:
    missing = missing_surface(kind, obj)
    if missing:
        raise RuntimeError(
            f"sglang-relay: SGLang {SGLANG_VERSION}'s {kind} lacks {', '.join(missing)}; this "
            "sglang-relay release does not support it (see runtime/sglang/views.py)"
        )


def check_router_surface() -> None:
    """The DP controller's start-up check: the tokenized request it routes by namespace."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    check_surface("TokenizedGenerateReqInput", TokenizedGenerateReqInput)


def check_startup_surface(ctx, model_runner) -> None:
    """The parts of the contract checkable before any request: fail the start-up if not."""
    from sglang.srt.layers.layer_boundary.residual.batch import (  # noqa: F401
        written_residual,  # model.attention_entry_residual
    )
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.models.utils import apply_qk_norm  # noqa: F401 - anatomy.apply_qk_norm
    from sglang.srt.sampling.sampling_params import (  # noqa: F401 - reasoning_end_ids
        get_request_reasoning_end_token_ids,
    )

    check_surface("TreeCacheBuildContext", ctx)
    check_surface("ModelRunner", model_runner)
    check_surface("ModelRunnerOutput", ModelRunnerOutput)
    check_surface("ForwardBatch", ForwardBatch)
    check_surface("ScheduleBatch", ScheduleBatch)


def check_tokenizer_surface(manager, state) -> None:
    """The tokenizer manager's part of the contract (the early-stop guard and the
    server-measured TTFT), checked on a relay server's first response."""
    check_surface("TokenizerManager", manager)
    check_surface("ReqState", state)
    check_surface("ReqTimeStats", state.time_stats)
