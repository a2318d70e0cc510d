"""``sglang-relay serve``: SGLang's HTTP server with the relay backend. Argument defaults and
pre-flight checks that turn common mistakes into one clear error line before any weights
load (the model path, the port, relay's own flags, the option allow-list and the mode
matrix as SGLang resolves them)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from sglang_relay.errors import RelayError
from sglang_relay.process import DEFAULT_HOST, check_port_free, flag_value, has_flag

DEFAULT_PORT = 30000


def build_server_argv(
    argv: list[str], *, cpu: bool, model_path: str | None = None, relay: bool = True
) -> list[str]:
    """Return SGLang server argv with relay's defaults added where the user set nothing.

    Adds ``--model-path`` (the embedded model, given as ``model_path``), ``--host
    127.0.0.1``, ``--radix-cache-backend relay``, on a GPU ``--disable-prefill-cuda-graph``
    (relay extends run eager) and ``--attention-backend flashinfer``, and, on a CPU-only
    machine, the flags the CPU needs (see
    :mod:`sglang_relay.cpu_setup`). User flags always win.
    """
    from sglang_relay.cpu_setup import DEFAULT_CPU_MAX_TOTAL_TOKENS

    out = list(argv)
    if not has_flag(out, "--model-path"):
        if model_path is None:
            raise RelayError("no --model-path given and no default model available")
        out += ["--model-path", model_path]
    if not has_flag(out, "--host"):
        out += ["--host", DEFAULT_HOST]
    if relay and not has_flag(out, "--radix-cache-backend"):
        out += ["--radix-cache-backend", "relay"]
    if (
        relay
        and not cpu
        and not any(
            has_flag(out, f)
            for f in ("--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill")
        )
    ):
        # relay extends run their own layer loop, eager: a captured prefill graph would
        # replay the stock forward instead
        out.append("--disable-prefill-cuda-graph")
    # decode graphs stay on: relay's decode capture is installed before SGLang captures
    # them and runs inside every replay (runtime/forward/decode.py); see eager_decode_flags
    if relay and not cpu and not has_flag(out, "--attention-backend"):
        # the relay extend has fused paths for flashinfer and triton only; SGLang's own
        # default on Hopper/Blackwell (fa3, trtllm_mha) would leave it on pure torch
        out += ["--attention-backend", "flashinfer"]
    if cpu:
        defaults = {
            "--device": "cpu",
            "--attention-backend": "torch_native",
            "--dtype": "float32",
        }
        for flag_name, value in defaults.items():
            if not has_flag(out, flag_name):
                out += [flag_name, value]
        if not has_flag(out, "--disable-cuda-graph"):
            out.append("--disable-cuda-graph")
        # An idle scheduler otherwise busy-polls a core that the model needs.
        if not has_flag(out, "--sleep-on-idle"):
            out.append("--sleep-on-idle")
        if not (has_flag(out, "--max-total-tokens") or has_flag(out, "--mem-fraction-static")):
            out += ["--max-total-tokens", str(DEFAULT_CPU_MAX_TOTAL_TOKENS)]
    return out


def check_model_path(path: str, *, relay: bool) -> None:
    """Raise RelayError unless ``path`` is a usable model directory (or a hub id when online)."""
    p = Path(path).expanduser()
    if not p.exists():
        looks_like_hub_id = (
            path.count("/") == 1 and not path.startswith((".", "/", "~")) and " " not in path
        )
        if looks_like_hub_id and os.environ.get("HF_HUB_OFFLINE") != "1":
            return  # SGLang downloads it; architecture is checked again in the scheduler
        raise RelayError(f"--model-path {path}: no such directory")
    config_file = p / "config.json"
    if not p.is_dir() or not config_file.is_file():
        raise RelayError(
            f"--model-path {path}: not a Hugging Face model directory (no config.json)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise RelayError(f"--model-path {path}: unreadable config.json ({exc})") from exc
    if relay:
        from sglang_relay.runtime.models.registry import SUPPORTED_ARCHITECTURES

        archs = config.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise RelayError(
                f"--model-path {path}: architecture {', '.join(archs) or 'unknown'} is not "
                f"supported by sglang-relay yet (supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}); serve it with plain SGLang"
            )


# sglang-relay's own serve flags -> the environment variables the scheduler reads
# (see sglang_relay.runtime.config.settings); SGLang's parser never sees them.
RELAY_FLAGS = {
    "--relay-method": "SGLANG_RELAY_METHOD",
    "--relay-profile": "SGLANG_RELAY_PROFILE",
    "--relay-config": "SGLANG_RELAY_CONFIG",
    "--relay-reuse": "SGLANG_RELAY_REUSE",
    "--relay-scope": "SGLANG_RELAY_SCOPE",
    "--relay-meta": "SGLANG_RELAY_META",
    "--relay-lora": "SGLANG_RELAY_LORA",
    "--relay-min-share": "SGLANG_RELAY_MIN_SHARE",
    "--relay-reasoning-reuse": "SGLANG_RELAY_REASONING_REUSE",
    "--relay-span-tokens": "SGLANG_RELAY_SPAN_TOKENS",
    "--relay-host-tokens": "SGLANG_RELAY_HOST_TOKENS",
    "--relay-host-ttl": "SGLANG_RELAY_HOST_TTL",
    "--relay-host-priority": "SGLANG_RELAY_HOST_PRIORITY",
    "--relay-guard-tokens": "SGLANG_RELAY_GUARD_TOKENS",
    "--relay-ship-to": "SGLANG_RELAY_SHIP_TO",
    "--relay-ship-listen": "SGLANG_RELAY_SHIP_LISTEN",
    "--relay-ship-lease": "SGLANG_RELAY_SHIP_LEASE",
    "--relay-ship-protocol": "SGLANG_RELAY_SHIP_PROTOCOL",
    "--relay-ship-name": "SGLANG_RELAY_SHIP_NAME",
    "--relay-ship-publishers": "SGLANG_RELAY_SHIP_PUBLISHERS",
    "--relay-ship-staging": "SGLANG_RELAY_SHIP_STAGING",
}


RELAY_SWITCHES = {
    "--relay-allow-approx-prefix": "SGLANG_RELAY_ALLOW_APPROX_PREFIX",
    "--relay-guard-streams": "SGLANG_RELAY_GUARD_STREAMS",
}


def split_relay_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate ``--relay-*`` flags (returned as env settings) from SGLang's flags."""
    rest: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        item = argv[i]
        name, eq, value = item.partition("=")
        if name in RELAY_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise RelayError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            env[RELAY_FLAGS[name]] = value
        elif item in RELAY_SWITCHES:
            env[RELAY_SWITCHES[item]] = "1"
        elif name.startswith("--relay-"):
            known = ", ".join(sorted([*RELAY_FLAGS, *RELAY_SWITCHES]))
            raise RelayError(f"unknown flag {name} (relay flags: {known})")
        else:
            rest.append(item)
        i += 1
    return rest, env


