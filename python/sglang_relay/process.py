"""Managed server processes for the demo, the benchmarks and the tests: a relay server or an
sglang-router on a free port, started, waited for and stopped with every child it spawned."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_relay.errors import RelayError

DEFAULT_HOST = "127.0.0.1"


# Flags whose value is the next argv item, under all of their spellings.
_ALIASES = {"--model-path": ("--model-path", "--model")}


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argparse-style argv (``--f v`` or ``--f=v``), else None."""
    names = _ALIASES.get(flag, (flag,))
    value = None
    for i, item in enumerate(argv):
        for name in names:
            if item == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif item.startswith(name + "="):
                value = item.split("=", 1)[1]
    return value


def has_flag(argv: list[str], flag: str) -> bool:
    names = _ALIASES.get(flag, (flag,))
    return any(item == n or item.startswith(n + "=") for item in argv for n in names)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound now (None: it can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def check_port_free(host: str, port: int) -> None:
    exc = _bind_error(host, port)
    if exc is not None:
        raise RelayError(f"port {port} on {host} is not available ({exc.strerror})") from exc


# Ports handed out without being asked for: the kernel's ephemeral range (every connect()
# and bind(0), e.g. gloo's sockets under TP) and the range SGLang picks its NCCL/gloo
# rendezvous port from (server_args.PortArgs). A port picked inside either can be taken
# between the pick and the child's own bind (seen: uvicorn's bind failed under --tp 2).
SGLANG_RENDEZVOUS_PORTS = (22000, 29999)


PICK_PORTS = (10000, SGLANG_RENDEZVOUS_PORTS[0] - 1)


_rng = random.SystemRandom()  # a test's random.seed() must not make two pickers agree


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = DEFAULT_HOST, attempts: int = 64) -> int:
    """A port that was free a moment ago, from a range no other socket is handed unasked
    (see PICK_PORTS), so only an explicit bind elsewhere can take it before the child binds."""
    low, high = PICK_PORTS[0], min(PICK_PORTS[1], _ephemeral_low() - 1)
    if high - low >= attempts:
        for port in _rng.sample(range(low, high + 1), attempts):
            if _bind_error(host, port) is None:
                return port
    while True:  # a crowded or unusual machine: whatever the kernel gives
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < 60000:
            return port


# How long a child may take to become ready: SGLang's start-up (imports, model load, pool)
# takes 15-40 s on an idle 2-core VM and several times that beside other CPU-heavy work.
START_TIMEOUT_S = 600.0


# How uvicorn, the router and `serve`'s own port check report a port taken since it was
# picked (case aside).
BIND_FAILURE = "address already in use"


TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct")


def first_traceback(lines: list[str]) -> tuple[int, int] | None:
    """Where the first Python traceback in a log's ``lines`` is, ``(start, end)``: from the
    line that starts it (e.g. SGLang's "Scheduler hit an exception: Traceback ..."), through
    its chained tracebacks, to its exception's first line; None if there is none."""
    start = next((i for i, ln in enumerate(lines) if TRACEBACK in ln), None)
    if start is None:
        return None
    end = start + 1
    while end < len(lines):
        line = lines[end]
        if line.startswith((" ", "\t", *CHAINED)) or not line.strip() or TRACEBACK in line:
            end += 1
            continue
        # the exception's line: a chained traceback may follow its message's further lines
        k = end + 1
        while k < len(lines) and k - end <= 20 and lines[k].strip():
            k += 1
        if k + 1 < len(lines) and not lines[k].strip() and lines[k + 1].startswith(CHAINED):
            end = k + 1
            continue
        return start, end + 1
    return start, end


