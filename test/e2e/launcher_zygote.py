"""A preloaded parent for the tests' relay servers: each ``sglang-relay serve`` launcher
forks from one process per test process that already ran what every launcher runs first
(``serve``'s checks, which import most of SGLang to parse its arguments, and SGLang's server
modules: ~9-12 CPU s per start here, ``research/log.md``), instead of running it again in a
fresh interpreter.

The parent is a ``multiprocessing`` forkserver whose preload is this module: under the test
process's environment it runs ``serve``'s checks on a default server (twice: the second
time, on imported modules, shows what the checks set by themselves) and imports SGLang's
server modules with the collector paused (``import_gc``), recording every ``os.environ``
read; it loads no plug-in (relay's ``register`` reads the server's own environment). A
launcher forked from it runs ``serve`` unchanged: the checks again, the plug-ins loaded under
its own environment, SGLang's ``run_server``; its children start as a spawned launcher's do.

A launcher whose environment differs from the parent's, before or after the checks, in a
key the parent read or in any key outside ``SGLANG_*`` (a C library may read those without
os.environ), but a ``PYTHONPATH`` that only adds folders to the parent's (taken onto
``sys.path``; not if they hide a module the parent imported), replaces itself with a fresh
``sglang-relay serve`` (``os.execve``: the same pid, session and log, its own
environment), as it does if the parent did not preload or was not single-threaded. Its log
says which way it started. ``SGLANG_RELAY_TEST_ZYGOTE=0`` spawns every server as before."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

from sglang_relay.runtime.import_gc import collector_paused

ZYGOTE_ENV = "SGLANG_RELAY_TEST_ZYGOTE"
FORKED = "[sglang-relay tests] launcher forked from the preloaded parent"  # in its log


@dataclasses.dataclass
class Preload:
    """What the parent's preload left, read in each forked launcher."""

    pid: int | None = None  # the process that preloaded (the parent), once it succeeded
    spawn_env: dict[str, str] = dataclasses.field(default_factory=dict)  # it started with
    call_env: dict[str, str] = dataclasses.field(default_factory=dict)  # after the checks alone
    # what the imports set in it (SGLang: cache folders); None: removed
    import_sets: dict[str, str | None] = dataclasses.field(default_factory=dict)
    threads: int = 0  # running when the preload was done
    # every key its checks and imports read through os.environ: a launcher's value of one
    # of these may change what the parent's state would have been
    read_keys: set[str] = dataclasses.field(default_factory=set)
    imported: set[str] = dataclasses.field(default_factory=set)  # its top-level modules


PRELOAD = Preload()


@contextlib.contextmanager
def _recording_reads() -> Iterator[None]:
    """Inside, every ``os.environ[key]`` read (``get``, ``in``, ``setdefault``, copies: all
    go through ``__getitem__``) adds ``key`` to ``PRELOAD.read_keys``, but for
    :func:`_replace_environ`'s own."""
    cls = type(os.environ)
    original = cls.__getitem__

    def recorded(self, key):
        if not _quiet:
            PRELOAD.read_keys.add(key)
        return original(self, key)

    cls.__getitem__ = recorded
    try:
        yield
    finally:
        cls.__getitem__ = original


_quiet: list[bool] = []


def _replace_environ(env: dict[str, str]) -> None:
    _quiet.append(True)
    try:
        os.environ.clear()
        os.environ.update(env)
    finally:
        _quiet.pop()


def _snapshot() -> dict[str, str]:
    _quiet.append(True)
    try:
        return dict(os.environ)
    finally:
        _quiet.pop()


