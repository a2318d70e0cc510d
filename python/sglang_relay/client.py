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
    **extra: Any,
) -> Generation:
    """POST ``/generate`` with streaming; TTFT is the arrival of the first chunk with text."""
    payload = {"text": text, "sampling_params": sampling_params, "stream": True, **extra}
    start = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with requests.post(url + "/generate", json=payload, stream=True, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate returned {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
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
    return Generation(
        text=last.get("text", ""),
        ttft_s=ttft if ttft is not None else latency,
        latency_s=latency,
        meta=last.get("meta_info", {}),
    )


def flush_cache(url: str) -> None:
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()
