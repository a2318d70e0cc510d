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

from sglang_relay.runtime.config import modes  # noqa: E402
from sglang_relay.runtime.sglang.server import (
    chunk_size,
    live_kv_layout,
    parse_server_args,
    resolved_server_args,
    server_view,
)


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
    from sglang_relay import cpu_setup as cpu

    cpu.activate()
    return ["--model-path", str(model_dir), "--device", "cpu"]


def _record(argv):
    """SGLang's ServerArgs record for ``argv``, unresolved (fields as typed)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(parse_server_args(argv))


def test_a_page_size_trtllm_mha_forces_is_the_one_relay_sees(cpu_args):
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
    assert modes.refusal(server_view(args)) is None  # so the raw view saw page 1
    run_post_process_pass(args, _mla_backend_page_constraints)
    assert args.page_size is None  # SGLang leaves the field as typed
    view = server_view(args)
    assert view.page_size == 64  # what the allocator will be built with
    assert modes.refusal(view) is None  # pages are served (test_pages.py)


def test_a_page_size_fa4_forces_is_the_one_relay_sees(cpu_args, monkeypatch):
    """``--attention-backend fa4`` resolves page 128 on SM100 only; SGLang's own pass
    ``_fa4_page_constraint`` runs here with its platform query answering "SM100" (the one
    thing this CPU cannot be), reading the model's real config for its MLA check."""
    from sglang.srt.arg_groups import overrides

    platform = overrides.get_platform()
    monkeypatch.setattr(
        overrides, "get_platform", lambda: SimpleNamespace(is_sm100=True, is_musa=False)
    )
    args = _record([*cpu_args, "--attention-backend", "fa4"])
    assert modes.refusal(server_view(args)) is None
    overrides.run_post_process_pass(args, overrides._fa4_page_constraint)
    assert not platform.is_sm100 and args.page_size is None
    assert server_view(args).page_size == 128
    assert modes.refusal(server_view(args)) is None


def test_kv_cache_dtypes_after_resolution(cpu_args):
    """Unscaled FP8 and bf16 KV caches are served; a block-scaled one (mxfp8) is refused
    with one line naming the option."""
    for served in ("fp8_e4m3", "fp8_e5m2", "bf16"):
        args = resolved_server_args([*cpu_args, "--kv-cache-dtype", served])
        assert args.resolved_dict()["kv_cache_dtype"] == served
        assert modes.refusal(server_view(args)) is None, served
    # (SGLang itself refuses mxfp8 off a Blackwell GPU while resolving: the view directly)
    message = modes.refusal(modes.ServerView(kv_cache_dtype="mxfp8"))
    assert message is not None and "--kv-cache-dtype mxfp8" in message
    assert "\n" not in message and message.endswith(modes.OUT)
    plain = resolved_server_args(cpu_args)
    assert modes.refusal(server_view(plain)) is None
    assert server_view(plain).page_size == 1


