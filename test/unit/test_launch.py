"""Server argv defaults and the pre-flight checks behind `sglang-relay serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from sglang_relay.errors import RelayError
from sglang_relay.launch import build_server_argv, check_model_path
from sglang_relay.process import _get_ok, flag_value


def test_defaults_fill_only_what_is_missing():
    argv = build_server_argv(["--dtype=bfloat16", "--port", "1234"], cpu=True, model_path="/m")
    assert flag_value(argv, "--model-path") == "/m"
    assert flag_value(argv, "--dtype") == "bfloat16"
    assert flag_value(argv, "--radix-cache-backend") == "relay"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--attention-backend") == "torch_native"
    assert flag_value(argv, "--max-total-tokens") is not None
    assert argv.count("--dtype") + argv.count("--dtype=bfloat16") == 1
    assert argv.count("--sleep-on-idle") == 1


def test_user_choices_win():
    argv = build_server_argv(
        ["--model", "/x", "--radix-cache-backend", "foo", "--mem-fraction-static", "0.5"],
        cpu=True,
    )
    assert flag_value(argv, "--model-path") == "/x"
    assert "--model-path" not in argv
    assert flag_value(argv, "--radix-cache-backend") == "foo"
    assert flag_value(argv, "--max-total-tokens") is None


def test_gpu_machine_gets_no_cpu_flags():
    argv = build_server_argv([], cpu=False, model_path="/m")
    assert flag_value(argv, "--device") is None
    assert "--disable-cuda-graph" not in argv
    assert "--sleep-on-idle" not in argv
    assert argv.count("--disable-prefill-cuda-graph") == 1  # relay extends run eager
    assert flag_value(argv, "--attention-backend") == "flashinfer"
    # decode graphs stay on: relay's decode capture runs inside them
    assert flag_value(argv, "--cuda-graph-backend-decode") is None
    plain = build_server_argv([], cpu=False, model_path="/m", relay=False)
    assert "--disable-prefill-cuda-graph" not in plain
    assert "--cuda-graph-backend-decode" not in plain
    mine = build_server_argv(
        ["--cuda-graph-backend-prefill", "full", "--cuda-graph-backend-decode", "full"],
        cpu=False,
        model_path="/m",
    )
    assert "--disable-prefill-cuda-graph" not in mine
    assert flag_value(mine, "--cuda-graph-backend-decode") == "full"
    triton = build_server_argv(["--attention-backend", "triton"], cpu=False, model_path="/m")
    assert flag_value(triton, "--attention-backend") == "triton"


def test_model_path_checks(tmp_path):
    with pytest.raises(RelayError, match="no such directory"):
        check_model_path(str(tmp_path / "missing"), relay=True)
    with pytest.raises(RelayError, match="no config.json"):
        check_model_path(str(tmp_path), relay=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(RelayError, match="MambaForCausalLM is not supported"):
        check_model_path(str(tmp_path), relay=True)
    check_model_path(str(tmp_path), relay=False)  # plain SGLang may serve it


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "sglang_relay.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert any(line.startswith("sglang-relay: error:") and needle in line for line in lines), (
        proc.stderr
    )


def test_cli_wrong_model_path(tmp_path):
    _assert_one_line_error(_run_cli("serve", "--model-path", str(tmp_path / "nope")), "nope")


def test_cli_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _assert_one_line_error(
        _run_cli("serve", "--model-path", str(tmp_path)), "GPT2LMHeadModel is not supported"
    )


def test_cli_port_in_use(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = _run_cli("serve", "--model-path", str(model_dir), "--port", str(port))
    _assert_one_line_error(proc, f"port {port}")


def test_cli_unknown_command():
    proc = _run_cli("frobnicate")
    assert proc.returncode == 2 and "unknown command" in proc.stderr


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"l_start": 3, "l_det": 4, "l_end": 500}, "l_end + 1 <= 30"),
        ({"l_start": "x"}, "l_start must be an integer"),
        ({"tau_dev": -2}, "tau_dev must be a finite number"),
        ({"top_ratio": 7}, "top_ratio must be in (0, 1]"),
    ],
)
def test_cli_absurd_profile_is_one_error_line(model_dir, tmp_path, config, needle):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"config": config}))
    proc = _run_cli("serve", "--model-path", str(model_dir), "--relay-profile", str(profile))
    _assert_one_line_error(proc, needle)


def test_graph_settings_that_would_skip_relay_are_refused():
    """A replayed decode graph runs relay's decode capture only if it was installed before
    SGLang captured the graphs, and never accumulates influence scores; relay extends never
    run inside a prefill graph."""
    from sglang_relay.runtime.config.modes import graph_refusal

    decode, prefill = {"decode": True, "prefill": False}, {"decode": False, "prefill": True}
    assert graph_refusal(decode, capture_in_graph=True, influence=False) is None
    missed = graph_refusal(decode, capture_in_graph=False, influence=False)
    assert missed is not None and "--cuda-graph-backend-decode disabled" in missed
    assert "--enable-torch-compile" in missed and "serve without relay" in missed
    influence = graph_refusal(decode, capture_in_graph=True, influence=True)
    assert influence is not None and "tau_inf" in influence
    assert graph_refusal(decode | {"decode": False}, capture_in_graph=False, influence=True) is None
    refused = graph_refusal(prefill, capture_in_graph=True, influence=False)
    assert refused is not None and "--disable-prefill-cuda-graph" in refused
    # a speculative server's decode graphs are verify graphs: not verified with relay
    spec = graph_refusal(decode, capture_in_graph=True, influence=False, speculative=True)
    assert spec is not None and "--cuda-graph-backend-decode disabled" in spec
    assert graph_refusal(prefill | {"prefill": False}, capture_in_graph=True,
                         influence=False, speculative=True) is None  # fmt: skip


def test_speculative_servers_carry_no_influence_scores():
    """Influence scores accumulate in plain decode forwards, which a speculative server
    never runs: the two together are refused."""
    from sglang_relay.runtime.config.modes import spec_refusal
    from sglang_relay.runtime.sglang.server_view import ServerView

    ngram, plain = ServerView(speculative_algorithm="NGRAM", device="cpu"), ServerView()
    refused = spec_refusal(ngram, influence=True)
    assert refused is not None and "tau_inf" in refused and "--speculative-algorithm" in refused
    assert spec_refusal(ngram, influence=False) is None
    assert spec_refusal(plain, influence=True) is None


def test_settings_that_need_eager_decode_turn_decode_graphs_off_on_a_gpu(model_dir):
    """Influence scores (tau_inf) need eager decode: serve turns decode graphs off on a GPU
    unless the user chose a decode graph mode; the shipped profile keeps them."""
    from sglang_relay.launch import check_relay_settings, eager_decode_flags

    assert check_relay_settings({}, str(model_dir)) is False
    env = {"SGLANG_RELAY_CONFIG": '{"tau_inf": 0.5}'}
    assert check_relay_settings(env, str(model_dir)) is True
    assert eager_decode_flags([], cpu=False) == ["--cuda-graph-backend-decode", "disabled"]
    assert eager_decode_flags(["--cuda-graph-backend-decode", "full"], cpu=False) == []
    assert eager_decode_flags([], cpu=True) == []  # CPU decode graphs are opt-in


def test_cuda_graph_config_falls_back_to_the_legacy_flag():
    from types import SimpleNamespace

    from sglang_relay.runtime.sglang.server import cuda_graphs_enabled

    off = SimpleNamespace(server_args=SimpleNamespace(disable_cuda_graph=True))
    on = SimpleNamespace(server_args=SimpleNamespace(disable_cuda_graph=False))
    assert cuda_graphs_enabled(off, "decode") is False  # no published config in this process
    assert cuda_graphs_enabled(on, "prefill") is True
    with pytest.raises(ValueError, match="unknown CUDA graph phase"):
        cuda_graphs_enabled(on, "verify")


# A real uvicorn server (what SGLang's HTTP front end runs) as the managed child; with
# `linger` it stays alive after its bind fails, as SGLang's server does while its
# schedulers run.
_UVICORN_CHILD = """
import sys, time, uvicorn
async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
try:
    uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), lifespan="off")
