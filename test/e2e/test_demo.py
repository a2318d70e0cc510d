"""The README's first command, end to end: ``sglang-relay demo`` (what ``make demo`` runs)
starts its own server, runs the packaged three-agent chain with relay and with standard
prefill, and must succeed, relay every downstream agent, and keep each agent's output close
to standard's (none collapses)."""

from __future__ import annotations

import json
import subprocess
import sys

# every agent's relay output shares at least this ROUGE-L with standard's
MIN_ROUGE_L = 0.5


def test_the_demo_command_relays_every_agent_without_collapse(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_relay.cli", "demo", "--json", str(out)],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    agents = {a["name"]: a for a in result["agents"]}
    assert list(agents) == ["Architect", "Developer", "Reviewer"]
    assert agents["Architect"]["identical"]  # nothing to relay: plain prefill both times
    for name in ("Developer", "Reviewer"):
        info = agents[name]["relay"]["relay"]
        assert info["reused_tokens"] > 100 and info["reuse_rate"] >= 0.7, info
    for name, agent in agents.items():
        assert not agent["collapsed"], (name, agent["relay"]["text"], agent["standard"]["text"])
        assert agent["rouge_l"] >= MIN_ROUGE_L, (name, agent["rouge_l"])
    assert "Reviewer" in proc.stdout and "TTFT" in proc.stdout  # the table was printed
