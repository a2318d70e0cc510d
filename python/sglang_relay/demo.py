"""``sglang-relay demo``: a three-agent relay on a real SGLang server with the relay backend.

Each downstream prompt embeds the earlier agents' outputs inside its own template, which
is exactly the text that SGLang's prefix cache cannot reuse. The demo prints, per agent,
the prompt length, the relayed tokens and reuse rate, and the time to first token with
relay and with plain SGLang's standard prefill (both pipelines on the same server).
Options it does not know go to the server it starts (on the embedded model its KV pool is
16,384 tokens unless ``--max-total-tokens`` or ``--mem-fraction-static`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_relay.client import Generation, flush_cache, generate
from sglang_relay.prompts import chat_prompt

DEFAULT_WORKLOAD = "demo_chain.json"


@dataclass
class AgentResult:
    name: str
    generation: Generation
    prompt: str = ""


def load_chain(path: str | None) -> dict[str, Any]:
    if path is None:
        data = resources.files("sglang_relay.data").joinpath(DEFAULT_WORKLOAD)
        return json.loads(data.read_text())
    return json.loads(Path(path).read_text())


def run_chain(
    url: str, chain: dict[str, Any], tokenizer: Any, method: str | None = None
) -> list[AgentResult]:
    """Run the agents in order; agent i's template sees the outputs of agents < i by name.
    ``method`` picks the relay method per request (None: the server's default)."""
    outputs: dict[str, str] = {"task": chain["task"]}
    results = []
    params: dict[str, Any] = {
        "max_new_tokens": int(chain.get("max_new_tokens", 128)),
        "temperature": 0.0,
    }
    if method is not None:
        params["custom_params"] = {"relay": method}
    for agent in chain["agents"]:
        user = agent["template"].format(**outputs)
        prompt = chat_prompt(tokenizer, agent["system"], user)
        # not streamed, as agent frameworks call: the early-stop guard covers these
        # (runtime/sched/guard.py); TTFT is the server's measure
        gen = generate(url, prompt, params, stream=False)
        outputs[agent["name"]] = gen.text.strip()
        results.append(AgentResult(agent["name"], gen, prompt))
    return results


def run_one_step(url: str, chain: dict[str, Any], relayed: list[AgentResult]) -> list[AgentResult]:
    """Standard prefill on each of the relay pipeline's own prompts: what the agent would
    have answered to the very prompt relay served, so relay's output against it is what
    relay does to one step, apart from the drift the upstream agents' outputs carry in."""
    params = {
        "max_new_tokens": int(chain.get("max_new_tokens", 128)),
        "temperature": 0.0,
        "custom_params": {"relay": "standard"},
    }
    return [
        AgentResult(r.name, generate(url, r.prompt, params, stream=False), r.prompt)
        for r in relayed
    ]


def agreement(a: str, b: str, encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """How output ``a`` compares with standard's ``b``: leading tokens shared, ROUGE-L, and
    whether ``a`` collapsed (:func:`sglang_relay.bench.evaluation.collapsed`)."""
    from sglang_relay.bench.evaluation import collapsed, first_divergence, rouge_l

    ta, tb = encode(a), encode(b)
    div = first_divergence(ta, tb)
    return {
        "identical": a == b,
        "same_tokens": len(ta) if div is None else div,
        "tokens": len(ta),
        "standard_tokens": len(tb),
        "rouge_l": round(rouge_l(ta, tb), 4),
        "collapsed": collapsed(ta, tb),
    }


def output_agreement(a: str, b: str, encode: Callable[[str], list[int]] | None) -> str:
    """``identical``, or how many leading tokens two outputs share (``same 37/160 tok``),
    and ``COLLAPSED`` when ``a`` stopped early or loops where ``b`` does not."""
    if a == b:
        return "identical"
    if encode is None:
        return "differs"
    agree = agreement(a, b, encode)
    note = "  COLLAPSED" if agree["collapsed"] else ""
    return f"same {agree['same_tokens']}/{agree['standard_tokens']} tok{note}"


def format_table(
    relay: list[AgentResult],
    standard: list[AgentResult],
    encode: Callable[[str], list[int]] | None = None,
    one_step: list[AgentResult] | None = None,
) -> str:
    """Relay on vs off, agent by agent (``encode``: text -> token ids, for the agreement).
    With ``one_step`` (standard prefill on the relay pipeline's own prompts), each row
    says what relay did to that step (``one step``) before what the whole chain drifted
    (``chain``: the standard pipeline, whose prompts hold standard's upstream outputs)."""
    header = (
        f"{'agent':<10} {'prompt':>6} {'relayed':>7} {'reuse':>6} "
        f"{'TTFT relay':>10} {'TTFT std':>9} {'speedup':>7}  "
        + ("one step | chain: output vs standard" if one_step else "output vs standard")
    )
    lines = [header, "-" * len(header)]
    steps = one_step if one_step is not None else [None] * len(relay)
    for on, off, step in zip(relay, standard, steps, strict=True):
        info = on.generation.relay or {}
        guard = info.get("guard")
        if isinstance(guard, dict):  # the early-stop guard redid it: show what was relayed
            info = guard.get("relayed") or {}
        speedup = off.generation.ttft_s / on.generation.ttft_s if on.generation.ttft_s else 0.0
        same = output_agreement(on.generation.text, off.generation.text, encode)
        if step is not None:
            one = output_agreement(on.generation.text, step.generation.text, encode)
            same = f"{one.replace('COLLAPSED', 'collapsed')} | chain: {same}"
        if isinstance(guard, dict):
            same += f"  (guard redid it: {guard.get('reason')})"
        lines.append(
            f"{on.name:<10} {on.generation.prompt_tokens:>6} {info.get('reused_tokens', 0):>7} "
            f"{info.get('reuse_rate', 0.0):>6.2f} {on.generation.ttft_s * 1e3:>8.0f}ms "
            f"{off.generation.ttft_s * 1e3:>7.0f}ms {speedup:>6.1f}x  {same}"
        )
    return "\n".join(lines)


def result_json(
    chain: dict[str, Any],
    relay: list[AgentResult],
    standard: list[AgentResult],
    encode: Callable[[str], list[int]],
    one_step: list[AgentResult] | None = None,
) -> dict[str, Any]:
    """The demo's outcome, agent by agent, for scripts and tests (``--json``): the
    agreement with the standard pipeline (the chain) and, with ``one_step``, with standard
    prefill on the relay pipeline's own prompt (``one_step``)."""
    agents = []
    steps = one_step if one_step is not None else [None] * len(relay)
    for on, off, step in zip(relay, standard, steps, strict=True):
        agents.append(
            {
                "name": on.name,
                "relay": {
                    "text": on.generation.text,
                    "ttft_s": on.generation.ttft_s,
                    "relay": on.generation.relay,
                },  # fmt: skip
                "standard": {"text": off.generation.text, "ttft_s": off.generation.ttft_s},
                **agreement(on.generation.text, off.generation.text, encode),
            }
        )
        if step is not None:
            agents[-1]["one_step"] = {
                "standard_text": step.generation.text,
                **agreement(on.generation.text, step.generation.text, encode),
            }
    return {"chain": chain["name"], "agents": agents}


# The embedded model's KV pool when the demo starts its server: two whole contexts (8,192
# tokens each), ~0.8 GB of float32 KV. The CPU server's default (65,536 tokens) would hold
# 2.3 GB more than any chain can use, on a machine that also runs the client and tokenizer.
EMBEDDED_KV_TOKENS = 16384


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay demo", description=__doc__)
    parser.add_argument("--url", help="use a running server instead of starting one")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument("--workload", help="chain JSON (default: the packaged demo chain)")
    parser.add_argument("--full-output", action="store_true", help="print whole outputs")
    parser.add_argument("--method", help="relay method for the relay pipeline (default: server's)")
    parser.add_argument("--json", help="also write the outputs and measures to this file")
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import ServerProcess, has_flag

    model_path = args.model_path or str(ensure_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chain = load_chain(args.workload)
    print(f"[demo] {chain['name']}", flush=True)

    server = None
    url = args.url
    if url is None:
        print("[demo] starting SGLang with the relay backend on 127.0.0.1 ...", flush=True)
        # --enable-metrics: the server then knows a whole-reply request's time to its first
        # token (meta_info["relay"]["ttft_s"]), the demo's TTFT
        flags = ["--model-path", model_path, "--enable-metrics", *server_flags]
        if args.model_path is None and not (
            has_flag(flags, "--max-total-tokens") or has_flag(flags, "--mem-fraction-static")
        ):
            flags += ["--max-total-tokens", str(EMBEDDED_KV_TOKENS)]
        server = ServerProcess(flags).start()
        url = server.url
    try:
        # Untimed requests first, one per method the pipelines use (first-request costs,
        # e.g. the first request that stores its hidden stream, would land on one
        # pipeline's first agent), then each pipeline starts from an empty cache, so
        # neither profits from the other.
        for warm in (args.method, "standard"):
            relay_opt = {"custom_params": {"relay": warm}} if warm else {}
            generate(url, chat_prompt(tokenizer, "Warm up.", "Hello"),
                     {"max_new_tokens": 8, **relay_opt})  # fmt: skip
        flush_cache(url)
        relayed = run_chain(url, chain, tokenizer, method=args.method)
        flush_cache(url)
        standard = run_chain(url, chain, tokenizer, method="standard")
        flush_cache(url)
        one_step = run_one_step(url, chain, relayed)
    finally:
        if server is not None:
            server.stop()
    print(f"[demo] relay method: {args.method or 'server default'}; standard = plain SGLang")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    print(format_table(relayed, standard, encode, one_step))
    if any("ttft_s" not in (r.generation.relay or {}) for r in [*relayed, *standard]):
        print("[demo] this server reports no time to first token for whole-reply requests "
              "(start it with --enable-metrics):\n       the TTFT columns show each "
              "request's whole latency")  # fmt: skip
    print(
        "[demo] outputs are greedy; relay reuses approximate KV, so a downstream agent's text\n"
        "       can drift from standard after its first tokens (see docs/fidelity.md).\n"
        "       one step: relay vs standard prefill of the same prompt (what relay did to\n"
        "       this agent); chain: vs the standard pipeline (drift carried in from upstream)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(result_json(chain, relayed, standard, encode, one_step), indent=1)
        )
    if args.full_output:
        for on, off in zip(relayed, standard, strict=True):
            print(f"\n=== {on.name} (relay) ===\n{on.generation.text.strip()}")
            print(f"\n=== {off.name} (standard) ===\n{off.generation.text.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
