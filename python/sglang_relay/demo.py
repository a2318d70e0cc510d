"""``sglang-relay demo``: a three-agent relay on a real SGLang server with the relay backend.

Each downstream prompt embeds the earlier agents' outputs inside its own template, which
is exactly the text that SGLang's prefix cache cannot reuse. The demo prints, per agent,
the prompt length, the tokens served from cache, the time to first token and the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_relay.client import Generation, flush_cache, generate

DEFAULT_WORKLOAD = "demo_chain.json"


@dataclass
class AgentResult:
    name: str
    generation: Generation


def load_chain(path: str | None) -> dict[str, Any]:
    if path is None:
        data = resources.files("sglang_relay.data").joinpath(DEFAULT_WORKLOAD)
        return json.loads(data.read_text())
    return json.loads(Path(path).read_text())


def chat_prompt(tokenizer: Any, system: str, user: str) -> str:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run_chain(url: str, chain: dict[str, Any], tokenizer: Any) -> list[AgentResult]:
    """Run the agents in order; agent i's template sees the outputs of agents < i by name."""
    outputs: dict[str, str] = {"task": chain["task"]}
    results = []
    params = {"max_new_tokens": int(chain.get("max_new_tokens", 128)), "temperature": 0.0}
    for agent in chain["agents"]:
        user = agent["template"].format(**outputs)
        gen = generate(url, chat_prompt(tokenizer, agent["system"], user), params)
        outputs[agent["name"]] = gen.text.strip()
        results.append(AgentResult(agent["name"], gen))
    return results


def _relay_cell(gen: Generation) -> str:
    relay = gen.relay
    if not relay:
        return "n/a"
    return f"{relay.get('reused_tokens', 0)} reused"


def format_table(results: list[AgentResult]) -> str:
    header = f"{'agent':<10} {'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'relay':>12}  output"
    lines = [header, "-" * len(header)]
    for r in results:
        g = r.generation
        first_line = g.text.strip().splitlines()[0] if g.text.strip() else ""
        lines.append(
            f"{r.name:<10} {g.prompt_tokens:>7} {g.cached_tokens:>7} {g.ttft_s * 1e3:>9.1f} "
            f"{_relay_cell(g):>12}  {first_line[:60]}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay demo", description=__doc__)
    parser.add_argument("--url", help="use a running server instead of starting one")
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument("--workload", help="chain JSON (default: the packaged demo chain)")
    parser.add_argument("--full-output", action="store_true", help="print whole outputs")
    args, server_flags = parser.parse_known_args(argv)

    from transformers import AutoTokenizer

    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.runtime.launch import ServerProcess

    model_path = args.model_path or str(ensure_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chain = load_chain(args.workload)
    print(f"[demo] {chain['name']}", flush=True)

    server = None
    url = args.url
    if url is None:
        print("[demo] starting SGLang with the relay backend on 127.0.0.1 ...", flush=True)
        server = ServerProcess(["--model-path", model_path, *server_flags]).start()
        url = server.url
    try:
        flush_cache(url)
        results = run_chain(url, chain, tokenizer)
    finally:
        if server is not None:
            server.stop()
    print(format_table(results))
    if args.full_output:
        for r in results:
            print(f"\n=== {r.name} ===\n{r.generation.text.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
