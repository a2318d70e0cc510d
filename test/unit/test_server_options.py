"""The allow-list of SGLang server options (runtime/config/server_options.toml): every option of
the installed SGLang is classified, unclassified and refused options are refused before
anything loads, and docs/server-options.md is the table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_relay.errors import RelayError
from sglang_relay.launch import build_server_argv, check_server_mode
from sglang_relay.runtime.config import server_options
from sglang_relay.runtime.sglang.server import parse_server_args

ROOT = Path(__file__).resolve().parents[2]


def _argv(model_dir, *extra, cpu=True):
    return build_server_argv(list(extra), cpu=cpu, model_path=str(model_dir))


def test_every_sglang_option_is_classified_once():
    """The walk over SGLang's ServerArgs options: a release that adds an option fails here
    until the option is classified."""
    table = server_options.load_table()
    dests = {dest for dest, _, _ in server_options.sglang_options()}
    assert dests - table.classified() == set(), "unclassified SGLang options"
    assert table.classified() - dests == set(), "classified options SGLang does not have"
    assert table.duplicates() == set()
    for dest, served in table.served.items():
        assert (ROOT / served.test).is_file(), (dest, served.test)
    for dest, refused in table.refused.items():
        assert refused.reason and refused.way_out, dest


# what modes.py refuses (and the issue named) must be refused by the table too
MUST_REFUSE = [
    "enable_nvidia_megakernel", "enable_amd_monokernel", "moe_a2a_backend", "enable_lmcache",
    "enable_flexkv", "hicache_storage_backend", "speculative_draft_attention_backend",
    "speculative_draft_kv_cache_dtype", "enable_multi_layer_eagle",
    "pp_size", "enable_dp_attention",
    "enable_deterministic_inference", "dllm_algorithm", "enable_hisparse", "enable_pdmux",
    "attn_cp_size", "enable_prefill_cp", "dcp_size", "enable_attn_tp_input_scattered",
    "enable_layernorm_sp", "prefill_only_disable_kv_cache", "disable_radix_cache",
]  # fmt: skip


def test_what_relay_cannot_serve_is_refused_by_the_table():
    table = server_options.load_table()
    assert [d for d in MUST_REFUSE if d not in table.refused] == []
    # speculative decoding: NGRAM (no draft model) and EAGLE; modes.spec_refusal narrows them
    assert table.served["speculative_algorithm"].values == ("NGRAM", "ngram", "EAGLE", "eagle")
    # quantization: served per method, each classified (runtime/config/quant_methods.py)
    assert "awq" in table.served["quantization"].values
    assert "fp8" not in table.served["quantization"].values  # scaled KV (quant_methods.py)
    # HiCache: served with the write policies relay verified (the table alone says), not
    # write_back
    assert "write_back" not in table.served["hicache_write_policy"].values


def test_the_launchers_own_arguments_pass(model_dir):
    for argv in (
        _argv(model_dir),
        _argv(model_dir, cpu=False),
        _argv(
            model_dir,
            "--tp-size",
            "2",
            "--enable-torch-compile",
            "--cuda-graph-bs-decode",
            "1",
            "2",
            "--torch-compile-max-bs",
            "2",
            "--page-size",
            "16",
        ),  # fmt: skip
        _argv(model_dir, "--dp-size", "2", "--kv-cache-dtype", "fp8_e4m3", "--port", "1234"),
        _argv(
            model_dir,
            "--enable-lora",
            "--lora-backend",
            "torch_native",
            "--max-loras-per-batch",
            "2",
        ),
        _argv(
            model_dir,
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            "8",
            "--speculative-ngram-max-bfs-breadth",
            "4",
        ),
    ):
        assert server_options.refusal(vars(parse_server_args(argv))) is None, argv
    ngram = _argv(model_dir, "--speculative-algorithm", "NGRAM")
    check_server_mode(ngram)  # the mode matrix serves NGRAM on its tested shape too
    check_server_mode(_argv(model_dir, "--speculative-algorithm", "ngram"))  # SGLang upper-cases
    # on a GPU SGLang verifies overlapped, which relay has not verified
    gpu = _argv(model_dir, "--speculative-algorithm", "NGRAM", "--device", "cuda", cpu=False)
    with pytest.raises(RelayError, match="overlap schedule") as exc:
        check_server_mode(gpu)
    assert "--disable-overlap-schedule" in str(exc.value)
    check_server_mode([*gpu, "--disable-overlap-schedule"])


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--enable-nvidia-megakernel"], "--enable-nvidia-megakernel"),
        (["--enable-amd-monokernel"], "--enable-amd-monokernel"),
        (["--monokernel-backend", "amd"], "--enable-amd-monokernel"),
        (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend"),
        (["--enable-lmcache"], "--enable-lmcache"),
        (["--enable-flexkv"], "--enable-flexkv"),
        (["--kv-cache-dtype", "nvfp4"], "--kv-cache-dtype nvfp4"),
        (["--lora-backend", "triton"], "--lora-backend triton"),
        (["--attention-backend", "aiter"], "--attention-backend aiter"),
        (["--attention-backend", "flashmla"], "--attention-backend flashmla"),
        # speculative decoding: NGRAM and EAGLE, on the shapes test_speculative.py serves
        (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm EAGLE3"),
        (["--speculative-algorithm", "STANDALONE"], "--speculative-algorithm STANDALONE"),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"], "eagle-topk 2"),
        (["--speculative-algorithm", "EAGLE"], "--speculative-eagle-topk None"),
        (["--speculative-algorithm", "NGRAM", "--tp-size", "2"], "at --tp-size 2"),
        (["--speculative-algorithm", "NGRAM", "--page-size", "16"], "--page-size 16"),
        (["--speculative-algorithm", "NGRAM", "--enable-torch-compile"], "torch-compile"),
        (["--speculative-algorithm", "NGRAM", "--dp-size", "2"], "--dp-size 2"),
        (["--speculative-algorithm", "ngram", "--enable-hierarchical-cache"], "hierarchical"),
        (
            ["--speculative-algorithm", "NGRAM", "--enable-lora", "--lora-backend", "torch_native"],
            "with LoRA",
        ),  # fmt: skip
    ],
)
def test_refused_options_are_named_before_anything_loads(model_dir, extra, named):
    with pytest.raises(RelayError, match="sglang-relay cannot serve") as exc:
        check_server_mode(_argv(model_dir, *extra))
    assert named in str(exc.value) and "--no-relay" in str(exc.value)


def test_the_attention_backends_sglang_picks_by_itself_on_gpus_are_served():
    # the cache factory checks the resolved backend against the same list (radix_cache.py)
    for backend in ("torch_native", "flashinfer", "triton", "fa3", "fa4", "trtllm_mha"):
        assert server_options.refusal({"attention_backend": backend}) is None, backend
    message = server_options.refusal({"attention_backend": "intel_amx"})
    assert message is not None and "--attention-backend intel_amx" in message


def test_an_option_the_table_does_not_know_is_refused(model_dir):
    table = server_options.load_table()
    unknown = replace(table, neutral=table.neutral - {"log_level"})  # as a newer SGLang's
    typed = vars(parse_server_args(_argv(model_dir, "--log-level", "debug")))
    message = server_options.refusal(typed, unknown)
    assert message is not None and "has not classified --log-level" in message
    assert server_options.refusal(typed, table) is None


def test_the_docs_are_the_table():
    assert (ROOT / "docs/server-options.md").read_text() == server_options.markdown(), (
        "regenerate: python -m sglang_relay.runtime.config.server_options > docs/server-options.md"
    )


def test_serve_refuses_an_unclassified_mode_before_weights_load(tmp_path):
    env = {**os.environ, "SGLANG_RELAY_MODEL_DIR": os.environ.get("SGLANG_RELAY_MODEL_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    cmd = [sys.executable, "-m", "sglang_relay.cli", "serve", "--enable-nvidia-megakernel"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "--enable-nvidia-megakernel" in text and "sglang-relay cannot serve" in text, text[
        -2000:
    ]
    assert "Load weight" not in text
    print(f"refused in {time.monotonic() - t0:.1f} s")


def test_the_rust_front_end_is_refused_with_the_way_out():
    """SGLANG_RUST_SERVER serves requests without the tokenizer manager, where relay's
    request boundary lives: refused when SGLang's own parser reads it true, not otherwise."""
    from sglang_relay.runtime.config.environment import environment_refusal

    for on in ("1", "true", "YES", "y"):
        message = environment_refusal({"SGLANG_RUST_SERVER": on})
        assert message and "unset SGLANG_RUST_SERVER" in message and "tokenizer manager" in message
    for off in ("0", "false", "", "no"):
        assert environment_refusal({"SGLANG_RUST_SERVER": off}) is None
    assert environment_refusal({}) is None


