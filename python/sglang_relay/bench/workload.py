"""Agent-relay workloads for the offline (reference) fidelity bench and the profiler.

A workload is a JSONL file; each line is one relay case::

    {"id": "code-01", "kind": "code", "task": "...",
     "upstream": [{"name": "Architect", "system": "...", "template": "...{task}..."}, ...],
     "downstream": {"name": "Developer", "system": "...", "template": "...{Architect}..."}}

Upstream agents run in order (a later one may embed an earlier one's output); the
downstream prompt embeds one or more upstream outputs. Templates are ``str.format``
strings over ``task`` and the agent names; prompts go through the model's chat template.

:func:`prepare_relays` runs everything the methods share, once per case, and caches it on
disk per (case, model, generation settings): the upstream generations with their
decode-phase KV, residual streams and influence scores
(:func:`~sglang_relay.core.reference.generate`), the
downstream prompt, the span occurrences found in it with :class:`SpanIndex` (as the
runtime finds them), and the exact greedy continuation of the downstream request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from sglang_relay.core.reference import RefModel, SpanOccurrence, UpstreamRecord, generate
from sglang_relay.core.relatedness import related_spans
from sglang_relay.core.span_index import SpanIndex
from sglang_relay.runtime.config.settings import DEFAULT_MIN_SHARE

CACHE_FORMAT = 2


@dataclass(frozen=True)
class Agent:
    """One agent: its system prompt and a user-message template."""

    name: str
    system: str
    template: str


@dataclass(frozen=True)
class Case:
    """One relay: upstream agents, then a downstream agent that embeds their outputs."""

    id: str
    kind: str
    task: str
    upstream: tuple[Agent, ...]
    downstream: Agent

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class GenSettings:
    """Generation settings shared by every case (part of the cache key).

    ``min_new_tokens`` masks the stop tokens of upstream agents until that many tokens
    exist, so that spans reach ``min_span`` (cases whose relayed span is still shorter
    are skipped).
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 160
    continuation: int = 64
    min_span: int = 128
    match_min: int = 32
    batch: int = 16


@dataclass
class RelayCase:
    """A prepared relay, loaded from the cache (see :func:`prepare_relays`).

    ``records[i]`` is upstream agent ``i``; ``spans`` index into them; ``prompt`` is the
    downstream prompt; ``continuation`` its exact greedy continuation (stops at EOS).
    """

    case: Case
    records: list[UpstreamRecord]
    prompt: list[int]
    continuation: list[int]
    spans: list[SpanOccurrence] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def span_tokens(self) -> int:
        return sum(s.length for s in self.spans)


