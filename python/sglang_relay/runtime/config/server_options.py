"""The allow-list of SGLang server options (data: ``server_options.toml`` beside this file).

Every ``ServerArgs`` option (argparse dest) is ``neutral`` (any value), ``served`` (relay
serves it; the test that shows it; optionally only some values) or ``refused`` (its reason
and the way out). A relay server refuses, before any weights load, every option set to a
non-default value that is not neutral or served, naming the option; an option the table
does not know (one a newer SGLang added) is refused the same way. ``modes.py`` checks what
SGLang resolves by itself on top (page sizes, graph backends, architectures).

``python -m sglang_relay.runtime.config.server_options`` prints the table as Markdown
(``docs/server-options.md``; test/unit/test_server_options.py checks they agree).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

TABLE_PATH = Path(__file__).with_name("server_options.toml")
OUT = "or serve without relay (drop --radix-cache-backend relay / use --no-relay)"


@dataclass(frozen=True, slots=True)
class Served:
    """A served option: the test that shows it, its served values (None: any), the values
    among them that ran here (``ran``; None: every one did; the others are served by design
    and never ran) and whether it ran on the CPU stand-in only (``cpu_only``: on any other
    device it never ran)."""

    test: str
    values: tuple | None = None
    ran: tuple | None = None
    cpu_only: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    way_out: str


@dataclass(frozen=True, slots=True)
class OptionTable:
    neutral: frozenset[str]
    served: dict[str, Served]
    refused: dict[str, Refused]

    def classified(self) -> set[str]:
        return set(self.neutral) | set(self.served) | set(self.refused)

    def duplicates(self) -> set[str]:
        names = [*self.neutral, *self.served, *self.refused]
        return {n for n in names if names.count(n) > 1}


def parse_table(data: dict[str, Any]) -> OptionTable:
    served = {
        name: Served(
            entry["test"],
            tuple(entry["values"]) if "values" in entry else None,
            tuple(entry["ran"]) if "ran" in entry else None,
            bool(entry.get("cpu_only", False)),
        )
        for name, entry in data.get("served", {}).items()
    }
    refused = {
        name: Refused(entry["reason"], entry["way_out"])
        for name, entry in data.get("refused", {}).items()
    }
    return OptionTable(frozenset(data.get("neutral", {}).get("fields", [])), served, refused)


@functools.cache
def load_table() -> OptionTable:
    with TABLE_PATH.open("rb") as f:
        return parse_table(tomllib.load(f))


@functools.cache
def sglang_options() -> tuple[tuple[str, str, Any], ...]:
    """``(dest, flag, default)`` of every option of SGLang's server parser and every other
    ``ServerArgs`` field (Python API only)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    from sglang_relay.runtime.sglang.server import server_parser

    parser = server_parser()
    seen: dict[str, tuple[str, str, Any]] = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in seen:
            own = "--" + action.dest.replace("_", "-")
            flag = own if own in action.option_strings else max(action.option_strings, key=len)
            seen[action.dest] = (action.dest, flag, action.default)
    # fields with no flag, settable through the Python API (sglang.Engine(**kwargs))
    for field in record_fields(ServerArgs):
        if field.name not in seen:
            seen[field.name] = (field.name, f"ServerArgs.{field.name}", _field_default(field))
    return tuple(seen.values())


def _field_default(field: Any) -> Any:
    import dataclasses

    if getattr(field, "default", dataclasses.MISSING) is not dataclasses.MISSING:
        return field.default
    factory = getattr(field, "default_factory", dataclasses.MISSING)
    return None if factory is dataclasses.MISSING else factory()


def _differs(value: Any, default: Any) -> bool:
    if value is None and default is None:
        return False
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001 - values that do not compare are treated as set
        return True


def refusal(values: dict[str, Any], table: OptionTable | None = None) -> str | None:
    """The one-line refusal for the first option in ``values`` (dest -> value as typed:
    an argparse namespace's or a ServerArgs record's raw fields) that is set to a
    non-default value and is neither neutral nor served (with a served value), else None."""
    table = load_table() if table is None else table
    for dest, flag, default in sglang_options():
        if dest not in values or not _differs(values[dest], default):
            continue
        value = values[dest]
        if dest in table.neutral:
            continue
        served = table.served.get(dest)
        if served is not None:
            if served.values is None or value in served.values:
                continue
            allowed = ", ".join(str(v) for v in served.values)
            return (
                f"sglang-relay cannot serve {flag} {value} (served: {allowed}); use one of "
                f"those, {OUT}"
            )
        refused = table.refused.get(dest)
        shown = flag if isinstance(value, bool) else f"{flag} {value}"
        if refused is not None:
            return f"sglang-relay cannot serve {shown} ({refused.reason}); {refused.way_out}, {OUT}"
        return (
            f"sglang-relay has not classified {shown} (an SGLang option it was never checked "
            f"against, runtime/config/server_options.toml), so it refuses it; drop {flag}, {OUT}"
        )
    return None