def test_the_chunk_size_is_the_one_sglang_resolved(cpu_args):
    """``--chunked-prefill-size`` unset resolves to 4096 on a CPU: relay's admission
    window is SGLang's chunk, not "unchunked"."""
    args = resolved_server_args(cpu_args)
    assert args.chunked_prefill_size is None
    assert chunk_size(SimpleNamespace(server_args=args)) == 4096
    typed = resolved_server_args([*cpu_args, "--chunked-prefill-size", "96"])
    assert chunk_size(SimpleNamespace(server_args=typed)) == 96
    unchunked = resolved_server_args([*cpu_args, "--chunked-prefill-size", "-1"])
    assert chunk_size(SimpleNamespace(server_args=unchunked)) is None


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
    arguments said: a scaled KV pool (SGLang's CPU FP8 method keeps scales), a packed
    dtype, or 16-token pages are refused; an unscaled FP8 or bf16 pool under a float32
    model is served."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        get_kv_cache_quant_method,
    )
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def pool(page, dtype, quant=None):
        return MHATokenToKVPool(64, page, dtype, 1, 8, 1, "cpu", False, quant_method=quant)

    def allocator(dtype, quant=None):
        return TokenToKVPoolAllocator(64, dtype, "cpu", pool(1, dtype, quant), False)

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        layout = live_kv_layout(_ctx(allocator(dtype), 1, torch.float32))
        assert layout == (1, str(dtype).removeprefix("torch."), "float32", False)
        assert modes.kv_layout_refusal(*layout) is None

    scaled = allocator(torch.float8_e4m3fn, get_kv_cache_quant_method("cpu_fp8_e4m3"))
    layout = live_kv_layout(_ctx(scaled, 1, torch.float32))
    assert layout == (1, "float8_e4m3fn", "float32", True)
    message = modes.kv_layout_refusal(*layout)
    assert message is not None and "scaled float8_e4m3fn KV cache" in message
    assert "\n" not in message and message.endswith(modes.OUT)
    # a dtype relay does not read as plain elements (an integer pool, as a stand-in)
    message = modes.kv_layout_refusal(1, "uint8", "float32")
    assert message is not None and "uint8 KV cache for a float32 model" in message

    paged = PagedTokenToKVPoolAllocator(
        64, 16, torch.float32, "cpu", pool(16, torch.float32), False
    )
    layout = live_kv_layout(_ctx(paged, 16, torch.float32))
    assert layout == (16, "float32", "float32", False)
    assert modes.kv_layout_refusal(*layout) is None  # pages are served (test_pages.py)

    plain = TokenToKVPoolAllocator(64, torch.float32, "cpu", pool(1, torch.float32), False)
    assert modes.kv_layout_refusal(*live_kv_layout(_ctx(plain, 1, torch.float32))) is None


def test_the_launcher_and_the_cache_factory_refuse_with_one_message(cpu_args):
    """SGLang's own launcher: the plug-in refuses before any child starts (a hook on
    ``_set_envs_and_config``; test_modes.py runs it), and the scheduler's cache factory,
    which would come next, refuses the same record with the same message."""
    from sglang_relay.runtime.plugin import _refuse_before_children
    from sglang_relay.runtime.radix_cache import build_relay_cache

    served = resolved_server_args([*cpu_args, "--radix-cache-backend", "relay"])
    assert _refuse_before_children(served) is None
    plain = resolved_server_args([*cpu_args, "--enable-attn-tp-input-scattered"])
    assert _refuse_before_children(plain) is None  # not a relay server: not relay's to refuse
    argv = [*cpu_args, "--radix-cache-backend", "relay", "--enable-attn-tp-input-scattered"]
    refused = resolved_server_args(argv)
    with pytest.raises(ValueError) as launcher:
        _refuse_before_children(refused)
    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"])
    ctx = SimpleNamespace(server_args=refused, model_config=SimpleNamespace(hf_config=hf_config))
    with pytest.raises(ValueError) as factory:
        build_relay_cache(ctx)
    assert str(launcher.value) == str(factory.value)
    assert "sglang-relay cannot serve --enable-attn-tp-input-scattered" in str(launcher.value)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16])