def check_relay_settings(env: dict[str, str], model_path: str) -> bool:
    """Validate the relay settings the scheduler will read; one clear error if wrong.
    Returns whether they need eager decode (influence scores: the profile's ``tau_inf``)."""
    from sglang_relay.runtime.config.settings import settings_from_env
    from sglang_relay.runtime.sched.guard import guard_policy

    try:
        guard_policy({**os.environ, **env})
        settings = settings_from_env(model_path, {**os.environ, **env})
        if settings.config.method != "standard" and Path(model_path, "config.json").is_file():
            layers = json.loads(Path(model_path, "config.json").read_text())["num_hidden_layers"]
            settings.config.schedule(int(layers))
            if settings.reuse_target is not None:
                settings.point(settings.reuse_target, int(layers))
    except (ValueError, KeyError) as exc:
        raise RelayError(f"relay settings: {exc}") from exc
    return settings.config.tau_inf is not None


def eager_decode_flags(argv: list[str], *, cpu: bool) -> list[str]:
    """Flags that turn decode graphs off, for settings that need eager decode (influence
    scores accumulate in a per-request host loop no graph can hold; a speculative server's
    verify graphs are not verified with relay), unless the user chose the decode graph
    mode. On the CPU decode graphs are opt-in (--enable-torch-compile)."""
    chosen = ("--cuda-graph-backend-decode", "--disable-cuda-graph", "--cuda-graph-config")
    if cpu or any(has_flag(argv, f) for f in chosen):
        return []
    return ["--cuda-graph-backend-decode", "disabled"]


def parse_server_view(argv: list[str]):
    """SGLang's own parse of ``argv``, as the options relay depends on
    (:class:`~sglang_relay.runtime.sglang.server_view.ServerView`); one error line if SGLang
    rejects it."""
    from sglang_relay.runtime.sglang.server import parse_server_args, server_view

    try:
        return server_view(parse_server_args(argv))
    except SystemExit as exc:  # argparse already printed SGLang's own message
        raise RelayError("invalid SGLang arguments (see above)") from exc


