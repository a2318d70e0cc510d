"""The agent chains ``bench serve`` offers: each kind's prompts, agents and output lengths.

Every downstream prompt quotes earlier outputs *inside its own template*, after text that
differs from the upstream prompt, so the prefix cache cannot serve the quoted text and
relay can. Kinds:

- ``pipeline``: 3 agents, each reads all earlier outputs;
- ``fanin``: 3 independent experts, then an editor reads the three notes;
- ``groupchat``: 4 turns of a debate, each reads all earlier turns;
- ``fanout``: a lead writes a brief, four workers with their own roles read it at once;
- ``deep``: 5 agents in sequence, each reads every earlier agent's output (the context
  grows with the chain);
- ``toolloop``: one agent over 3 turns; between turns it waits for a tool (a pause drawn
  per chain, 30-120 s by default) whose output, new text, joins the next prompt with the
  agent's earlier steps. The prompt is rebuilt each turn with the turn number first, as
  frameworks that keep a step counter or state ahead of the history do, so its earlier
  steps are never a cached prefix: they must survive the pause (in the device pool, or a
  host tier) for relay to reuse them;
- ``plain``: one request that quotes nothing (the control).
"""

from __future__ import annotations

import random

KINDS = ("pipeline", "fanin", "groupchat", "fanout", "deep", "toolloop", "plain")

DEFAULT_MIX = "pipeline:0.4,fanin:0.2,groupchat:0.2,plain:0.2"

TOPICS = ["rate limiting", "B-trees", "TCP congestion control", "garbage collection",
          "consistent hashing", "ray tracing", "vector clocks", "bloom filters"]  # fmt: skip

FANOUT_ROLES = ("Writer", "Critic", "Tester", "Translator")

DEEP_ROLES = ("Analyst", "Architect", "Engineer", "Tester", "Reviewer")

TOOL_TURNS = 3

AGENTS = {"pipeline": 3, "fanin": 4, "groupchat": 4, "fanout": 1 + len(FANOUT_ROLES),
          "deep": len(DEEP_ROLES), "toolloop": TOOL_TURNS, "plain": 1}  # fmt: skip


def parse_mix(text: str) -> dict[str, float]:
    """``kind:weight,...`` -> normalized weights over :data:`KINDS`."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown chain kind {kind!r}; choose from {', '.join(KINDS)}")
        mix[kind] = float(weight or 1.0)
    total = sum(mix.values())
    if total <= 0 or any(w < 0 for w in mix.values()):
        raise ValueError(f"mix weights must be >= 0 and not all 0: {text!r}")
    return {k: w / total for k, w in mix.items()}


def tool_output(k: int, turn: int, lines: int = 6) -> str:
    """What chain ``k``'s tool returned after ``turn``: a small listing, fixed per (chain,
    turn), that no model decoded (so relay has nothing recorded for it)."""
    rng = random.Random(1_000_003 * k + turn)
    rows = [f"{rng.choice(('ok', 'warn', 'fail'))} case_{rng.randrange(1000)} "
            f"{rng.uniform(0, 100):.1f}ms" for _ in range(lines)]  # fmt: skip
    return "\n".join(rows)


def chain_prompts(
    kind: str, k: int, topic: str, outs: list[str], i: int | None = None
) -> tuple[str, str, bool]:
    """(system, user message, whether it quotes earlier outputs) of agent ``i`` of chain
    ``k`` (default ``len(outs)``: the agent after the earlier ones)."""
    i = len(outs) if i is None else i
    if kind == "plain":
        return f"Assistant {k}.", f"Explain {topic} in a few paragraphs.", False
    if kind == "pipeline":
        roles = ["Planner", "Engineer", "Reviewer"]
        quoted = "".join(f"\n\n{roles[j]} wrote:\n{o}" for j, o in enumerate(outs))
        task = ["Plan how to teach", "Write a worked example of", "Review the material on"][i]
        return f"You are the {roles[i]} ({k}).", f"{task} {topic}.{quoted}", i > 0
    if kind == "deep":
        quoted = "".join(f"\n\n{DEEP_ROLES[j]} wrote:\n{o}" for j, o in enumerate(outs[:i]))
        task = f"Do your part as the {DEEP_ROLES[i]} of a project on {topic}."
        return f"You are the {DEEP_ROLES[i]} ({k}).", f"{task}{quoted}", i > 0
    if kind == "toolloop":
        steps = "".join(f"\n\nYour step {j + 1}:\n{o}\n\nTool output {j + 1}:\n"
                        f"{tool_output(k, j)}" for j, o in enumerate(outs[:i]))  # fmt: skip
        head = f"Turn {i + 1} of {TOOL_TURNS}. Task: benchmark {topic} and report."
        return f"Agent ({k}) with a test runner.", f"{head}{steps}\n\nNext step.", i > 0
    if kind == "fanin":
        if i < 3:
            angle = ["its history", "how it works", "its pitfalls"][i]
            return f"Expert {i} ({k}).", f"Write about {topic}: {angle}.", False
        notes = "".join(f"\n\nNote {j + 1}:\n{o}" for j, o in enumerate(outs))
        return f"Editor ({k}).", f"Merge these notes on {topic} into one text.{notes}", True
    if kind == "fanout":
        if i == 0:
            return f"Lead ({k}).", f"Write a brief on {topic} for four specialists.", False
        role = FANOUT_ROLES[i - 1]
        task = f"Brief from the lead:\n{outs[0]}\n\nDo your part as the {role} on {topic}."
        return f"You are the {role} ({k}).", task, True
    turns = "".join(f"\n\nSpeaker {j % 2 + 1}: {o}" for j, o in enumerate(outs))
    return (
        f"Speaker {i % 2 + 1} of a debate ({k}).",
        f"Debate: is {topic} worth it?{turns}\n\nYour turn.",
        i > 0,
    )


def output_lengths(kind: str, out_tokens: int, answer_tokens: int | None) -> list[int]:
    """Output tokens of each agent of a ``kind`` chain: ``out_tokens``, except the last
    agent of a chain that reads earlier outputs (a fan-out's workers: every agent after the
    lead), which answers in ``answer_tokens`` (None: ``out_tokens`` too)."""
    n = AGENTS[kind]
    last = out_tokens if answer_tokens is None or kind == "plain" else answer_tokens
    if kind == "fanout":
        return [out_tokens] + [last] * (n - 1)
    return [out_tokens] * (n - 1) + [last]