def _differ(a: dict[str, str], b: dict[str, str]) -> dict[str, str | None]:
    """``b``'s value of every key whose value differs in ``a`` (None: not in ``b``)."""
    return {k: b.get(k) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _preload() -> None:
    """What ``serve`` runs before SGLang's imports (its checks, on a default server), then the
    imports. The checks run twice from the same environment: the second time on imported
    modules, so it shows what the checks set by themselves, as they do again in each forked
    launcher, apart from what their first imports set."""
    import json

    from sglang_relay import launch
    from sglang_relay.embedded_model import ensure_model
    from sglang_relay.process import free_port
    from sglang_relay.runtime.sglang.server import import_server_modules

    env_file = os.environ.pop(PARENT_ENV)
    with open(env_file) as f:
        spawned_with = json.load(f)  # the test process's environment when it started this one
    with contextlib.suppress(OSError):
        os.remove(env_file)
    argv = ["--model-path", str(ensure_model(quiet=True)), "--port", str(free_port())]
    with collector_paused(), _recording_reads(), _plugins_not_loaded():
        _replace_environ(spawned_with)
        launch.prepare(argv)  # as a launcher runs it: its imports too
        first = _snapshot()
        _replace_environ(spawned_with)
        launch.prepare(argv)  # the checks alone
        call_env = _snapshot()
        _replace_environ(first)
        import_server_modules()
    PRELOAD.import_sets.update(_differ(call_env, dict(os.environ)))
    from sglang.srt import plugins

    if plugins._plugins_loaded:  # something loaded them anyway: every launcher spawned
        return
    PRELOAD.call_env.update(call_env)
    PRELOAD.spawn_env.update(spawned_with)
    PRELOAD.threads = threading.active_count()
    PRELOAD.imported.update(name.partition(".")[0] for name in sys.modules)
    PRELOAD.pid = os.getpid()


@contextlib.contextmanager
def _plugins_not_loaded() -> Iterator[None]:
    """``serve``'s checks load SGLang's plug-ins (its parser takes their options); here they
    are not loaded, so each forked launcher's checks load them itself, under its own
    environment (relay's ``register`` reads its opt-ins, e.g. ``SGLANG_RELAY_CPU_LORA``),
    after the imports, as SGLang's own workers and the stand-in's forkserver load them."""
    from sglang_relay.runtime.sglang import server

    loader = server.load_sglang_plugins
    server.load_sglang_plugins = lambda: None
    try:
        yield
    finally:
        server.load_sglang_plugins = loader


def _as_imports_left_it() -> None:
    """This process's environment as the parent's imports changed theirs (the same
    environment before them, so the same changes)."""
    for key, value in PRELOAD.import_sets.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# set in the parent only: where the environment it is to import under is
PARENT_ENV = "SGLANG_RELAY_TEST_ZYGOTE_PARENT_ENV"
# Keys a launcher may differ in from the parent if the parent never read them (read_keys):
# SGLang's and relay's own, which no C library reads (Python code reads them through
# os.environ). Any other key may be read by a library below Python (OpenMP, CUDA, the C
# library itself) without read_keys knowing.
MAY_DIFFER_PREFIX = "SGLANG_"
# A launcher's PYTHONPATH may add folders to the parent's if they hide none of its imports:
# the forked launcher puts them on sys.path, which is all the interpreter makes of it; its
# readers in the preload are serve's checks (cpu_setup adds the stand-in's folder; the
# settings checks copy the environment), which run again in the launcher.
PATH_KEY = "PYTHONPATH"

if __name__ != "__main__" and os.environ.get(PARENT_ENV):
    _preload()


def why_not_forked(environ: dict[str, str], parent: dict[str, str]) -> str | None:
    """Why a launcher with ``environ`` must not run on the parent's imports, whose
    environment at the same step was ``parent``; or None."""
    if PRELOAD.pid is None or PRELOAD.pid != os.getppid():
        return "the parent did not preload"
    if PRELOAD.threads != 1:
        return f"the parent ran {PRELOAD.threads} threads when it forked"
    differ = sorted(_differ(parent, environ))
    if PATH_KEY in differ:
        dirs = added_dirs(environ, parent)
        if dirs is not None:  # sys.path takes them (run_launcher); unless they hide an import
            hidden = sorted(_shadowed(dirs))
            if hidden:
                return f"its {PATH_KEY} hides modules the parent imported: {', '.join(hidden)}"
            differ.remove(PATH_KEY)
    foreign = [k for k in differ if k in PRELOAD.read_keys or not k.startswith(MAY_DIFFER_PREFIX)]
    if foreign:
        shown = ", ".join(f"{k} ({parent.get(k)!r} -> {environ.get(k)!r})" for k in foreign[:4])
        return f"its environment differs from the parent's: {shown}"
    return None


def _path(env: dict[str, str]) -> list[str]:
    return [p for p in env.get(PATH_KEY, "").split(os.pathsep) if p]


def added_dirs(environ: dict[str, str], parent: dict[str, str]) -> list[str] | None:
    """The folders ``environ``'s ``PYTHONPATH`` adds to ``parent``'s (a test plug-in's
    folder), or None where it is not ``parent``'s with folders added (an entry removed or
    moved)."""
    extra, theirs = [], iter(_path(parent))
    want = next(theirs, None)
    for entry in _path(environ):
        if entry == want:
            want = next(theirs, None)
        else:
            extra.append(entry)
    return extra if want is None else None


def _shadowed(dirs: list[str]) -> set[str]:
    """Top-level modules the parent imported that a module or package in ``dirs`` would
    hide, had the launcher started with them on its path."""
    names: set[str] = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            names.update(entry.partition(".")[0] for entry in os.listdir(d))
    return names & PRELOAD.imported


def run_launcher(command: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """The forked launcher: its own session, the log on stdout and stderr, ``env`` as its
    whole environment; then ``serve`` on the parent's imports, or a fresh one (exec)."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        code = _serve_or_exec(command, env)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_or_exec(command: list[str], env: dict[str, str]) -> int:
    from sglang_relay import cli, launch

    if command[:4] != [sys.executable, "-m", "sglang_relay.cli", "serve"]:
        _exec(command, env, "not the parent's interpreter running `sglang_relay.cli serve`")

    why = why_not_forked(env, PRELOAD.spawn_env)
    if why is not None:
        _exec(command, env, why)
    # a PYTHONPATH that adds folders: on the path, as a fresh interpreter would have them
    sys.path[0:0] = added_dirs(env, PRELOAD.spawn_env) or []
    importlib.invalidate_caches()

    def checked() -> None:  # serve's checks have set the environment; SGLang not imported yet
        why = why_not_forked(dict(os.environ), PRELOAD.call_env)
        if why is not None:
            _exec(command, env, why)
        _as_imports_left_it()
        print(FORKED, flush=True)

    return cli.run(lambda argv: launch.serve(argv, after_checks=checked) or 0, command[4:])


def _exec(command: list[str], env: dict[str, str], why: str) -> None:
    """A fresh launcher in this process (its pid, session and log), as a spawn would be."""
    print(f"[sglang-relay tests] fresh launcher: {why}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


# ---- the test process's side: the parent started once, launchers forked from it


class ForkedLauncher:
    """A launcher forked from the parent, seen as :class:`subprocess.Popen` sees a child."""

    def __init__(self, process) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout)
        return self._process.exitcode


def launcher_env(extra: dict[str, str] | None) -> dict[str, str]:
    """A test server's environment: this test process's as it was at its first server start
    (what the parent started with; not what its own imports set in it since, e.g. SGLang's
    cache folders: a launcher started from a shell does not get its client's either) and
    the server's own ``extra``; without pytest's name of the current test, which differs
    from server to server and which no server reads."""
    with _lock:
        if not _base:
            _base.update(os.environ)
            _base.pop("PYTEST_CURRENT_TEST", None)
    return {**_base, **(extra or {})}


def start_launcher(command: list[str], log_path: str, env: dict[str, str]):
    """A launcher with ``env`` forked from this test process's preloaded parent (started on
    first use), or None where the parent cannot serve (then the caller spawns one)."""
    if os.environ.get(ZYGOTE_ENV) == "0" or not sys.platform.startswith("linux"):
        return None
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    with _lock:
        # this process's forkserver is the parent alone: one some other code started
        # (another preload) is left to it
        running = forkserver._forkserver._forkserver_pid is not None
        if running and not _started:
            return None
        if not running:
            import json
            import tempfile

            ctx.set_forkserver_preload([__name__])
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(_base, f)
            # multiprocessing's forkserver imports its preload before it takes the caller's
            # sys.path (Python 3.11): this folder on its PYTHONPATH (its imports run under
            # the environment the file holds, without it)
            here = os.path.dirname(os.path.abspath(__file__))
            saved = {k: os.environ.get(k) for k in (PARENT_ENV, "PYTHONPATH")}
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            os.environ.update({PARENT_ENV: f.name, "PYTHONPATH": path})
            try:
                forkserver.ensure_running()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            _started.append(True)
    process = ctx.Process(
        target=run_launcher,
        args=(command, env, log_path, os.getcwd()),
        name="sglang-relay-launcher",
    )
    process.start()
    return ForkedLauncher(process)


_lock = threading.Lock()
_started: list[bool] = []
_base: dict[str, str] = {}