def load_workload(
    path: str | Path | None = None, name: str = "fidelity_workload.jsonl"
) -> list[Case]:
    """Cases of a JSONL workload (default: the packaged file ``name``)."""
    if path is None:
        text = resources.files("sglang_relay.data").joinpath(name).read_text()
    else:
        text = Path(path).read_text()
    cases = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            cases.append(
                Case(
                    id=str(raw["id"]),
                    kind=str(raw.get("kind", "")),
                    task=str(raw["task"]),
                    upstream=tuple(Agent(**a) for a in raw["upstream"]),
                    downstream=Agent(**raw["downstream"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path or name}:{lineno}: bad relay case: {exc}") from exc
    return cases


def model_fingerprint(model_dir: str | Path, num_layers: int) -> str:
    """Identifies the weights (converter marker or file sizes and times) and layer count."""
    model_dir = Path(model_dir)
    parts = [str(num_layers)]
    for name in ("config.json", "sglang_relay_model.json"):
        p = model_dir / name
        if p.is_file():
            parts.append(p.read_text())
    for p in sorted(model_dir.glob("*.safetensors")):
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{int(st.st_mtime)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def chat_ids(tok: Any, system: str, user: str) -> list[int]:
    """Token ids of a system + user chat prompt, ready for the assistant's answer."""
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tok(text, add_special_tokens=False).input_ids)


def output_text(tok: Any, rec: UpstreamRecord, stop_ids: Sequence[int]) -> str:
    """What a client would paste: the decoded output without the stop token."""
    out = rec.output[:-1] if rec.output and rec.output[-1] in stop_ids else rec.output
    return tok.decode(out, skip_special_tokens=True)


def find_spans(
    prompt: Sequence[int],
    records: Sequence[UpstreamRecord],
    match_min: int,
    min_share: float = DEFAULT_MIN_SHARE,
) -> list[SpanOccurrence]:
    """Span occurrences in ``prompt`` (never its last token), found as the runtime does:
    the same index settings and the same relatedness rule."""
    index = SpanIndex(min_match=match_min, anchor=max(1, match_min // 2), max_bucket=64)
    for i, rec in enumerate(records):
        index.add(i, rec.span_tokens)
    matches = index.find(list(prompt), end=len(prompt) - 1)
    if min_share > 0:
        keep = related_spans(matches, lambda i: len(records[i].span_tokens), min_share)
        matches = [m for m in matches if m.span_id in keep]
    return [
        SpanOccurrence(m.prompt_start, records[m.span_id], m.span_start, m.length) for m in matches
    ]


def _cache_path(cache_dir: Path, case: Case, fingerprint: str, gen: GenSettings) -> Path:
    key = json.dumps([CACHE_FORMAT, case.digest(), fingerprint, asdict(gen)], sort_keys=True)
    return cache_dir / f"{case.id}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


def _record_dict(rec: UpstreamRecord) -> dict[str, Any]:
    return {
        "prompt": rec.prompt,
        "output": rec.output,
        "k": rec.k,
        "v": rec.v,
        "hidden": rec.hidden,
        "influence": rec.influence,
    }


def load_relay(path: Path, case: Case) -> RelayCase:
    """Load a cached relay (records with KV and streams, prompt, spans, continuation)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    records = [UpstreamRecord(**r) for r in data["records"]]
    spans = [SpanOccurrence(p, records[i], s, n) for p, i, s, n in data["spans"]]
    return RelayCase(case, records, data["prompt"], data["continuation"], spans, data["texts"])


def prepare_relays(
    ref: RefModel,
    tok: Any,
    cases: Iterable[Case],
    cache_dir: str | Path,
    fingerprint: str,
    gen: GenSettings | None = None,
    progress: Callable[[str, int], Any] | None = None,
) -> tuple[list[tuple[Case, Path]], list[tuple[Case, str]]]:
    """Generate what is not cached yet; return ``(usable, skipped)``.

    ``usable`` lists ``(case, cache file)`` (load with :func:`load_relay`); ``skipped``
    lists ``(case, reason)`` for cases whose relayed span per upstream agent stays below
    ``gen.min_span`` tokens. ``progress(stage, n)`` is called after each generated batch.
    """
    gen = gen or GenSettings()
    cache_dir = Path(cache_dir)
    stop_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")} - {None})
    cases = list(cases)
    todo = [c for c in cases if not _cache_path(cache_dir, c, fingerprint, gen).is_file()]
    records: dict[str, list[UpstreamRecord]] = {c.id: [] for c in todo}
    texts: dict[str, dict[str, str]] = {c.id: {"task": c.task} for c in todo}
    stages = max((len(c.upstream) for c in todo), default=0)
    for stage in range(stages):
        batch_cases = [c for c in todo if len(c.upstream) > stage]
        for lo in range(0, len(batch_cases), gen.batch):
            chunk = batch_cases[lo : lo + gen.batch]
            prompts = []
            for c in chunk:
                agent = c.upstream[stage]
                prompts.append(chat_ids(tok, agent.system, agent.template.format(**texts[c.id])))
            outs = generate(
                ref,
                prompts,
                gen.max_new_tokens,
                stop_ids=stop_ids,
                min_new_tokens=gen.min_new_tokens,
            )
            for c, rec in zip(chunk, outs, strict=True):
                records[c.id].append(rec)
                texts[c.id][c.upstream[stage].name] = output_text(tok, rec, stop_ids)
            if progress:
                progress(f"upstream agent {stage + 1}", len(chunk))
    prompts = {
        c.id: chat_ids(tok, c.downstream.system, c.downstream.template.format(**texts[c.id]))
        for c in todo
    }
    for lo in range(0, len(todo), gen.batch):
        chunk = todo[lo : lo + gen.batch]
        outs = generate(
            ref,
            [prompts[c.id] for c in chunk],
            gen.continuation,
            stop_ids=[tok.eos_token_id],
            capture=False,
        )
        for c, out in zip(chunk, outs, strict=True):
            recs = records[c.id]
            spans = find_spans(prompts[c.id], recs, gen.match_min)
            _save(
                _cache_path(cache_dir, c, fingerprint, gen),
                {
                    "records": [_record_dict(r) for r in recs],
                    "prompt": prompts[c.id],
                    "continuation": out.output,
                    "spans": [
                        (s.prompt_start, _index_of(recs, s.record), s.span_start, s.length)
                        for s in spans
                    ],
                    "texts": [texts[c.id][a.name] for a in c.upstream],
                },
            )
        if progress:
            progress("downstream continuation", len(chunk))
    usable, skipped = [], []
    for c in cases:
        path = _cache_path(cache_dir, c, fingerprint, gen)
        meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        per_agent = [0] * len(c.upstream)
        for _, i, _, n in meta["spans"]:
            per_agent[i] += n
        if min(per_agent) < gen.min_span:
            skipped.append((c, f"relayed span tokens per agent {per_agent} < {gen.min_span}"))
        else:
            usable.append((c, path))
    return usable, skipped


def _index_of(records: Sequence[UpstreamRecord], rec: UpstreamRecord) -> int:
    return next(i for i, r in enumerate(records) if r is rec)
