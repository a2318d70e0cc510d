"""A small HTTP client for SGLang's native ``/generate`` with TTFT measurement."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import requests


@dataclass
class Generation:
    text: str
    ttft_s: float
    latency_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return int(self.meta.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        return int(self.meta.get("cached_tokens", 0))

    @property
    def relay(self) -> dict[str, Any] | None:
        info = self.meta.get("relay")
        # streamed responses may carry the request-level value as a one-element list
        if isinstance(info, list):
            info = info[-1] if info else None
        return info


def generate(
    url: str,
    text: str,
    sampling_params: dict[str, Any],
    *,
    timeout: float = 600.0,
    stream: bool = True,
    **extra: Any,
) -> Generation:
    """POST ``/generate``. Streamed (default): TTFT is the arrival of the first chunk with
    text. Not streamed (as agent frameworks call): TTFT is the one a relay server measures
    from the request's arrival to its first output token (``meta_info["relay"]["ttft_s"]``,
    including a redo by the early-stop guard), else the whole latency."""
    payload = {"text": text, "sampling_params": sampling_params, "stream": stream, **extra}
    start = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with requests.post(url + "/generate", json=payload, stream=stream, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate returned {resp.status_code}: {resp.text[:500]}")
        if not stream:
            last = resp.json()
            if isinstance(last, dict) and "error" in last:
                raise RuntimeError(f"/generate failed: {last['error']}")
        for line in resp.iter_lines() if stream else ():
            if not line or not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            chunk = json.loads(body)
            if "error" in chunk:
                raise RuntimeError(f"/generate failed: {chunk['error']}")
            if ttft is None:
                ttft = time.perf_counter() - start
            last = chunk
    latency = time.perf_counter() - start
    gen = Generation(text=last.get("text", ""), ttft_s=latency, latency_s=latency,
                     meta=last.get("meta_info", {}))  # fmt: skip
    server_ttft = (gen.relay or {}).get("ttft_s")
    gen.ttft_s = ttft if ttft is not None else float(server_ttft or latency)
    return gen


FLUSH_WAIT_S = 120.0
HEALTH_WAIT_S = 120.0


def flush_cache(url: str, wait_s: float = FLUSH_WAIT_S) -> None:
    """Empty the server's radix cache (and relay's spans), waiting up to ``wait_s`` for it
    to go idle. SGLang refuses a flush while its last batch or the overlap queue still holds
    a request that has already returned to the client (``Scheduler.is_fully_idle``); without
    ``?timeout=`` it answers 400 at once, a race a busy machine loses. With it, the scheduler
    flushes as soon as it is idle, or answers 400 when ``wait_s`` has passed."""
    resp = requests.post(url + "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 60)
    if resp.status_code != 200:
        raise RuntimeError(
            f"/flush_cache returned {resp.status_code} after waiting up to {wait_s:.0f} s for "
            f"the server to go idle: {resp.text.strip()[:300]}"
        )


def healthy(url: str, wait_s: float = HEALTH_WAIT_S) -> bool:
    """Whether the server answers ``/health`` with 200 within ``wait_s``. SGLang's health
    check runs a one-token generation and gives up after its own 20 s; a server busy with
    other work (or a machine busy with other processes) may need several tries."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            resp = requests.get(url + "/health", timeout=max(1.0, min(left, 30.0)))
            if resp.status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
