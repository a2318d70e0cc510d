"""``sglang-relay``: serve, demo, prepare-model (and, as they land, profile and bench).

The CLI only parses arguments and dispatches; user mistakes surface as one line on stderr
and exit code 1 (:class:`~sglang_relay.errors.RelayError`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable

from sglang_relay.errors import RelayError

USAGE = """sglang-relay <command> [options]

commands:
  serve [SGLANG FLAGS]   SGLang's HTTP server with the relay radix cache (defaults: the
                         embedded model, 127.0.0.1:30000, CPU settings when there is no GPU)
  demo                   three-agent relay (Architect -> Developer -> Reviewer) on a real server
  prepare-model          convert the embedded model into the cache folder and print its path
  ship-key --name NAME   a span-shipping publisher's key (SGLANG_RELAY_SHIP_KEY), from the
                         receivers' SGLANG_RELAY_SHIP_SECRET in the environment
  profile                offline layer-range profiler (writes a profile JSON and a plot)
  bench run|ttft|fidelity|decode|load|chaos|serve|report|quantized
                         benchmarks (`bench run --quick` = make bench; benchmark/README.md);
                         `bench fidelity --frontier`: KL vs reuse per method, knobs swept
  gpu-check              the first GPU run in one command (make gpu-check; docs/gpu.md):
                         kernels compiled, FlashInfer, a bf16 graph server vs the reference

relay flags of serve: --relay-method standard|naive|cacheblend|epic|relay,
  --relay-profile FILE, --relay-config JSON, --relay-scope shared|key|header:NAME,
  --relay-meta full|counts|off, --relay-span-tokens N,
  --relay-host-tokens N, --relay-host-ttl SECONDS, --relay-host-priority unconsumed|lru,
  --relay-ship-to HOST:PORT[,...] (PD decode) / --relay-ship-listen HOST:PORT (PD prefill),
  --relay-ship-name NAME (publisher) / --relay-ship-publishers NAME=*|NAME=TENANT[,...]
  (receiver), --relay-ship-lease SECONDS, --relay-ship-protocol tcp|rdma,
  --relay-ship-staging TOKENS,
  --relay-allow-approx-prefix, --no-relay (plain SGLang, same defaults)
"""


def _cmd_serve(argv: list[str]) -> int:
    from sglang_relay.launch import serve

    serve(argv)
    return 0


def _cmd_demo(argv: list[str]) -> int:
    from sglang_relay.demo import main as demo_main

    return demo_main(argv)


def _cmd_prepare_model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay prepare-model")
    parser.add_argument("--model-dir", default=None, help="target folder (default: the cache)")
    args = parser.parse_args(argv)
    from sglang_relay.embedded_model import ensure_model

    print(ensure_model(args.model_dir))
    return 0


def _cmd_profile(argv: list[str]) -> int:
    from sglang_relay.profiler.cli import main as profile_main

    return profile_main(argv)


BENCHES = {
    "run": "sglang_relay.bench.run",
    "fidelity": "sglang_relay.bench.fidelity",
    "ttft": "sglang_relay.bench.ttft",
    "decode": "sglang_relay.bench.decode",
    "load": "sglang_relay.bench.load",
    "chaos": "sglang_relay.bench.chaos",
    "serve": "sglang_relay.bench.serve",
    "report": "sglang_relay.bench.run:main_report",
    "quantized": "sglang_relay.bench.quantized",
}


def _cmd_ship_key(argv: list[str]) -> int:
    """A span-shipping publisher's own key, from the receivers' secret in the environment."""
    import os

    from sglang_relay.runtime.config.settings import ENV_SHIP_SECRET
    from sglang_relay.runtime.scale.ship.wire import check_name, publisher_key

    parser = argparse.ArgumentParser(prog="sglang-relay ship-key")
    parser.add_argument("--name", required=True, help="the publisher's --relay-ship-name")
    args = parser.parse_args(argv)
    secret = os.environ.get(ENV_SHIP_SECRET) or ""
    if not secret:
        raise RelayError(f"ship-key derives a publisher's key from {ENV_SHIP_SECRET}; set it")
    try:
        name = check_name(args.name)
    except ValueError as exc:
        raise RelayError(str(exc)) from None
    print(publisher_key(secret, name).hex())
    return 0


def _cmd_gpu_check(argv: list[str]) -> int:
    from sglang_relay.gpu_check import main as gpu_check_main

    return gpu_check_main(argv)


def _cmd_bench(argv: list[str]) -> int:
    import importlib

    if not argv or argv[0] not in BENCHES:
        raise RelayError(f"bench needs one of: {', '.join(BENCHES)}")
    module, _, func = BENCHES[argv[0]].partition(":")
    return getattr(importlib.import_module(module), func or "main")(argv[1:])


COMMANDS = {
    "serve": _cmd_serve,
    "demo": _cmd_demo,
    "prepare-model": _cmd_prepare_model,
    "profile": _cmd_profile,
    "bench": _cmd_bench,
    "gpu-check": _cmd_gpu_check,
    "ship-key": _cmd_ship_key,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("demo", "bench"):
        # SIGTERM unwinds like Ctrl-C, so the server they started is stopped (finally)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"sglang-relay: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(command, argv[1:])


def run(command: Callable[[list[str]], int], argv: list[str]) -> int:
    """``command(argv)`` with the CLI's exit codes: a RelayError is one line and 1."""
    try:
        return command(argv)
    except RelayError as exc:
        print(f"sglang-relay: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
