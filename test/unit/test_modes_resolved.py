"""Refusals read what SGLang resolved, not the raw ServerArgs fields: SGLang 0.5.23 keeps
the fields as typed and appends its own decisions (``srt/arg_groups/overrides.py``), so a
page size an attention backend forces is only visible after resolution; and the relay
cache factory re-checks the live KV pools. The arguments go through SGLang's own parser
and resolution passes; no server is started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_relay.runtime import compat, modes  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_environment():
    """SGLang's resolution exports a few settings (``handle_environment_variables``):
    keep them out of the other tests of the session."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def cpu_args(model_dir):
    """Arguments every resolution here shares: the embedded model on this CPU."""
    from sglang_relay.runtime import cpu

    cpu.activate()
    return ["--model-path", str(model_dir), "--device", "cpu"]


def _record(argv):
    """SGLang's ServerArgs record for ``argv``, unresolved (fields as typed)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(compat.parse_server_args(argv))


def test_a_page_size_trtllm_mha_forces_is_refused(cpu_args):
    """``--attention-backend trtllm_mha`` with no ``--page-size``: SGLang declares 64.
    The whole pipeline (``resolve_once``) refuses trtllm_mha without a Hopper/Blackwell GPU
    right after this pass, so the test runs the pass SGLang runs for it,
    ``_mla_backend_page_constraints`` (in ``handle_attention_backend_compatibility``),
    through SGLang's ``run_post_process_pass``, on the real record."""
    from sglang.srt.arg_groups.overrides import (
        _mla_backend_page_constraints,
        run_post_process_pass,
    )

    args = _record([*cpu_args, "--attention-backend", "trtllm_mha"])
    assert args.page_size is None  # nothing typed
    assert modes.refusal(compat.server_view(args)) is None  # so the raw view saw page 1
    run_post_process_pass(args, _mla_backend_page_constraints)
    assert args.page_size is None  # SGLang leaves the field as typed
    view = compat.server_view(args)
    assert view.page_size == 64
    message = modes.refusal(view)
    assert message is not None and "--page-size 64" in message and "\n" not in message
    assert message.endswith(modes.OUT)


def test_a_page_size_fa4_forces_is_refused(cpu_args, monkeypatch):
    """``--attention-backend fa4`` resolves page 128 on SM100 only; SGLang's own pass
    ``_fa4_page_constraint`` runs here with its platform query answering "SM100" (the one
    thing this CPU cannot be), reading the model's real config for its MLA check."""
    from sglang.srt.arg_groups import overrides

    platform = overrides.get_platform()
    monkeypatch.setattr(
        overrides, "get_platform", lambda: SimpleNamespace(is_sm100=True, is_musa=False)
    )
    args = _record([*cpu_args, "--attention-backend", "fa4"])
    assert modes.refusal(compat.server_view(args)) is None
    overrides.run_post_process_pass(args, overrides._fa4_page_constraint)
    assert not platform.is_sm100 and args.page_size is None
    assert compat.server_view(args).page_size == 128
    message = modes.refusal(compat.server_view(args))
    assert message is not None and "--page-size 128" in message


def test_a_kv_cache_dtype_other_than_the_models_is_refused_after_resolution(cpu_args):
    args = compat.resolved_server_args([*cpu_args, "--kv-cache-dtype", "fp8_e4m3"])
    assert args.resolved_dict()["kv_cache_dtype"] == "fp8_e4m3"
    message = modes.refusal(compat.server_view(args))
    assert message is not None and "--kv-cache-dtype fp8_e4m3" in message
    assert "\n" not in message and message.endswith(modes.OUT)
    # the same server with the model's own KV dtype resolves to a servable view
    plain = compat.resolved_server_args(cpu_args)
    assert modes.refusal(compat.server_view(plain)) is None
    assert compat.server_view(plain).page_size == 1


def test_the_chunk_size_is_the_one_sglang_resolved(cpu_args):
    """``--chunked-prefill-size`` unset resolves to 4096 on a CPU: relay's admission
    window is SGLang's chunk, not "unchunked"."""
    args = compat.resolved_server_args(cpu_args)
    assert args.chunked_prefill_size is None
    assert compat.chunk_size(SimpleNamespace(server_args=args)) == 4096
    typed = compat.resolved_server_args([*cpu_args, "--chunked-prefill-size", "96"])
    assert compat.chunk_size(SimpleNamespace(server_args=typed)) == 96
    unchunked = compat.resolved_server_args([*cpu_args, "--chunked-prefill-size", "-1"])
    assert compat.chunk_size(SimpleNamespace(server_args=unchunked)) is None


def _ctx(allocator, page_size, model_dtype):
    """A TreeCacheBuildContext's parts the live check reads: SGLang's CacheInitParams over
    a real allocator and KV pool, and the model config's dtype."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
    )
    return SimpleNamespace(params=params, model_config=SimpleNamespace(dtype=model_dtype))


def test_the_cache_factory_refuses_live_pools_relay_cannot_own(cpu_args):
    """The scheduler-side check reads the live allocator and KV pool, whatever the
    arguments said: an FP8 KV buffer under a float32 model, or 16-token pages."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def pool(page, dtype):
        return MHATokenToKVPool(64, page, dtype, 1, 8, 1, "cpu", False)

    fp8 = TokenToKVPoolAllocator(
        64, torch.float8_e4m3fn, "cpu", pool(1, torch.float8_e4m3fn), False
    )
    layout = compat.live_kv_layout(_ctx(fp8, 1, torch.float32))
    assert layout == (1, "float8_e4m3fn", "float32")
    message = modes.kv_layout_refusal(*layout)
    assert message is not None and "float8_e4m3fn KV cache for a float32 model" in message
    assert "\n" not in message and message.endswith(modes.OUT)

    paged = PagedTokenToKVPoolAllocator(
        64, 16, torch.float32, "cpu", pool(16, torch.float32), False
    )
    layout = compat.live_kv_layout(_ctx(paged, 16, torch.float32))
    assert layout == (16, "float32", "float32")
    assert "--page-size 16" in modes.kv_layout_refusal(*layout)

    plain = TokenToKVPoolAllocator(64, torch.float32, "cpu", pool(1, torch.float32), False)
    assert modes.kv_layout_refusal(*compat.live_kv_layout(_ctx(plain, 1, torch.float32))) is None