def test_relays_splice_writes_through_sglangs_kv_pool_views(dtype):
    """SGLang's FP8 pool stores uint8 and hands out float8 views: relay's splice (the
    kernels' dispatcher, as the extend calls it) writes through those views into the
    pool's own storage, keys equal to the float64 rotation of the stored ones rounded
    once (one step at most where float32 and float64 round apart), values bit for bit;
    what SGLang's attention then reads (get_key_buffer) is what relay wrote."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_relay.core.rope import build_cos_sin_cache, delta_cos_sin
    from sglang_relay.runtime.sglang.model import kv_write_loc
    from sglang_relay_kernels import splice_rerotate

    heads, dim, layers, n = 2, 64, 2, 9
    pool = MHATokenToKVPool(64, 1, dtype, heads, dim, layers, "cpu", False)
    gen = torch.Generator().manual_seed(5)
    src, dst = torch.arange(3, 3 + n), torch.arange(30, 30 + n)
    layer = SimpleNamespace(layer_id=0)
    for lid in range(layers):
        layer.layer_id = lid
        k = torch.randn(n, heads, dim, generator=gen) * 3
        v = torch.randn(n, heads, dim, generator=gen)
        pool.set_kv_buffer(layer, kv_write_loc(src), k, v)  # SGLang's own write (rounds)
    delta = torch.randint(-100, 100, (n,), generator=gen)
    cos, sin = delta_cos_sin(build_cos_sin_cache(dim, 256), delta)
    keys = [pool.get_key_buffer(i) for i in range(layers)]
    vals = [pool.get_value_buffer(i) for i in range(layers)]
    before = [
        (kb[src].double().clone(), vb[src].clone()) for kb, vb in zip(keys, vals, strict=True)
    ]
    splice_rerotate(keys, vals, src, dst, cos, sin)

    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = delta.double()[:, None, None] * inv  # [n, 1, dim/2]
    top = torch.finfo(dtype).max
    mant = {torch.float8_e5m2: 2, torch.float8_e4m3fn: 3, torch.bfloat16: 7}[dtype]
    for lid, (k_src, v_src) in enumerate(before):
        x1, x2 = k_src[..., : dim // 2], k_src[..., dim // 2 :]
        rot = torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1)
        want = rot.clamp(-top, top).to(dtype).double()
        got = pool.get_key_buffer(lid)[dst].double()  # what SGLang's attention reads
        step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-3))) - mant)
        assert ((got - want).abs() <= step + 1e-12).all()
        assert (got == want).float().mean() > 0.98
        stored = pool.k_buffer[lid][dst]  # the pool's own storage (uint8 for FP8)
        assert stored.dtype == pool.store_dtype
        assert torch.equal(stored.view(dtype).double(), got)
        assert torch.equal(pool.get_value_buffer(lid)[dst], v_src)


def test_lora_is_served_on_the_backend_relay_builds_row_info_for():
    from types import SimpleNamespace

    def view(**kw):
        return server_view(SimpleNamespace(model_path="m", **kw))

    assert modes.refusal(view(enable_lora=True, lora_backend="torch_native")) is None
    for backend in ("csgmv", "triton"):  # csgmv: SGLang's default
        message = modes.refusal(view(lora_paths=["a=/p"], lora_backend=backend))
        assert f"--lora-backend {backend}" in message and "torch_native" in message, message
    assert "--lora-backend csgmv" in modes.refusal(view(enable_lora=True))  # unset: default
    lora = view(enable_lora=True, lora_backend="torch_native")
    for arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
        assert "mixture-of-experts model (" + arch in modes.refusal(lora, architecture=arch)
        assert modes.refusal(view(), architecture=arch) is None  # without LoRA: served
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert modes.refusal(lora, architecture=arch) is None


def test_bitsandbytes_8bit_checkpoints_are_served_and_4bit_is_refused(tmp_path, model_dir):
    """What the checkpoint's own ``quantization_config`` says decides: 8-bit Llama is served
    (test/e2e/test_quantized.py); 8-bit of another architecture and 4-bit are refused by
    name with the reason; another method is classified by quant_methods."""
    import json

    base = json.loads((model_dir / "config.json").read_text())
    views = {}
    for name, quant in {
        "bnb8": {"quant_method": "bitsandbytes", "load_in_8bit": True},
        "bnb4": {"quant_method": "bitsandbytes", "load_in_4bit": True},
        "awq": {"quant_method": "awq", "bits": 4},
    }.items():
        ckpt = tmp_path / name
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({**base, "quantization_config": quant}))
        method = quant["quant_method"]
        ctx = SimpleNamespace(
            server_args=SimpleNamespace(model_path=str(ckpt)),
            model_config=SimpleNamespace(quantization=method),
        )
        views[name] = server_view(ctx)
    assert modes.refusal(views["bnb8"], architecture="LlamaForCausalLM") is None
    four = modes.refusal(views["bnb4"], architecture="LlamaForCausalLM")
    assert four is not None and "without an 8-bit bitsandbytes checkpoint (4-bit" in four
    # a checkpoint's own method is classified as a typed one (awq: weight-only, served)
    assert views["awq"].quantization == "awq"
    assert modes.refusal(views["awq"], architecture="LlamaForCausalLM") is None
    qwen2 = modes.refusal(views["bnb8"], architecture="Qwen2ForCausalLM")
    assert qwen2 is not None and "bitsandbytes 8-bit on Qwen2ForCausalLM" in qwen2
    assert "random weights cannot verify" in qwen2
    assert server_view(SimpleNamespace(model_path="org/hub-id")).bnb_8bit is False
    # the view read back from a resolved view (the cache factory re-reads the scheduler's)
    bnb8 = server_view(SimpleNamespace(server_args=views["bnb8"], model_config=None))
    assert bnb8.bnb_8bit and modes.refusal(bnb8, architecture="LlamaForCausalLM") is None


def test_every_quantization_method_of_sglang_is_served_or_refused_with_its_reason():
    """runtime/config/quant_methods.py classifies SGLang's methods; the option allow-list serves
    exactly the served ones as typed (bitsandbytes only as a checkpoint's own method), and
    a refused or never-reviewed method is refused with its reason."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from sglang_relay.runtime.config import quant_methods, server_options

    def view(**kw):
        return modes.ServerView(model_path="m", **kw)

    served = {n for n, m in quant_methods.METHODS.items() if m.served}
    typed = set(server_options.load_table().served["quantization"].values)
    assert typed == (served - {"bitsandbytes"}) | {modes.STANDIN_QUANTIZATION}
    for name in QUANTIZATION_METHODS:
        if name == modes.STANDIN_QUANTIZATION:  # registered by another test in this process
            continue
        message = modes.refusal(view(quantization=name), architecture="LlamaForCausalLM")
        if name in served - {"bitsandbytes"}:
            assert message is None, name
        elif name != "bitsandbytes":
            assert message is not None and f"--quantization {name}: " in message, name
            assert quant_methods.refusal_note(name) in message
    assert "not reviewed" in modes.refusal(view(quantization="quark"))
    assert "MX block formats" in modes.refusal(view(quantization="mxfp4"))


def test_children_fork_from_a_preloaded_process_unless_sglang_sets_each_up(cpu_args):
    """The CPU stand-in forks the scheduler and detokenizer from a preloaded process
    (runtime/standin/cpu.py) only when SGLang sets nothing up per child at its start: a NUMA
    binding (applied through the interpreter a spawned child executes), one visible device
    per process, the memory saver's preload."""
    import os

    from sglang_relay.runtime.sglang.server import per_child_process_setup

    assert per_child_process_setup(resolved_server_args(cpu_args)) is None
    bound = resolved_server_args([*cpu_args, "--numa-node", "0"])
    assert "NUMA" in per_child_process_setup(bound)
    os.environ["SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"] = "1"
    assert per_child_process_setup(resolved_server_args(cpu_args)) == (
        "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"
    )


def test_the_forkserver_loads_the_plugins_for_its_children_only_if_they_read_only_the_env():
    """The stand-in's forkserver loads SGLang's general plug-ins once for the children it
    forks (runtime/standin/forkserver_preload.py) only when each installed plug-in is one whose
    ``register`` was read and found to register hooks from the environment alone; every
    plug-in installed here is (a new dependency's plug-in must be read first), and one
    unknown plug-in makes each child load them itself."""
    from sglang_relay.runtime.sglang.server import (
        installed_general_plugins,
        plugins_load_once_for_children,
    )

    installed = installed_general_plugins()
    assert "relay" in installed
    assert plugins_load_once_for_children(installed), installed
    assert not plugins_load_once_for_children(installed | {"someone-elses-plugin"})


def test_the_hybrid_swa_pool_is_refused_with_its_way_out():
    """SGLang's hybrid SWA pool (gpt-oss by default) frees a window layer's KV that a
    relayed span's later readers need: refused in one line naming the flag that turns it
    off; Mamba / DSA hybrids are refused as before; the server view reads the build
    context's flags apart."""
    message = modes.refusal(modes.ServerView(hybrid_swa=True))
    assert message is not None and "add --disable-hybrid-swa-memory" in message
    assert "\n" not in message and message.endswith(modes.OUT)
    assert "Mamba" in modes.refusal(modes.ServerView(hybrid_model=True))
    ctx = SimpleNamespace(server_args=SimpleNamespace(), is_hybrid_swa=True, is_hybrid_ssm=False)
    view = server_view(ctx)
    assert view.hybrid_swa and not view.hybrid_model
