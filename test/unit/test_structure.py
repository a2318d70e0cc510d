"""The package's structure, read from its own source: no import circles (lazy imports inside
functions count: they are imports too), the runtime's layer map, and no module past its size
budget."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sglang_relay"
MAX_LINES = 440
# modules still over the budget, at most this long
OVER_BUDGET: dict[str, int] = {}


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Relay modules ``name`` imports anywhere in its source (a name imported from a module
    counts as that module, or as the submodule when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _circles(root: Path = PACKAGE) -> list[str]:
    """Modules from which an import path leads back to themselves."""
    known = _modules(root)
    graph = {m: _imports(m, p, known) for m, p in known.items()}

    def reach(start: str) -> set[str]:  # brute force: every module reachable from start
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    return sorted(m for m in graph if m in reach(m))


def test_no_module_imports_itself_through_others():
    assert not _circles(), f"modules on an import circle: {_circles()}"


# The runtime's layer map (runtime/__init__.py): a module may import its own layer and the
# layers before it. Modules directly in runtime/ are the leaf layer or the composition.
RUNTIME = "sglang_relay.runtime"
LAYERS = ("base", "models", "sglang", "config", "cache", "forward", "sched", "scale", "top")
TOP = {"runtime", "radix_cache", "plugin"}
STANDIN = f"{RUNTIME}.standin"


def _layer(module: str) -> str | None:
    """The runtime layer of ``module`` (None outside the runtime)."""
    if module != RUNTIME and not module.startswith(RUNTIME + "."):
        return None
    rest = module[len(RUNTIME) + 1 :].split(".") if module != RUNTIME else [""]
    if rest[0] in LAYERS[1:-1] or rest[0] == "standin":
        return rest[0]
    return "top" if rest[0] in TOP else "base"  # a module directly in runtime/


def _layer_violations(root: Path = PACKAGE) -> list[str]:
    known = _modules(root)
    out = []
    for name, path in sorted(known.items()):
        mine = _layer(name)
        for dep in sorted(_imports(name, path, known)):
            theirs = _layer(dep)
            if dep == STANDIN or dep.startswith(STANDIN + "."):
                if mine != "standin":
                    out.append(f"{name} imports the CPU stand-in {dep}")
            elif mine == "standin":
                if theirs == "top":
                    out.append(f"{name} (standin) imports the composition {dep}")
            elif name.startswith("sglang_relay.core") and theirs is not None:
                out.append(f"{name} (core) imports the runtime {dep}")
            elif mine is not None and theirs is not None:
                if theirs not in LAYERS or LAYERS.index(theirs) > LAYERS.index(mine):
                    out.append(f"{name} ({mine}) imports {dep} ({theirs}), a later layer")
    return out


def test_the_runtime_keeps_its_layer_map():
    """runtime/__init__.py's map: no layer imports a later one, no module outside the CPU
    stand-in imports it, core imports no runtime."""
    assert set(LAYERS) - {"base", "top"} | {"standin"} == {
        p.name for p in (PACKAGE / "runtime").iterdir() if (p / "__init__.py").exists()
    }
    assert _layer_violations() == []


def test_a_layer_violation_is_found(tmp_path):
    pkg = tmp_path / "python" / "sglang_relay"
    for sub in ("runtime", "runtime/cache", "runtime/forward", "runtime/standin", "core"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "cache" / "store.py").write_text("from ..forward.run import f\n")
    (pkg / "runtime" / "forward" / "run.py").write_text(
        "def f():\n    from sglang_relay.runtime.standin import cpu\n"
        "    from sglang_relay.runtime.cache import store\n"
    )
    (pkg / "runtime" / "standin" / "cpu.py").write_text("from sglang_relay.runtime import plugin\n")
    (pkg / "runtime" / "plugin.py").write_text("")
    (pkg / "core" / "x.py").write_text("import sglang_relay.runtime.cache.store\n")
    assert _layer_violations(pkg) == [
        "sglang_relay.core.x (core) imports the runtime sglang_relay.runtime.cache.store",
        "sglang_relay.runtime.cache.store (cache) imports sglang_relay.runtime.forward.run "
        "(forward), a later layer",
        "sglang_relay.runtime.forward.run imports the CPU stand-in sglang_relay.runtime.standin",
        "sglang_relay.runtime.forward.run imports the CPU stand-in "
        "sglang_relay.runtime.standin.cpu",
        "sglang_relay.runtime.standin.cpu (standin) imports the composition "
        "sglang_relay.runtime.plugin",
    ]


def test_a_circle_through_a_lazy_or_relative_import_is_found(tmp_path):
    pkg = tmp_path / "python" / "sglang_relay"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("def f():\n    from sglang_relay.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import g\n")
    (pkg / "c.py").write_text("import sglang_relay.a\n")
    (pkg / "d.py").write_text("from sglang_relay import a\n")  # on no circle
    assert _circles(pkg) == ["sglang_relay.a", "sglang_relay.c", "sglang_relay.sub.b"]


def test_every_module_is_within_its_size_budget():
    too_long = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        n = len(path.read_text().splitlines())
        if n > OVER_BUDGET.get(rel, MAX_LINES):
            too_long[rel] = n
    assert not too_long, f"split these modules (budget {MAX_LINES} lines): {too_long}"


def test_each_adapter_module_imports_first_in_a_fresh_interpreter():
    """An adapter imported before anything else of relay's must load (its package lists
    every adapter; the registry is built from that list)."""
    import subprocess
    import sys

    names = sorted(p.stem for p in (PACKAGE / "runtime" / "models" / "adapters").glob("[!_]*.py"))
    assert len(names) >= 8
    for n in names:
        module = f"sglang_relay.runtime.models.adapters.{n}"
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, (module, proc.stderr[-500:])


def test_no_two_test_files_share_a_name():
    """The test folders have no ``__init__.py``: pytest imports each test file by its base
    name, and a second file of the same name fails collection ("import file mismatch")."""
    root = PACKAGE.parents[1]
    names: dict[str, list[str]] = {}
    for folder in ("test", "kernels/tests"):
        for path in (root / folder).rglob("test_*.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