@dataclass
class _ChildProcess:
    """A child process serving HTTP on loopback, in its own process group, logging to a file.
    Subclasses say what to run (:meth:`command`) and when it is ready (:meth:`ready`)."""

    args: list[str]
    host: str = DEFAULT_HOST
    port: int = 0
    log_path: str = ""
    env: dict[str, str] | None = None  # added to this process's environment
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _log_offset: int = field(default=0, init=False, repr=False)  # where this launch's log starts
    _stopped: bool = field(default=False, init=False, repr=False)
    name = "process"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = START_TIMEOUT_S, bind_retries: int = 2):
        """Launch and wait until :meth:`ready`. A child that could not bind the port this
        object picked (taken since the pick) is stopped and relaunched on a new one, up to
        ``bind_retries`` times; a port the caller chose is never changed."""
        picked = not self.port
        if picked:
            self.port = free_port(self.host)
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-relay-{self.name}-", suffix=".log")
            os.close(fd)
        for attempt in range(bind_retries + 1):
            self._launch(append=attempt > 0)
            if self._wait(time.monotonic() + timeout, timeout):
                return self
            self.stop()
            if not picked or attempt == bind_retries:
                raise RelayError(
                    f"{self.name} could not bind a port (address already in use; its HTTP "
                    f"port was {self.port}); log: {self.log_path}\n{self.log_tail()}"
                )
            self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _launch(self, *, append: bool) -> None:
        with open(self.log_path, "ab" if append else "wb") as log:
            if append:
                log.write(f"\n--- relaunched on port {self.port} ---\n".encode())
                log.flush()
            self._log_offset = log.tell()
            self._stopped = False
            env = None if self.env is None else {**os.environ, **self.env}
            self.proc = self._start_child(self.command(), log, env)

    def _start_child(self, command: list[str], log, env: dict[str, str] | None):
        """The child, in a session of its own, logging to ``log``: a :class:`subprocess.Popen`
        or an object with its ``pid``, ``returncode``, ``poll`` and ``wait``."""
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def _wait(self, deadline: float, timeout: float) -> bool:
        """True once ready; False if this launch failed to bind its port (it may still be
        running: SGLang's schedulers outlive a failed HTTP bind) or another process answers
        on it. Raises on anything else."""
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None  # before reading the log: then it is whole
            if self._bind_failed(exited):
                return False
            if exited:
                self.stop()  # its children may outlive it
                raise RelayError(
                    f"{self.name} exited with code {self.proc.returncode} during start-up; "
                    f"log: {self.log_path}\n{self.failure_excerpt()}"
                )
            if self.ready():  # and not another process answering on the port
                return self._listens()
            time.sleep(0.5)
        self.stop()
        raise RelayError(
            f"{self.name} did not become ready in {timeout:.0f}s; log: {self.log_path}"
        )

    def _bind_failed(self, exited: bool) -> bool:
        """This launch's log reports a port in use: on a line naming its HTTP port (uvicorn,
        ``serve``'s own check), or anywhere if it died of it (the router names no port)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace").lower()
        except OSError:
            return False
        if BIND_FAILURE not in text:
            return False
        port = re.compile(rf"(?<!\d){self.port}(?!\d)")
        return exited or any(BIND_FAILURE in ln and port.search(ln) for ln in text.splitlines())

    def _listens(self) -> bool:
        """Whether the process answering on the port is this child (or one of its group)."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        for proc in procs:
            try:
                # psutil < 6 calls it connections()
                conns = getattr(proc, "net_connections", proc.connections)(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns):
                return True
        return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def failure_excerpt(self, n: int = 30, limit: int = 60) -> str:
        """This launch's last ``n`` log lines, after its first traceback (at most its last
        ``limit`` lines) where that ends before them: a child that failed shows the error
        that started it (e.g. a scheduler's exception), not only its launcher's report of a
        rank that died."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        tail_from = max(0, len(lines) - n)
        found = first_traceback(lines)
        if found is None or found[1] > tail_from:
            return "\n".join(lines[tail_from:])
        start, end = found
        first = (
            lines[start:end]
            if end - start <= limit
            else [lines[start], "...", *lines[end - limit + 2 : end]]
        )
        last = lines[tail_from:]
        return "\n".join(["first error in the log:", *first, "...", "last lines:", *last])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the whole process group (e.g. tokenizer, scheduler, detokenizer); wait for it."""
        if self.proc is None or self._stopped:
            return
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            self._wait_for_leader(timeout)
        try:
            os.killpg(pgid, signal.SIGKILL)  # stragglers, also of a leader that died first
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=timeout)
        # a killed scheduler may take a moment to go (SGLang's crash handler sleeps 5 s
        # before its diagnostics): return once no member of the group is left running
        _wait_group_gone(pgid, timeout)
        self._stopped = True  # its pid (the group's id) may be reused from now on

    def _wait_for_leader(self, timeout: float) -> None:
        """After SIGTERM to the group: wait for the leader to exit. Once every process it
        started has exited (they got the SIGTERM too) it has nothing left to drain; SGLang's
        HTTP server only notices its shutdown flag on a 5 s poll, so after
        :data:`LEADER_GRACE` it is killed rather than waited for (:meth:`stop` then kills
        what is left of the group)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if not _has_live_workers(self.proc.pid):
                try:
                    self.proc.wait(timeout=LEADER_GRACE)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.proc.pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# how long a leader whose workers have all exited may take to exit on its own
LEADER_GRACE = 0.5


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    import psutil

    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
    return members


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait (at most ``timeout`` s) until group ``pgid`` has no live member (a SIGKILL'd
    process is only slow to go; each is sent SIGKILL again while it is seen)."""
    deadline = time.monotonic() + timeout
    while (left := _group_members(pgid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _has_live_workers(pid: int) -> bool:
    """Whether ``pid`` has a live (not zombie) descendant other than ``multiprocessing``'s
    resource tracker (which must outlive it to clean up)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                "resource_tracker" in part for part in child.cmdline()
            ):
                return True
    return False


def _get_ok(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


@dataclass
class ServerProcess(_ChildProcess):
    """A ``sglang-relay serve`` child process; ``args`` are its serve flags."""

    name = "server"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_relay.cli", "serve", *self.args]
        return cmd + ["--host", self.host, "--port", str(self.port)]

    def ready(self) -> bool:
        return _get_ok(self.url + "/health")


@dataclass
class RouterProcess(_ChildProcess):
    """sglang-router (``python -m sglang_router.launch_router``) in front of ``workers``;
    ``args`` are its flags (``--policy manual``, ``--dp-aware``...). Ready when every worker
    (each DP rank with ``--dp-aware``) is registered and healthy."""

    workers: list[str] = field(default_factory=list)
    expected_workers: int = 0  # 0: one per worker URL
    name = "router"

    def command(self) -> list[str]:
        # its Prometheus exporter binds a fixed port unless told otherwise
        metrics_port = (
            []
            if has_flag(self.args, "--prometheus-port")
            else ["--prometheus-port", str(free_port(self.host))]
        )
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *self.args, *metrics_port]
        return cmd + ["--host", self.host, "--port", str(self.port), "--worker-urls", *self.workers]

    def ready(self) -> bool:
        import requests

        if not _get_ok(self.url + "/health"):
            return False
        try:
            workers = requests.get(self.url + "/workers", timeout=2).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return False
        healthy = sum(1 for w in workers if w.get("is_healthy"))
        return healthy >= (self.expected_workers or len(self.workers))


@contextlib.contextmanager
def server_at(url: str | None, args: list[str]):
    """The URL of a server for a bench: ``url`` if given, else a :class:`ServerProcess`
    started with ``args`` and stopped on exit."""
    if url is not None:
        yield url
        return
    with ServerProcess(args) as server:
        yield server.url