def test_served_values_that_never_ran_are_named_not_refused():
    """Served by design, never run by relay's tests: a GPU attention backend, a GPU
    quantization method, HiCache layouts other than the tested one (only with HiCache on),
    speculative decoding off the CPU, the device itself; what ran is not named."""
    from sglang_relay.runtime.config.server_options import never_ran

    assert never_ran({"attention_backend": "torch_native"}, "cpu") == []
    assert never_ran({"attention_backend": "fa3"}, "cpu") == ["--attention-backend fa3"]
    assert never_ran({}, "cuda") == ["--device cuda"]
    assert never_ran({"quantization": "awq"}, "cpu") == ["--quantization awq"]
    hicache = {"enable_hierarchical_cache": True, "hicache_io_backend": "direct",
               "hicache_mem_layout": "page_first"}  # fmt: skip
    assert never_ran(hicache, "cpu") == ["--hicache-mem-layout page_first"]
    assert never_ran({**hicache, "enable_hierarchical_cache": False}, "cpu") == []
    spec = {"speculative_algorithm": "NGRAM"}
    assert never_ran(spec, "cpu") == []
    assert never_ran(spec, "cuda") == ["--device cuda", "--speculative-algorithm NGRAM"]
    assert modes_refusal_free(spec)


def modes_refusal_free(values) -> bool:
    """Never-ran values are still served: the allow-list does not refuse them."""
    from sglang_relay.runtime.config.server_options import refusal

    return refusal(values) is None