finally:
    if sys.argv[3] == "linger":
        time.sleep(600)
"""


def _uvicorn_child(linger: bool, port: int = 0):
    from sglang_relay.process import _ChildProcess

    class Child(_ChildProcess):
        name = "uvicorn"

        def command(self):
            mode = "linger" if linger else "exit"
            return [sys.executable, "-c", _UVICORN_CHILD, self.host, str(self.port), mode]

        def ready(self):
            return _get_ok(self.url + "/")

    return Child(args=[], port=port)


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("linger", [False, True], ids=["exits", "lingers"])
def test_a_picked_port_taken_before_the_child_binds_is_picked_again(
    monkeypatch, taken_port, linger
):
    from sglang_relay import process

    picks = iter([taken_port])
    real = process.free_port
    monkeypatch.setattr(process, "free_port", lambda host: next(picks, None) or real(host))
    child = _uvicorn_child(linger)
    try:
        child.start(timeout=60)
        assert child.port != taken_port
        assert _get_ok(f"http://127.0.0.1:{child.port}/")
        log = open(child.log_path).read()
        assert f"relaunched on port {child.port}" in log
        assert "address already in use" in log.lower()
    finally:
        child.stop()


def test_a_chosen_port_that_is_taken_is_one_error_not_a_wait(taken_port):
    child = _uvicorn_child(linger=True, port=taken_port)
    try:
        with pytest.raises(RelayError, match="could not bind a port"):
            child.start(timeout=120)
        assert child.port == taken_port
        assert child.proc.poll() is not None  # the lingering process was stopped
    finally:
        child.stop()


def test_free_port_stays_out_of_ranges_others_are_handed_unasked():
    from sglang_relay.process import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    if ephemeral_low < 10064:
        pytest.skip(f"ephemeral ports start at {ephemeral_low}: no range below it to pick from")
    for _ in range(50):
        port = free_port()
        assert port < ephemeral_low  # never what connect()/bind(0) hand out
        assert not 22000 <= port <= 29999  # never SGLang's NCCL/gloo rendezvous range


def test_a_picked_port_another_server_answers_on_is_not_taken_for_the_child(monkeypatch):
    """A foreign HTTP server already listening on the picked port answers /health before
    our child even tries to bind: start() must not return its URL as ours."""
    from sglang_relay import process

    foreign = _uvicorn_child(linger=False)
    foreign.start(timeout=60)
    try:
        picks = iter([foreign.port])
        real = process.free_port
        monkeypatch.setattr(process, "free_port", lambda host: next(picks, None) or real(host))
        child = _uvicorn_child(linger=True)
        try:
            child.start(timeout=60)
            assert child.port != foreign.port and _get_ok(child.url + "/")
            assert child._listens() and not foreign.proc.poll()
        finally:
            child.stop()
    finally:
        foreign.stop()


def test_cpu_thread_binding_splits_the_cores_evenly():
    from sglang_relay.cpu_setup import threads_bind

    assert threads_bind(2, [0, 1]) == "0|1"
    assert threads_bind(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert threads_bind(3, [4, 5]) == "4|5|4"  # more ranks than cores: one core each
    groups = [g.split(",") for g in threads_bind(4, list(range(16))).split("|")]
    assert [len(g) for g in groups] == [4, 4, 4, 4]
    assert sorted(int(c) for g in groups for c in g) == list(range(16))


def _cpu_serve_env(argv: list[str], environ: dict[str, str]) -> tuple[list[str], dict]:
    """`serve`'s CPU defaults for argv under environ, as the launcher computes them."""
    from sglang_relay import cpu_setup as cpu
    from sglang_relay.launch import given_flags, parse_server_view

    view = parse_server_view(["--model-path", "/m", *argv])
    return cpu.serve_defaults(
        view.tp_size * view.dp_size * view.pp_size,
        view.enable_torch_compile,
        given_flags(argv),
        environ,
    )