def server_refusal(view: Any, server_args: Any, *, ship_role, architecture=None) -> str | None:
    """What relay refuses in a server's options, one message or None: the mode matrix
    (:mod:`.modes`) on SGLang's resolved ``view``, then this table on the options as typed.
    The scheduler's cache factory and, before any child starts, the plug-in in SGLang's own
    launcher (``plugin._refuse_before_children``) both ask it."""
    from sglang_relay.runtime.config import modes
    from sglang_relay.runtime.config.environment import environment_refusal

    message = modes.refusal(view, architecture=architecture, ship_role=ship_role)
    return message or environment_refusal() or refusal(typed_values(server_args))


def never_ran(values: dict[str, Any], device: str, table: OptionTable | None = None) -> list[str]:
    """The served option values of a server (``values``: dest -> value as typed, the
    resolved ``device`` apart) that no test of relay ever ran: served by design, unverified
    (docs/server-options.md, "ran here"). HiCache's layout options count only with HiCache
    on (their defaults then apply)."""
    table = load_table() if table is None else table
    flags = {dest: (flag, default) for dest, flag, default in sglang_options()}
    found = []
    for dest, served in sorted(table.served.items()):
        value = device if dest == "device" else values.get(dest)
        if value is None or (dest.startswith("hicache_") and not values.get(
            "enable_hierarchical_cache")):  # fmt: skip
            continue
        flag, default = flags.get(dest, (dest, None))
        if (served.ran is not None and value not in served.ran) or (
            served.cpu_only and device != "cpu" and _differs(value, default)
        ):
            found.append(f"{flag} {value}")
    return found


def typed_values(obj: Any) -> dict[str, Any]:
    """dest -> value of an argparse namespace or a ServerArgs record (its raw fields: SGLang
    0.5.23 keeps what was typed and records its own decisions apart)."""
    args = getattr(obj, "server_args", obj)
    return {dest: getattr(args, dest) for dest, _, _ in sglang_options() if hasattr(args, dest)}


def markdown(table: OptionTable | None = None) -> str:
    """The table as Markdown (docs/server-options.md)."""
    table = load_table() if table is None else table
    flags = {dest: flag for dest, flag, _ in sglang_options()}

    def flag(dest: str) -> str:
        return f"`{flags.get(dest, dest)}`"

    lines = [
        "# SGLang server options under relay",
        "",
        "Generated from `python/sglang_relay/runtime/config/server_options.toml` by",
        "`python -m sglang_relay.runtime.config.server_options > docs/server-options.md`",
        "(`test/unit/test_server_options.py` checks that the two agree and that every",
        "option of the installed SGLang is classified). A relay server refuses at start-up,",
        "before weights load, every option below that is **refused**, a **served** option",
        "set to a value not listed, and any option not in this table. A served value that",
        'no test ever ran ("ran here") is served by design: the server starts and logs one',
        "warning naming each such value it uses.",
        "",
        f"{len(table.served)} served, {len(table.neutral)} neutral, {len(table.refused)} refused.",
        "",
        "## Served",
        "",
        "| option | values | ran here | test |",
        "|---|---|---|---|",
    ]
    for dest in sorted(table.served):
        s = table.served[dest]
        values = ", ".join(f"`{v}`" for v in s.values) if s.values else "any"
        ran = ", ".join(f"`{v}`" for v in s.ran) if s.ran is not None else "all"
        ran = f"{ran}, on the CPU only" if s.cpu_only else ran
        lines.append(f"| {flag(dest)} | {values} | {ran} | `{s.test}` |")
    lines += ["", "## Refused (any value but SGLang's default)", "", "| option | why | way out |"]
    lines.append("|---|---|---|")
    for dest in sorted(table.refused):
        r = table.refused[dest]
        lines.append(f"| {flag(dest)} | {r.reason} | {r.way_out} |")
    lines += ["", "## Neutral (any value)", ""]
    lines.append(", ".join(flag(d) for d in sorted(table.neutral)))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