def test_every_sglang_environment_variable_is_classified():
    """Every section of the installed SGLang's environment registry is neutral or unverified
    in environment.toml (a newer SGLang's new section fails here), every variable named in
    it exists, and the variables that take requests around relay's boundary are refused."""
    from sglang_relay.runtime.config import environment

    sections = set(environment.sglang_sections().values())
    table = environment.table()
    listed = set(table["sections"]["neutral"]) | set(table["sections"]["unverified"])
    assert len(environment.sglang_sections()) > 700 and len(sections) > 60
    assert sections <= listed, sorted(sections - listed)
    assert not set(table["sections"]["neutral"]) & set(table["sections"]["unverified"])
    named = [*table["refused"], *table["served"]["names"]]
    assert set(named) <= set(environment.sglang_sections()), named
    assert environment.classify("SGLANG_RUST_SERVER") == "refused"
    assert "unset SGLANG_GRPC_PORT" in environment.environment_refusal({"SGLANG_GRPC_PORT": "9"})
    assert environment.classify("SGLANG_NATIVE_MOVE_KV_CACHE") == "served"
    env = {"SGLANG_GRPC_PORT": "", "SGLANG_NATIVE_MOVE_KV_CACHE": "1", "HOME": "/root"}
    assert environment.environment_refusal(env) is None and environment.unverified_set(env) == []
    some = next(n for n, s in environment.sglang_sections().items() if s == "DeepGEMM")
    assert environment.unverified_set({some: "1"}) == [some]
