"""The SGLang functions relay wraps, as dotted targets for SGLang's hook registry
(``sglang.srt.plugins.hook_registry``). The model forwards relay may take over are named per
architecture by the adapters (``runtime/models/anatomy.py``: ``MODEL_FORWARD_TARGETS``)."""

from __future__ import annotations

INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)


PREPARE_FOR_EXTEND_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"


MIX_WITH_RUNNING_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running"


ADD_ONE_REQ_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"


REQUEST_LEVEL_KEY_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.is_request_level_customized_info_key"
)


META_INFO_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"


# every generate request enters here (HTTP, OpenAI, the guard's redo): relay's trust
# boundary (runtime/sched/trust.py); a ValueError raised here is SGLang's 400
GENERATE_REQUEST_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"


# the tokenizer manager is built: the trust boundary's gate is built with it (a relay
# server whose settings do not resolve there fails start-up, not each request)
TOKENIZER_INIT_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"


# /abort_request: an abort of a request also reaches its guard redo (runtime/sched/guard.py)
ABORT_REQUEST_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request"


# every response a client gets (streamed or not) comes out of this async generator; a
# streamed chunk that did not carry new relay info gets SGLang's raw accumulated list
STREAM_RESPONSE_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._stream_one_response"
)


# CPU stand-in only (runtime/standin/cpu.py): model-parallel groups without PyNccl
MODEL_PARALLEL_GROUP_TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


# decode graphs are captured here, before the relay runtime exists: the decode capture is
# installed on the model first (runtime/forward/decode.py)
CAPTURE_DECODE_GRAPH_TARGET = (
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_decode_graph"
)


# every forward of the model runner: counts the decode forwards that replayed a graph
MODEL_RUNNER_FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


# data parallel (runtime/scale/dp_routing.py): the controller launches its ranks in __init__, and
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


# CPU stand-in only (runtime/standin/cpu_graph.py): the CPU graph runner registers fake kernels for
# sgl_kernel CPU ops, which must exist as torch operators first
CPU_GRAPH_FAKE_TARGET = "sglang.srt.model_executor.cpu_graph_runner.register_cpu_compile_fake"


# CPU stand-in only (runtime/standin/cpu_models.py): MiniMax-M2's q/k RMSNorm over all heads
# launches Triton kernels that assert CUDA (no AMX here for its sgl_kernel CPU op)
CPU_MINIMAX_QK_NORM_TARGET = "sglang.srt.models.minimax_m2.MiniMaxM2QKRMSNorm._forward_naive"
# ... DeepSeek-V2/V3 MLA: the registry mapping an attention backend to the forward method its
# attention block takes; torch_native, absent from it, gets Triton's (up-projected MHA for a
# prefill, which torch_native runs over the latent pool rows and fails): the stand-in
# registers the absorbed method for it
CPU_MLA_HANDLER_REGISTRY_TARGET = (
    "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry"
)
# ... gpt-oss: SGLang refuses torch_native for it (no sinks there); the stand-in adds them
CPU_GPT_OSS_BACKEND_CHECK_TARGET = (
    "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"
)
CPU_DECODE_ATTENTION_TARGET = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode"
)


# CPU stand-in only (runtime/standin/cpu_spec.py): torch_native attention has no TARGET_VERIFY path
# (it reads a verify batch as a stale extend and ignores the tree mask); speculative verify
# batches take the stand-in's tree attention, every other batch SGLang's own path
CPU_VERIFY_ATTENTION_TARGET = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)


# CPU stand-in only (runtime/standin/cpu_eagle.py): SGLang's draft backend factory has no
# torch_native draft-extend backend; the stand-in gives it SGLang's TorchNativeAttnBackend
CPU_DRAFT_EXTEND_BACKEND_TARGET = (
    "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
)
# ... nor a multi-step draft-decode one (steps > 1): the stand-in's, for one token a step
CPU_DRAFT_DECODE_BACKEND_TARGET = (
    "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend"
)


# CPU stand-in only, opted in (runtime/standin/cpu.py): SGLang refuses --kv-cache-dtype fp8_e5m2 on
# a CPU here; the stand-in lets its pool hold FP8 as on a GPU, to test relay on FP8 pools
KV_CACHE_DTYPE_TARGET = "sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype"


# the KV pool's byte budget -> token count, for the initial pool and the post-capture resize:
# relay's side memory is taken out of the budget here (:mod:`.budget`)
KV_BUDGET_TARGET = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget"
)


# the KV pool's own KV writes outside any model forward: speculative decoding compacts the
# accepted tokens' KV to the front of each verify window with it (spec_utils.
# move_accept_tokens_to_target_kvcache, and EAGLE's topk > 1 path); the served pool's side
# data follows every move (:meth:`~sglang_relay.runtime.cache.side_data.SlotLedger.move`)
KV_MOVE_TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.move_kv_cache"


# HiCache's host-to-device copies (a tree load-back, a retracted request's restore): KV
# written into device slots outside any model forward; every such slot is stamped fresh
# first, so a span recorded on it before is seen as gone (side_data.py)
HOST_LOAD_TARGET = "sglang.srt.mem_cache.l2_transfer.L2TransferEngine.submit_host_to_device"

# A PD decode server's retracted request restored from CPU tensors
# (``--disaggregation-decode-retraction-backup cpu_tensor``): KV copied into the row's
# device slots outside any forward; stamped fresh first, as a host load
CPU_RESTORE_TARGET = "sglang.srt.managers.schedule_batch.Req.load_kv_cache"


# the launcher sets SGLang's process environment and start method ("spawn") here, before it
# starts the scheduler and detokenizer processes; on the CPU stand-in those then fork from
# one preloaded process instead (runtime/standin/cpu.py: children_from_forkserver)
PROCESS_START_TARGET = "sglang.srt.entrypoints.engine._set_envs_and_config"
