"""The share of prompt tokens a relay server relayed, from its own counters.

Relayed tokens: ``GET /get_server_info`` -> ``internal_states[i]["relay"]["relayed_tokens"]``
(summed over data-parallel ranks). Prompt tokens: SGLang's ``sglang:prompt_tokens_total``
on ``GET /metrics`` (the server must run with ``--enable-metrics``). Both are cumulative,
so a run's share is the ratio of their deltas across it. Through sglang-router, read them
on every worker (the router does not sum them).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests


@dataclass(frozen=True)
class Counters:
    relayed_tokens: int
    prompt_tokens: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.relayed_tokens - other.relayed_tokens, self.prompt_tokens - other.prompt_tokens
        )

    @property
    def share(self) -> float:
        """Relayed / prompt tokens (of a delta: the share of a run's prompt tokens relayed)."""
        return self.relayed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def read_counters(*server_urls: str) -> Counters:
    """The cumulative counters of the servers (SGLang servers, not a router), summed."""
    relayed = prompt = 0
    for url in server_urls:
        url = url.rstrip("/")
        info = requests.get(f"{url}/get_server_info", timeout=30)
        info.raise_for_status()
        for state in info.json().get("internal_states", []):
            relayed += int(state.get("relay", {}).get("relayed_tokens", 0))
        metrics = requests.get(f"{url}/metrics", timeout=30)
        if metrics.status_code != 200:
            raise RuntimeError(
                f"{url}/metrics: {metrics.status_code}; start it with --enable-metrics"
            )
        prompt += round(
            sum(
                float(line.rsplit(None, 1)[1])
                for line in metrics.text.splitlines()
                if line.startswith("sglang:prompt_tokens_total")
            )
        )
    return Counters(relayed, prompt)


def server_root(base_url: str) -> str:
    """``http://host:port`` of an OpenAI ``base_url`` (``http://host:port/v1``)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


ROUTING_HEADER = "X-SMG-Routing-Key"  # sglang-router's manual policy: sticky per key


@dataclass
class Measured:
    """What one run returned, with the relay servers' counter delta and its wall time."""

    value: Any
    counters: Counters
    seconds: float

    @property
    def relay_share(self) -> float:
        return self.counters.share


def measure(base_url: str, counter_urls: list[str] | None, run: Callable[[], Any]) -> Measured:
    """``run()`` with the counters of ``counter_urls`` (the SGLang servers; default the one
    behind the OpenAI ``base_url``) read before and after it."""
    servers = counter_urls or [server_root(base_url)]
    before, t0 = read_counters(*servers), time.perf_counter()
    value = run()
    seconds = time.perf_counter() - t0
    return Measured(value, read_counters(*servers) - before, seconds)


def example_args(description: str, task: str) -> argparse.ArgumentParser:
    """The command line both examples share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    ap.add_argument("--chain-key", help=f"sent as {ROUTING_HEADER} (sglang-router)")
    ap.add_argument("--worker-url", action="append", help="relay server(s) to read counters")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--task", default=task)
    return ap


def print_report(messages: list[tuple[str, str]], res: Measured, extra: str = "") -> None:
    for source, content in messages:
        print(f"--- {source}\n{content}\n")
    c = res.counters
    print(f"{extra}({res.seconds:.1f} s)")
    print(f"relayed {c.relayed_tokens} of {c.prompt_tokens} prompt tokens: share {c.share:.2f}")
