"""AutoGen AgentChat group chat (Architect -> Developer -> Reviewer) on a relay server.

A ``RoundRobinGroupChat`` of three ``AssistantAgent``\\ s sharing one
``OpenAIChatCompletionClient`` pointed at the server's OpenAI API. Every agent sees the
conversation so far, so each prompt holds the earlier agents' replies, which this server
generated: relay reuses their KV instead of prefilling them again. Nothing here is
relay-specific but the counters read to report it.

    sglang-relay serve --port 30000 --enable-metrics
    python examples/autogen_group_chat.py --base-url http://127.0.0.1:30000/v1

Through sglang-router (``--policy manual``), ``--chain-key K`` sends ``X-SMG-Routing-Key: K``
on every request of the chat, so all its agents land on the worker that holds their spans;
pass the workers' URLs with ``--worker-url`` to read the counters there.
"""

from __future__ import annotations

import asyncio
from typing import Any

from relay_share import ROUTING_HEADER, Measured, example_args, measure, print_report

TASK = (
    "We need a Python function that merges overlapping intervals in a list of (start, end) pairs."
)
AGENTS = [
    (
        "Architect",
        "You are a software architect. Write a short numbered design spec for the task: "
        "inputs, outputs, edge cases, complexity.",
    ),
    (
        "Developer",
        "You are a Python developer. Implement the architect's spec as one Python function "
        "with a docstring.",
    ),
    (
        "Reviewer",
        "You are a code reviewer. Review the developer's code against the architect's spec "
        "and list concrete problems.",
    ),
]
# SmolLM2 and most local models: plain chat, no tools, no JSON mode
MODEL_INFO = {
    "vision": False,
    "function_calling": False,
    "json_output": False,
    "structured_output": False,
    "family": "unknown",
}


def make_client(
    base_url: str,
    *,
    chain_key: str | None = None,
    max_tokens: int = 96,
    extra_body: dict[str, Any] | None = None,
):
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    kwargs: dict[str, Any] = {}
    if chain_key is not None:  # passed to openai.AsyncOpenAI(default_headers=...)
        kwargs["default_headers"] = {ROUTING_HEADER: chain_key}
    if extra_body:  # a create argument: sent in every request's body
        kwargs["extra_body"] = extra_body
    return OpenAIChatCompletionClient(
        model="default",
        base_url=base_url,
        api_key="none",
        model_info=MODEL_INFO,
        temperature=0,
        max_tokens=max_tokens,
        **kwargs,
    )


async def run_chat(task: str, client, rounds: int) -> tuple[list[tuple[str, str]], str | None]:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat

    agents = [
        AssistantAgent(name, model_client=client, system_message=system) for name, system in AGENTS
    ]
    # the task is a message too: then every agent speaks ``rounds`` times
    team = RoundRobinGroupChat(
        agents, termination_condition=MaxMessageTermination(1 + rounds * len(agents))
    )
    try:
        result = await team.run(task=task)
    finally:
        await client.close()
    return [(m.source, m.to_text()) for m in result.messages], result.stop_reason


def run(
    base_url: str,
    task: str = TASK,
    chain_key: str | None = None,
    max_tokens: int = 96,
    *,
    rounds: int = 1,
    extra_body: dict[str, Any] | None = None,
    counter_urls: list[str] | None = None,
) -> Measured:
    """Run the group chat against ``base_url`` (an OpenAI ``.../v1`` URL); ``value`` is
    ``(messages, stop_reason)``: (source, content) pairs, the task first."""
    client = make_client(
        base_url, chain_key=chain_key, max_tokens=max_tokens, extra_body=extra_body
    )
    return measure(base_url, counter_urls, lambda: asyncio.run(run_chat(task, client, rounds)))


def main() -> None:
    ap = example_args(__doc__.split("\n")[0], TASK)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    res = run(
        args.base_url,
        args.task,
        args.chain_key,
        args.max_tokens,
        rounds=args.rounds,
        counter_urls=args.worker_url,
    )
    messages, stop_reason = res.value
    print_report(messages, res, f"stop: {stop_reason}  ")


if __name__ == "__main__":
    main()
