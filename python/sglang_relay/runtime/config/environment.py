"""SGLang's environment variables under relay (data: ``environment.toml`` beside this file).

SGLang 0.5.23 reads ~770 ``SGLANG_*`` variables from one registry (``sglang.srt.environ.Envs``),
grouped in sections. A relay server classifies each by its section (neutral or
unverified) or by name (served, refused): a refused one set refuses the server at start-up
(:func:`environment_refusal`, with the option table's refusal), an unverified one set is
named in one start-up warning (:func:`unverified_set`). test/unit/test_server_options.py
fails on a section the table does not classify.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

import tomllib

TABLE_PATH = Path(__file__).with_name("environment.toml")
_HEADER = re.compile(r"^\s*# =+\s*$")
_FIELD = re.compile(r"^    ([A-Z][A-Z0-9_]*)\s*(?::[^=]*)?=\s*Env")


@functools.cache
def table() -> dict:
    with TABLE_PATH.open("rb") as f:
        return tomllib.load(f)


@functools.cache
def sglang_sections() -> dict[str, str]:
    """variable -> its section title in the installed SGLang's ``Envs`` (from the class
    source: a title line between two ``# ====`` lines)."""
    import inspect

    from sglang.srt.environ import Envs

    lines = inspect.getsource(Envs).splitlines()
    found, section = {}, ""
    for i, line in enumerate(lines):
        if _HEADER.match(line) and i + 2 < len(lines) and _HEADER.match(lines[i + 2]):
            section = lines[i + 1].strip().lstrip("#").strip()
            continue
        m = _FIELD.match(line)
        if m:
            found[m.group(1)] = section
    return found


def classify(name: str) -> str:
    """``refused``, ``served``, ``neutral`` or ``unverified`` for an SGLang variable (a
    section the table does not list counts as unverified)."""
    t = table()
    if name in t.get("refused", {}):
        return "refused"
    if name in t.get("served", {}).get("names", []):
        return "served"
    section = sglang_sections().get(name)
    return "neutral" if section in t["sections"]["neutral"] else "unverified"


def _set(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name)
    if value is None:
        return False
    from sglang.srt.environ import EnvBool, Envs

    field = vars(Envs).get(name)
    if isinstance(field, EnvBool):  # as SGLang's parser reads it
        return value.lower() in ("true", "1", "yes", "y")
    return value != ""


def environment_refusal(environ: Mapping[str, str] | None = None) -> str | None:
    """The refusal for the first refused SGLang variable set in ``environ`` (default: this
    process's), else None."""
    import os

    from sglang_relay.runtime.config.modes import OUT

    environ = os.environ if environ is None else environ
    for name, entry in table().get("refused", {}).items():
        if _set(environ, name):
            return (f"sglang-relay cannot serve {name}={environ[name]} ({entry['reason']}); "
                    f"{entry['way_out']}, {OUT}")  # fmt: skip
    return None


def unverified_set(environ: Mapping[str, str] | None = None) -> list[str]:
    """The SGLang variables set in ``environ`` whose effect relay's tests never ran."""
    import os

    environ = os.environ if environ is None else environ
    known = sglang_sections()
    return sorted(
        n for n in environ if n in known and classify(n) == "unverified" and _set(environ, n)
    )
