"""The share of prompt tokens a relay server relayed, from its own counters.

Relayed tokens: ``GET /get_server_info`` -> ``internal_states[i]["relay"]["relayed_tokens"]``
(summed over data-parallel ranks). Prompt tokens: SGLang's ``sglang:prompt_tokens_total``
on ``GET /metrics`` (the server must run with ``--enable-metrics``). Both are cumulative,
so a run's share is the ratio of their deltas across it. Through sglang-router, read them
on every worker (the router does not sum them).
"""

from __future__ import annotations

from dataclasses import dataclass

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
