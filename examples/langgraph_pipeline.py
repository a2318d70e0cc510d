"""LangGraph pipeline (planner -> writer -> critic) on a relay server.

A ``StateGraph`` of three nodes, each one ``ChatOpenAI`` call pointed at the server's
OpenAI API whose prompt quotes what the earlier nodes wrote. Those quotes were generated
by this server: relay reuses their KV instead of prefilling them again. Nothing here is
relay-specific but the counters read to report it.

    sglang-relay serve --port 30000 --enable-metrics
    python examples/langgraph_pipeline.py --base-url http://127.0.0.1:30000/v1

Through sglang-router (``--policy manual``), ``--chain-key K`` sends ``X-SMG-Routing-Key: K``
on every request of the pipeline, so all its nodes land on the worker that holds their
spans; pass the workers' URLs with ``--worker-url`` to read the counters there.
"""

from __future__ import annotations

from typing import Any, TypedDict

from relay_share import ROUTING_HEADER, Measured, example_args, measure, print_report

TASK = "Write a short blog post on why unit tests make refactoring safer."


class State(TypedDict, total=False):
    task: str
    plan: str
    draft: str
    critique: str


NODES = ("plan", "draft", "critique")


def messages(state: State) -> list[tuple[str, str]]:
    """(node output, text) of a final state, in pipeline order."""
    return [(k, state[k]) for k in NODES if k in state]


def make_llm(
    base_url: str,
    *,
    chain_key: str | None = None,
    max_tokens: int = 96,
    extra_body: dict[str, Any] | None = None,
):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="default",
        base_url=base_url,
        api_key="none",
        temperature=0,
        max_tokens=max_tokens,
        default_headers={ROUTING_HEADER: chain_key} if chain_key is not None else None,
        extra_body=extra_body,
    )


def build_graph(llm):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    def ask(system: str, user: str) -> str:
        return llm.invoke([SystemMessage(system), HumanMessage(user)]).content

    def planner(state: State) -> State:
        plan = ask(
            "You are a planner. Answer with a numbered outline only.",
            f"Task: {state['task']}\n\nWrite the outline.",
        )
        return {"plan": plan}

    def writer(state: State) -> State:
        draft = ask(
            "You are a writer. Follow the outline closely.",
            f"Task: {state['task']}\n\nOutline:\n{state['plan']}\n\nWrite the text.",
        )
        return {"draft": draft}

    def critic(state: State) -> State:
        critique = ask(
            "You are a critic. Be specific and brief.",
            f"Task: {state['task']}\n\nOutline:\n{state['plan']}\n\n"
            f"Draft:\n{state['draft']}\n\nDoes the draft follow the outline? List fixes.",
        )
        return {"critique": critique}

    graph = StateGraph(State)
    graph.add_node("planner", planner)
    graph.add_node("writer", writer)
    graph.add_node("critic", critic)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "writer")
    graph.add_edge("writer", "critic")
    graph.add_edge("critic", END)
    return graph.compile()


def run(
    base_url: str,
    task: str = TASK,
    chain_key: str | None = None,
    max_tokens: int = 96,
    *,
    extra_body: dict[str, Any] | None = None,
    counter_urls: list[str] | None = None,
) -> Measured:
    """Run the pipeline against ``base_url`` (an OpenAI ``.../v1`` URL); ``value`` is its
    final state."""
    app = build_graph(
        make_llm(base_url, chain_key=chain_key, max_tokens=max_tokens, extra_body=extra_body)
    )
    return measure(base_url, counter_urls, lambda: app.invoke({"task": task}))


def main() -> None:
    args = example_args(__doc__.split("\n")[0], TASK).parse_args()
    res = run(
        args.base_url, args.task, args.chain_key, args.max_tokens, counter_urls=args.worker_url
    )
    print_report(messages(res.value), res)


if __name__ == "__main__":
    main()
