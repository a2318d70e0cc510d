"""The transfer engine span shipping moves KV pages with: Mooncake's ``TransferEngine``
(the engine SGLang's own PD disaggregation uses; TCP here, RDMA on clusters), one per
server, handshaking peer to peer (``P2PHANDSHAKE``). A receiver *pulls*: it reads a
publisher's registered host pool into its own (``batch_transfer_sync_read``); the
publisher's engine serves only addresses inside what it registered.

Mooncake's Python wheel loads ``libibverbs`` and ``libnl`` even for TCP. Where the system
has none (this CPU machine), ``make setup`` unpacks Debian's packages under
``.venv/opt/ibverbs``; :func:`engine_class` loads them from there (or from
``SGLANG_RELAY_IBVERBS_DIR``) before importing the engine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_LIBS = "SGLANG_RELAY_IBVERBS_DIR"
LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
PROTOCOLS = ("tcp", "rdma")


def ibverbs_dir() -> Path:
    return Path(os.environ.get(ENV_LIBS) or Path(sys.prefix) / "opt" / "ibverbs")


def library_path() -> str:
    """``LD_LIBRARY_PATH`` entries of the unpacked libraries (for child processes)."""
    root = ibverbs_dir()
    return f"{root}/usr/lib/x86_64-linux-gnu:{root}/lib/x86_64-linux-gnu"


def add_library_path() -> None:
    """Put the unpacked libraries on ``LD_LIBRARY_PATH`` (read by the loader of every
    process SGLang spawns from here: its PD transfer code imports Mooncake itself)."""
    if not (ibverbs_dir() / "usr").is_dir():
        return
    current = os.environ.get("LD_LIBRARY_PATH", "")
    os.environ["LD_LIBRARY_PATH"] = library_path() + (f":{current}" if current else "")


def engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class (RuntimeError naming the way out if missing)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as first:
        for name in LIBS:
            found = [p for p in ibverbs_dir().rglob(name)]
            if found:
                ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "sglang-relay: span shipping needs Mooncake's transfer engine: pip install "
                "mooncake-transfer-engine (a CPU host: mooncake-transfer-engine-non-cuda and "
                f"libibverbs1 + libnl-3-200 + libnl-route-3-200, `make setup`) ({first})"
            ) from exc
    return TransferEngine


class MooncakeTransport:
    """One transfer engine: registers this server's host pool, reads a peer's."""

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"ship protocol must be one of {PROTOCOLS}; got {protocol!r}")
        # the protocol is this engine's alone: no process-wide MC_FORCE_TCP, which SGLang's
        # own PD engine in the same process would read too
        self.engine = engine_class()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"sglang-relay: Mooncake's transfer engine did not start (rc {rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.registered: list[tuple[int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"sglang-relay: registering {nbytes} bytes failed (rc {rc})")
        self.registered.append((ptr, nbytes))

    def read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> bool:
        """Copy the peer's ``remote`` ranges into ``local`` (blocking). False: it failed."""
        if not lengths:
            return True
        for ptr, n in zip(local, lengths, strict=True):  # only into what was registered
            if not any(base <= ptr and ptr + n <= base + size for base, size in self.registered):
                raise ValueError("a local range outside the registered host pool")
        return self.engine.batch_transfer_sync_read(session, local, remote, lengths) == 0

    def close(self) -> None:
        for ptr, _ in self.registered:
            try:
                self.engine.unregister_memory(ptr)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.registered.clear()