def test_cpu_serve_defaults_for_the_shape_served(monkeypatch):
    from sglang_relay import cpu_setup as cpu

    monkeypatch.setattr(cpu, "cuda_available", lambda: False)
    monkeypatch.setattr(cpu, "numa_node_count", lambda: 1)
    monkeypatch.setattr(cpu, "usable_cpus", lambda: [0, 1])
    # one rank: passive OpenMP waits (a spinning rank beside a busy process: 7-20x slower)
    assert _cpu_serve_env([], {}) == ([], {"OMP_WAIT_POLICY": "PASSIVE"})
    assert _cpu_serve_env([], {"GOMP_SPINCOUNT": "10000"}) == ([], {})  # the user tuned it
    # tp 2 and dp 2 (and their aliases) need a binding on one NUMA node, else SGLang asserts
    for shape in (["--tp-size", "2"], ["--tensor-parallel-size=2"], ["--dp-size", "2"]):
        env = _cpu_serve_env(shape, {})[1]
        assert env == {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_WAIT_POLICY": "PASSIVE"}
    flags, _ = _cpu_serve_env(["--enable-torch-compile"], {})
    assert flags == ["--cuda-graph-bs-decode", "1", "2", "4", "--torch-compile-max-bs", "4"]


def test_cpu_serve_defaults_never_override_the_user(monkeypatch):
    from sglang_relay import cpu_setup as cpu

    monkeypatch.setattr(cpu, "cuda_available", lambda: False)
    monkeypatch.setattr(cpu, "numa_node_count", lambda: 1)
    user_env = {"OMP_WAIT_POLICY": "ACTIVE", "SGLANG_CPU_OMP_THREADS_BIND": "0-1|0-1"}
    assert _cpu_serve_env(["--tp-size", "2"], user_env) == ([], {})
    for bound in (["--torch-compile-max-bs", "8"], ["--cuda-graph-bs-decode", "1", "8"]):
        flags, _ = _cpu_serve_env(["--enable-torch-compile", *bound], {})
        assert flags == []
    # as many NUMA nodes as ranks: SGLang's own one-node-per-rank binding is kept
    monkeypatch.setattr(cpu, "numa_node_count", lambda: 2)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in _cpu_serve_env(["--tp-size", "2"], {})[1]


def test_cpu_serve_defaults_leave_a_gpu_machine_alone(monkeypatch):
    from sglang_relay import cpu_setup as cpu

    monkeypatch.setattr(cpu, "cuda_available", lambda: True)
    assert _cpu_serve_env(["--tp-size", "2", "--enable-torch-compile"], {}) == ([], {})