def check_server_mode(argv: list[str]) -> None:
    """Refuse, before SGLang spawns anything, a server option relay cannot serve correctly
    (under SGLang's own launcher the plug-in checks in the launcher, then the scheduler): first the
    options as typed against the allow-list (:mod:`.server_options`) and the mode matrix
    (:mod:`.modes`), then as SGLang resolves them (a backend may force a page size); an
    error of SGLang's own resolution is reported here, before any weights load."""
    from sglang_relay.runtime.config import environment, modes, server_options
    from sglang_relay.runtime.config.settings import ship_role
    from sglang_relay.runtime.sglang.server import (
        parse_server_args,
        resolved_server_args,
        server_view,
    )

    typed = parse_server_args(argv)
    role = ship_role()
    # the mode matrix's messages first (they say more about the options they know)
    message = modes.refusal(parse_server_view(argv), ship_role=role)
    message = message or environment.environment_refusal()
    message = message or server_options.refusal(vars(typed))
    if message is None:
        try:
            resolved = resolved_server_args(argv)
        except Exception as exc:  # SGLang refuses the options itself: say so, now
            raise RelayError(f"SGLang refuses these options: {type(exc).__name__}: {exc}") from exc
        message = modes.refusal(server_view(resolved), ship_role=role)
    if message is not None:
        raise RelayError(message)


def given_flags(argv: list[str]) -> set[str]:
    """The ``--flag`` names in ``argv`` (``--f v`` and ``--f=v`` alike)."""
    return {item.split("=", 1)[0] for item in argv if item.startswith("--")}


def apply_cpu_serve_defaults(argv: list[str]) -> list[str]:
    """On a CPU-only machine, add the flags and set the environment (inherited by SGLang's
    spawned processes) that the served shape needs, where the user set none
    (:func:`sglang_relay.cpu_setup.serve_defaults`)."""
    from sglang_relay import cpu_setup as cpu

    view = parse_server_view(argv)
    flags, env = cpu.serve_defaults(
        view.tp_size * view.dp_size * view.pp_size,
        view.enable_torch_compile,
        given_flags(argv),
        dict(os.environ),
    )
    os.environ.update(env)
    return argv + flags


def prepare(argv: list[str]) -> list[str]:
    """Everything ``sglang-relay serve`` checks before handing argv to SGLang."""
    from sglang_relay import cpu_setup as cpu

    plain = "--no-relay" in argv  # plain SGLang with the same defaults, for comparisons
    argv = [a for a in argv if a != "--no-relay"]
    argv, relay_env = split_relay_flags(argv)
    cpu_mode = cpu.activate()
    default_model = None
    if not has_flag(argv, "--model-path"):
        from sglang_relay.embedded_model import ensure_model

        default_model = str(ensure_model())
    out = build_server_argv(argv, cpu=cpu_mode, model_path=default_model, relay=not plain)
    _check_port(out)
    relay = flag_value(out, "--radix-cache-backend") == "relay"
    model_path = flag_value(out, "--model-path") or ""
    check_model_path(model_path, relay=relay)
    eager = check_relay_settings(relay_env, model_path) if relay else False
    # speculative verify graphs are not verified with relay (modes.graph_refusal)
    speculative = str(flag_value(out, "--speculative-algorithm") or "").upper() not in ("", "NONE")
    if relay and (eager or speculative):
        out += eager_decode_flags(out, cpu=cpu_mode)
    os.environ.update(relay_env)  # reaches the spawned scheduler
    if relay:
        check_server_mode(out)
    if flag_value(out, "--disaggregation-mode") not in (None, "null") or relay_env.get(
        "SGLANG_RELAY_SHIP_TO", relay_env.get("SGLANG_RELAY_SHIP_LISTEN")
    ):
        from sglang_relay.runtime.scale.ship.mooncake import add_library_path

        add_library_path()  # Mooncake's libibverbs/libnl, for SGLang's PD and relay's shipping
    if cpu_mode:
        out = apply_cpu_serve_defaults(out)
    return out


def _check_port(argv: list[str]) -> None:
    """The port ``serve`` will bind is free: checked before SGLang is imported (~15 s of one
    core), so a taken port is one error at once."""
    port = flag_value(argv, "--port")
    try:
        port_num = int(port) if port is not None else DEFAULT_PORT
    except ValueError as exc:
        raise RelayError(f"--port {port}: not a number") from exc
    check_port_free(flag_value(argv, "--host") or DEFAULT_HOST, port_num)


def serve(argv: list[str], after_checks: Callable[[], None] | None = None) -> None:
    """``sglang-relay serve``: SGLang's HTTP server with relay registered and selected (its
    checks and SGLang's imports run with the garbage collector paused: import_gc).
    ``after_checks``: called once the checks have set the environment, before SGLang's
    imports (the tests' preloaded launcher checks it there: test/e2e/launcher_zygote.py)."""
    from sglang_relay.runtime.import_gc import collector_paused
    from sglang_relay.runtime.sglang.server import import_http_server, run_http_server

    with collector_paused():
        argv = prepare(argv)
        if after_checks is not None:
            after_checks()
        import_http_server()
    run_http_server(argv)
