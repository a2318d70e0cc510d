"""Trace-driven simulation of relay behind N workers: which routing policy lets a downstream
agent land where its upstream spans are, at what cost in load balance and time to first token.

Only the worker (server or data-parallel rank) that decoded an agent's output holds it as a
span, so a downstream agent relays only if it is routed there. This discrete-event simulation
runs many concurrent agent chains (pipelines, fan-out, fan-in, group chats) over N = 1..64
workers and compares routing policies on relay hit rate, load imbalance and expected TTFT.

Model (docs/scale-out.md states every assumption):

* chains arrive as a Poisson process; the arrival rate scales with N so that the offered
  prefill work, every prompt token at the standard per-token cost, is the same share of
  each worker's time at every N (``Point.offered``, 0.9: round robin, which reuses little
  at large N, then keeps its prefill engines ~70 % busy);
* a worker prefills one request at a time, FIFO (TTFT = wait + prefill), then decodes it
  at a fixed per-token time that no other request slows down;
* prefill cost = standard cost per token computed from scratch + relay cost per relayed
  token + prefix-hit cost per token of an exact radix prefix hit, fitted to the measured
  CPU numbers in ``docs/ttft_quick.json``; decode time from ``docs/decode.json``;
* per worker: a span store (token budget, LRU, spans of < 32 tokens not stored, the runtime's
  ``SpanStore`` rules) and SGLang's radix prefix cache (an LRU over prompt prefixes);
* a prompt is a list of segments (role system prompt, chain task, pasted upstream outputs,
  instruction); caches and routers match whole segments.

Policies: ``round_robin``, ``least_load`` (fewest requests in flight), ``prefix`` (sglang-router's
``cache_aware``), ``chain_key`` (sglang-router's ``manual`` policy on a per-chain key),
``fingerprints`` (the rule of ``sglang_relay.runtime.scale.dp_routing``) and ``fingerprints_key``
(the same with a per-chain routing key).

Usage::

    python research/studies/scale_sim.py [--quick] [--seed S] [--json OUT] [--plot PNG]
    python research/studies/scale_sim.py --disagg [--json OUT]   # moving a span vs prefilling it
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import random
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

try:
    import sglang_relay  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang_relay.runtime.scale.dp_fingerprints import WINDOW, fingerprint_choice, key_worker
from sglang_relay.runtime.scale.dp_routing import DEFAULT_MAX_IMBALANCE

REPO = Path(__file__).resolve().parents[2]
MIN_SPAN = WINDOW  # the span store's min_match: shorter outputs are not recorded
POLICIES = ("round_robin", "least_load", "prefix", "chain_key", "fingerprints", "fingerprints_key")
CPU_POOL_TOKENS = 65_536  # `serve` on a CPU: --max-total-tokens 65536 (docs/configuration.md)


# ---- costs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Seconds per token of each way a prompt token can be served, and per output token."""

    standard: float  # prefilled from scratch
    relay: float  # relayed from a stored span (at the server's default reuse 0.80)
    prefix_hit: float  # an exact radix prefix hit (SGLang's own cache)
    decode: float  # one output token of one request


def _through_origin(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``y = slope * x``."""
    return float(x @ y / (x @ x))


def fit_costs(ttft_rows: list[dict], decode_rows: list[dict]) -> Costs:
    """Per-token costs from ``sglang-relay bench ttft`` rows (medians) and ``bench decode``.

    ``standard``: TTFT / prompt tokens of the ``standard`` rows, one slope through the
    origin; ``relay``: the slope of (relay TTFT - standard slope x non-relayed tokens) over
    relayed tokens; ``prefix_hit``: TTFT / prompt tokens of the ``stock_prefix_hit`` rows
    (the prompt up to the span's end is an exact radix hit, a few new tokens follow);
    ``decode``: 1 / plain SGLang's output tokens per second at batch 1."""

    def rows(method: str) -> list[dict]:
        return [r for r in ttft_rows if r["method"] == method]

    std = rows("standard")
    standard = _through_origin(
        np.array([r["prompt_tokens"] for r in std], float),
        np.array([r["ttft_median_s"] for r in std], float),
    )
    rel = rows("relay")
    relayed = np.array([r["reused_tokens"] for r in rel], float)
    rest = np.array([r["prompt_tokens"] for r in rel], float) - relayed
    relay = _through_origin(
        relayed, np.array([r["ttft_median_s"] for r in rel], float) - standard * rest
    )
    hit = rows("stock_prefix_hit")
    prefix_hit = _through_origin(
        np.array([r["prompt_tokens"] for r in hit], float),
        np.array([r["ttft_median_s"] for r in hit], float),
    )
    batch1 = next(r for r in decode_rows if r["batch"] == 1)
    return Costs(standard, relay, prefix_hit, 1.0 / batch1["plain_tokens_per_s"])


def measured_costs() -> Costs:
    """:func:`fit_costs` on the measurements shipped in ``docs/``."""
    ttft = json.loads((REPO / "docs" / "ttft_quick.json").read_text())
    decode = json.loads((REPO / "docs" / "decode.json").read_text())
    return fit_costs(ttft, decode)


# ---- workload and trace ------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The chain mix and token-length ranges (uniform integers; outputs log-uniform)."""

    mix: tuple[tuple[str, float], ...] = (
        ("pipeline", 0.35),
        ("fanout", 0.20),
        ("fanin", 0.20),
        ("groupchat", 0.25),
    )
    apps_per_shape: int = 4  # chains of one app share its role system prompts
    pipeline_agents: tuple[int, int] = (3, 4)  # agent i pastes the outputs of i-2 and i-1
    fanout_k: tuple[int, int] = (2, 6)  # planner -> k parallel reviewers
    fanin_k: tuple[int, int] = (2, 5)  # k researchers -> aggregator
    chat_members: tuple[int, int] = (3, 4)
    chat_turns: tuple[int, int] = (6, 10)  # every turn pastes all earlier turns
    hot_share: float = 0.0  # share of chains that are hot: one document -> k reviewers
    hot_k: tuple[int, int] = (64, 128)
    role_tokens: tuple[int, int] = (200, 1000)
    task_tokens: tuple[int, int] = (50, 300)
    instr_tokens: tuple[int, int] = (20, 120)
    out_tokens: tuple[int, int] = (100, 1500)
    chat_out_tokens: tuple[int, int] = (100, 400)
    hot_out_tokens: tuple[int, int] = (100, 300)


@dataclass(frozen=True)
class Agent:
    """One request of a chain: its prompt (segment ids, in order), the agents whose outputs
    it pastes (and waits for), and its output segment."""

    prompt: tuple[int, ...]
    pasted: tuple[int, ...]
    out_seg: int


@dataclass
class Chain:
    cid: int
    arrival: float
    shape: str
    agents: list[Agent]

    @property
    def key(self) -> str:
        """The client's routing key for this chain (``X-SMG-Routing-Key``)."""
        return f"chain-{self.cid}"


@dataclass
class Trace:
    chains: list[Chain]
    seg_len: list[int]  # tokens per segment id


class TraceBuilder:
    """Draws chains of a :class:`Workload`. Role system prompts (the first segments) are
    drawn once per app and shared by every chain of that app; every other segment (task,
    instruction, output) belongs to one chain."""

    SHAPE_ROLES = {"pipeline": 4, "fanout": 7, "fanin": 6, "groupchat": 4, "hot": 2}

    def __init__(self, workload: Workload, rng: random.Random) -> None:
        self.w = workload
        self.rng = rng
        self.seg_len: list[int] = []
        self.roles: dict[tuple[str, int], list[int]] = {}
        for shape, n in self.SHAPE_ROLES.items():
            for app in range(workload.apps_per_shape):
                self.roles[shape, app] = [
                    self._seg(self._int(workload.role_tokens)) for _ in range(n)
                ]
        self._shapes = [s for s, _ in workload.mix]
        self._weights = [p for _, p in workload.mix]

    def _int(self, lo_hi: tuple[int, int]) -> int:
        return self.rng.randint(*lo_hi)

    def _out(self, lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        return int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))

    def _seg(self, tokens: int) -> int:
        self.seg_len.append(tokens)
        return len(self.seg_len) - 1

    def _agent(self, prefix: list[int], pasted: list[int], agents: list[Agent], out: int) -> None:
        """Append an agent: ``prefix`` segments, then the outputs of ``pasted``, then a fresh
        instruction."""
        segs = prefix + [agents[i].out_seg for i in pasted]
        segs.append(self._seg(self._int(self.w.instr_tokens)))
        agents.append(Agent(tuple(segs), tuple(pasted), self._seg(out)))

    def chain(self, cid: int, arrival: float) -> Chain:
        w = self.w
        hot = w.hot_share > 0 and self.rng.random() < w.hot_share
        shape = "hot" if hot else self.rng.choices(self._shapes, self._weights)[0]
        roles = self.roles[shape, self.rng.randrange(w.apps_per_shape)]
        task = self._seg(self._int(w.task_tokens))
        agents: list[Agent] = []
        out = w.out_tokens
        if shape == "pipeline":
            for i in range(self._int(w.pipeline_agents)):
                prefix = [roles[i], task] if i == 0 else [roles[i]]
                self._agent(prefix, list(range(max(0, i - 2), i)), agents, self._out(out))
        elif shape in ("fanout", "hot"):
            k = self._int(w.hot_k if hot else w.fanout_k)
            self._agent([roles[0], task], [], agents, self._out(out))
            for _ in range(k):
                reviewer = roles[1] if hot else self.rng.choice(roles[1:])
                self._agent([reviewer], [0], agents, self._out(w.hot_out_tokens if hot else out))
        elif shape == "fanin":
            k = self._int(w.fanin_k)
            for i in range(k):
                self._agent([roles[1 + i], task], [], agents, self._out(out))
            self._agent([roles[0], task], list(range(k)), agents, self._out(out))
        elif shape == "groupchat":
            members = roles[: self._int(w.chat_members)]
            for t in range(self._int(w.chat_turns)):
                speaker = members[t % len(members)]
                self._agent([speaker, task], list(range(t)), agents, self._out(w.chat_out_tokens))
        else:
            raise ValueError(f"unknown chain shape {shape!r}")
        return Chain(cid, arrival, shape, agents)


def make_trace(workload: Workload, n_chains: int, rate: float, seed: int) -> Trace:
    """``n_chains`` chains arriving as a Poisson process of ``rate`` chains per second."""
    rng = random.Random(seed)
    builder = TraceBuilder(workload, rng)
    t, chains = 0.0, []
    for cid in range(n_chains):
        t += rng.expovariate(rate)
        chains.append(builder.chain(cid, t))
    return Trace(chains, builder.seg_len)


@functools.cache
def chain_work(workload: Workload, costs: Costs, seed: int, n: int = 4000) -> float:
    """Mean standard-prefill seconds per chain (every prompt token from scratch), from ``n``
    chains drawn with their own seed: the unit of ``Point.offered``."""
    trace = make_trace(workload, n, 1.0, seed)
    tokens = sum(trace.seg_len[s] for c in trace.chains for a in c.agents for s in a.prompt)
    return tokens * costs.standard / n


# ---- worker state ------------------------------------------------------------------------
class SpanLRU:
    """A worker's span store: the rules of ``runtime.span_store.SpanStore`` (an output of
    fewer than ``min_span`` tokens is not recorded; after an add, the least recently used
    spans are dropped while the total exceeds the budget and more than one span is left;
    a relay touches the spans it uses)."""

    def __init__(self, budget: int, min_span: int = MIN_SPAN) -> None:
        self.budget = budget
        self.min_span = min_span
        self.spans: OrderedDict[int, int] = OrderedDict()  # span -> tokens, oldest first
        self.tokens = 0

    def __contains__(self, span: int) -> bool:
        return span in self.spans

    def add(self, span: int, tokens: int) -> tuple[bool, list[int]]:
        """Record a span; returns (recorded, spans dropped to make room)."""
        if tokens < self.min_span:
            return False, []
        self.spans[span] = tokens
        self.tokens += tokens
        dropped = []
        while self.tokens > self.budget and len(self.spans) > 1:
            old, n = self.spans.popitem(last=False)
            self.tokens -= n
            dropped.append(old)
        return True, dropped

    def touch(self, span: int) -> None:
        self.spans.move_to_end(span)


class SegmentTrie:
    """Ids for prompt prefixes: node (parent, segment) -> id, so that equal prefixes of
    different prompts are the same nodes."""

    def __init__(self, seg_len: list[int]) -> None:
        self.seg_len = seg_len
        self.ids: dict[tuple[int, int], int] = {}
        self.tokens: list[int] = []  # tokens of each node's segment

    def path(self, segs: tuple[int, ...], parent: int = -1) -> list[int]:
        """Node ids of ``segs`` (one per segment), continuing from node ``parent``."""
        out = []
        for seg in segs:
            node = self.ids.get((parent, seg))
            if node is None:
                node = self.ids[parent, seg] = len(self.tokens)
                self.tokens.append(self.seg_len[seg])
            out.append(node)
            parent = node
        return out


class RadixLRU:
    """A worker's radix prefix cache over :class:`SegmentTrie` nodes with a token budget.

    ``insert`` touches a path leaf first, so every node stays more recently used than all
    its descendants and evicting the least recently used node only ever removes a leaf, as
    SGLang's radix cache does."""

    def __init__(self, budget: int, trie: SegmentTrie) -> None:
        self.budget = budget
        self.trie = trie
        self.nodes: OrderedDict[int, None] = OrderedDict()
        self.tokens = 0

    def match(self, path: list[int]) -> int:
        """How many leading nodes of ``path`` are cached."""
        k = 0
        while k < len(path) and path[k] in self.nodes:
            k += 1
        return k

    def insert(self, path: list[int]) -> None:
        for node in reversed(path):
            if node in self.nodes:
                self.nodes.move_to_end(node)
            else:
                self.nodes[node] = None
                self.tokens += self.trie.tokens[node]
        while self.tokens > self.budget and self.nodes:
            node, _ = self.nodes.popitem(last=False)
            self.tokens -= self.trie.tokens[node]


# ---- routing policies --------------------------------------------------------------------
@dataclass
class Request:
    """One agent's request in flight, and what happened to it."""

    cid: int
    agent: int
    path: list[int]  # prompt trie nodes
    spans: tuple[int, ...]  # pasted upstream outputs (segment ids = span ids)
    key: str
    issued: float
    worker: int = -1
    start: float = 0.0
    ttft: float = 0.0
    prompt_tokens: int = 0
    relayable: int = 0  # pasted upstream tokens (outputs of >= MIN_SPAN tokens)
    relayed: int = 0  # ... served from the span store
    span_prefix_hit: int = 0  # ... inside the prompt's exact radix prefix hit
    prefix_hit: int = 0  # prompt tokens of the exact radix prefix hit
    queue_ahead: int = 0  # requests waiting or in prefill on its worker when it arrived


def fingerprint_tokens(span_tokens: int) -> int:
    """Relayable tokens a router credits a worker with for holding a span pasted whole: the
    tokens its published windows cover (``runtime.dp_fingerprints.span_fingerprints``: every
    ``STRIDE``-th window and the last), i.e. all of a span of at least ``WINDOW`` tokens."""
    return span_tokens if span_tokens >= WINDOW else 0


class Policy:
    """Chooses a worker per request; ``decisions`` counts why."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.decisions: Counter[str] = Counter()

    def choose(self, req: Request, sim: Simulation) -> int:
        raise NotImplementedError

    def _decided(self, why: str, worker: int) -> int:
        self.decisions[why] += 1
        return worker


class RoundRobin(Policy):
    """SGLang's default DP load balancing and sglang-router's ``round_robin``."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.next = 0

    def choose(self, req: Request, sim: Simulation) -> int:
        worker, self.next = self.next, (self.next + 1) % self.n
        return self._decided("round_robin", worker)


class LeastLoad(Policy):
    """SGLang's ``--load-balance-method total_requests``: the fewest requests in flight
    (waiting, in prefill or decoding); ties to the lowest index."""

    def choose(self, req: Request, sim: Simulation) -> int:
        loads = sim.loads
        return self._decided("least_load", min(range(self.n), key=loads.__getitem__))


class ChainKey(Policy):
    """sglang-router's ``manual`` policy: a stable hash of the chain's routing key (the
    runtime's :func:`~sglang_relay.runtime.scale.dp_fingerprints.key_worker`, every worker
    active)."""

    def choose(self, req: Request, sim: Simulation) -> int:
        return self._decided("key", key_worker(req.key, range(self.n)))


class ApproxTree:
    """sglang-router's approximate prefix tree over whole segments: the nodes of every routed
    prompt, each answering prefix matches with one tenant. The router caches one tenant per
    node (the first it resolves, kept while that tenant holds the node); we take the worker
    whose prompt created the node. Not evicted: nodes are only forgotten by LRU once a
    tenant exceeds ``max_tree_size``, which these runs do not reach."""

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}  # node -> the tenant a match ending there returns

    def match(self, path: list[int]) -> tuple[int, int | None]:
        """(nodes of ``path`` matched, the tenant of the deepest matched node)."""
        k = 0
        while k < len(path) and path[k] in self.owner:
            k += 1
        return k, self.owner[path[k - 1]] if k else None

    def insert(self, path: list[int], worker: int) -> None:
        for node in path:
            self.owner.setdefault(node, worker)


class Prefix(Policy):
    """sglang-router's ``cache_aware`` (sgl-model-gateway): if loads are imbalanced (max - min
    > ``abs_threshold`` and max > ``rel_threshold`` x min) the least loaded worker; else the
    tenant of the longest prefix match if it covers more than ``threshold`` of the prompt,
    else the least loaded worker (ties: the lowest index). The prompt joins the tree under
    the chosen worker."""

    def __init__(
        self,
        n: int,
        threshold: float = 0.5,
        abs_threshold: int = 64,
        rel_threshold: float = 1.5,
    ) -> None:
        super().__init__(n)
        self.tree = ApproxTree()
        self.threshold = threshold
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def choose(self, req: Request, sim: Simulation) -> int:
        loads = sim.loads
        hi, lo = max(loads), min(loads)
        least = min(range(self.n), key=loads.__getitem__)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            worker = self._decided("imbalanced", least)
        else:
            k, tenant = self.tree.match(req.path)
            matched = sum(sim.trie.tokens[node] for node in req.path[:k])
            if tenant is not None and matched / req.prompt_tokens > self.threshold:
                worker = self._decided("prefix_match", tenant)
            else:
                worker = self._decided("least_load", least)
        self.tree.insert(req.path, worker)
        return worker


class Fingerprints(Policy):
    """The rule of ``runtime/scale/dp_routing.py`` (``DPRouter.route``, calling its
    ``fingerprint_choice`` and ``key_worker`` with every worker active; ties go to the
    lowest worker), with span ownership at token level: a worker holding a pasted span is
    credited :func:`fingerprint_tokens` of it (the prompt tokens its published 32-token
    windows cover; hash collisions and windows across segment boundaries are ignored), and
    ranks publish instantly. No match: the routing key's hash
    (``use_key``), else ``fallback``."""

    def __init__(self, n: int, fallback: Policy, use_key: bool, max_imbalance: int) -> None:
        super().__init__(n)
        self.fallback = fallback
        self.use_key = use_key
        self.max_imbalance = max_imbalance

    def choose(self, req: Request, sim: Simulation) -> int:
        held: dict[int, int] = {}
        for span in req.spans:
            credit = fingerprint_tokens(sim.trace.seg_len[span])
            for worker in sim.holders.get(span, ()):
                held[worker] = held.get(worker, 0) + credit
        if held:
            held = dict(sorted(held.items()))  # exact ties: the lowest worker
            rank = fingerprint_choice(held, sim.loads, range(self.n), self.max_imbalance)
            if rank is not None:
                return self._decided("matched", rank)
            return self._decided("fallback_overloaded", self.fallback.choose(req, sim))
        if self.use_key and req.key:
            return self._decided("key", key_worker(req.key, range(self.n)))
        return self._decided("fallback", self.fallback.choose(req, sim))


def make_policy(
    name: str,
    n: int,
    *,
    threshold: float = 0.5,
    fallback: str = "round_robin",
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
) -> Policy:
    """A policy by name (``POLICIES``); ``threshold``: prefix's ``cache_threshold``;
    ``fallback``: the fingerprint rule's load-balance method (SGLang's default: round robin);
    ``max_imbalance``: its load bound (``SGLANG_RELAY_DP_MAX_IMBALANCE``)."""
    if name == "round_robin":
        return RoundRobin(n)
    if name == "least_load":
        return LeastLoad(n)
    if name == "chain_key":
        return ChainKey(n)
    if name == "prefix":
        return Prefix(n, threshold)
    if name in ("fingerprints", "fingerprints_key"):
        base = make_policy(fallback, n)
        return Fingerprints(n, base, name == "fingerprints_key", max_imbalance)
    raise ValueError(f"unknown policy {name!r}")


# ---- simulation --------------------------------------------------------------------------
_CHAIN, _PREFILLED, _FINISHED = 0, 1, 2


class Simulation:
    """One trace over ``n`` workers under one policy. After :meth:`run`, ``requests`` holds
    every request with what happened to it and ``intervals`` each worker's prefills."""

    def __init__(
        self,
        trace: Trace,
        n: int,
        policy: Policy,
        costs: Costs,
        span_budget: int,
        pool_tokens: int,
    ) -> None:
        self.trace = trace
        self.n = n
        self.policy = policy
        self.costs = costs
        self.trie = SegmentTrie(trace.seg_len)
        self.stores = [SpanLRU(span_budget) for _ in range(n)]
        self.radix = [RadixLRU(pool_tokens, self.trie) for _ in range(n)]
        self.holders: dict[int, set[int]] = {}  # span -> workers that store it
        self.loads = [0] * n  # requests in flight per worker (the routers' load signal)
        self.queues: list[deque[Request]] = [deque() for _ in range(n)]  # FIFO
        self.prefilling: list[Request | None] = [None] * n
        self.intervals: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.requests: list[Request] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._waiting: dict[tuple[int, int], int] = {}  # (chain, agent) -> outputs awaited
        self._children: dict[tuple[int, int], list[int]] = {}

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        self._seq += 1

    def run(self) -> Simulation:
        for chain in self.trace.chains:
            self._push(chain.arrival, _CHAIN, chain.cid)
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if kind == _CHAIN:
                chain = self.trace.chains[payload]
                for i, agent in enumerate(chain.agents):
                    self._waiting[chain.cid, i] = len(agent.pasted)
                    for j in agent.pasted:
                        self._children.setdefault((chain.cid, j), []).append(i)
                for i, agent in enumerate(chain.agents):
                    if not agent.pasted:
                        self._issue(t, chain, i)
            elif kind == _PREFILLED:
                self._prefilled(t, payload)
            else:
                self._finished(t, payload)
        return self

    def _issue(self, t: float, chain: Chain, i: int) -> None:
        agent = chain.agents[i]
        seg_len = self.trace.seg_len
        path = self.trie.path(agent.prompt)
        spans = tuple(chain.agents[j].out_seg for j in agent.pasted)
        req = Request(chain.cid, i, path, spans, chain.key, t)
        req.prompt_tokens = sum(seg_len[s] for s in agent.prompt)
        req.relayable = sum(seg_len[s] for s in spans if seg_len[s] >= MIN_SPAN)
        w = req.worker = self.policy.choose(req, self)
        self.loads[w] += 1
        req.queue_ahead = len(self.queues[w]) + (self.prefilling[w] is not None)
        self.queues[w].append(req)
        self.requests.append(req)
        if self.prefilling[w] is None:
            self._start(t, w)

    def _start(self, t: float, w: int) -> None:
        """Prefill the next request of worker ``w``: exact prefix hit first, then relay of
        the pasted spans outside it that the worker still stores."""
        req = self.queues[w].popleft()
        seg_len, radix, store = self.trace.seg_len, self.radix[w], self.stores[w]
        agent = self.trace.chains[req.cid].agents[req.agent]
        k = radix.match(req.path)
        radix.insert(req.path)
        cached = set(agent.prompt[:k])
        req.prefix_hit = sum(seg_len[s] for s in agent.prompt[:k])
        for span in req.spans:
            if seg_len[span] < MIN_SPAN:
                continue
            if span in cached:
                req.span_prefix_hit += seg_len[span]
            elif span in store:
                store.touch(span)
                req.relayed += seg_len[span]
        c = self.costs
        scratch = req.prompt_tokens - req.prefix_hit - req.relayed
        duration = c.standard * scratch + c.relay * req.relayed + c.prefix_hit * req.prefix_hit
        req.start = t
        req.ttft = t + duration - req.issued
        self.prefilling[w] = req
        self.intervals[w].append((t, t + duration))
        self._push(t + duration, _PREFILLED, w)

    def _prefilled(self, t: float, w: int) -> None:
        req = self.prefilling[w]
        self.prefilling[w] = None
        out = self.trace.chains[req.cid].agents[req.agent].out_seg
        self._push(t + self.costs.decode * self.trace.seg_len[out], _FINISHED, req)
        if self.queues[w]:
            self._start(t, w)

    def _finished(self, t: float, req: Request) -> None:
        """The output is decoded: it becomes a span of its worker (and a radix entry after
        the prompt), and the agents waiting for it may start."""
        w, chain = req.worker, self.trace.chains[req.cid]
        self.loads[w] -= 1
        out = chain.agents[req.agent].out_seg
        self.radix[w].insert(req.path + self.trie.path((out,), req.path[-1]))
        recorded, dropped = self.stores[w].add(out, self.trace.seg_len[out])
        if recorded:
            self.holders.setdefault(out, set()).add(w)
        for span in dropped:
            holders = self.holders[span]
            holders.discard(w)
            if not holders:
                del self.holders[span]
        for child in self._children.pop((req.cid, req.agent), ()):
            self._waiting[req.cid, child] -= 1
            if self._waiting[req.cid, child] == 0:
                self._issue(t, chain, child)


# ---- metrics -----------------------------------------------------------------------------
def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def summarize(sim: Simulation, window: tuple[float, float] = (0.2, 0.8)) -> dict:
    """Metrics over the chains that arrived in the middle ``window`` of the trace (shares of
    the last arrival time), prefill busy time clipped to that window."""
    last = sim.trace.chains[-1].arrival
    lo, hi = window[0] * last, window[1] * last
    measured = {c.cid for c in sim.trace.chains if lo <= c.arrival <= hi}
    reqs = [r for r in sim.requests if r.cid in measured]
    down = [r for r in reqs if r.relayable > 0]
    relayable = sum(r.relayable for r in down)
    reused = sum(r.relayed + r.span_prefix_hit for r in down)
    ttft = np.array([r.ttft for r in reqs])
    busy = np.array([_overlap(iv, lo, hi) for iv in sim.intervals])
    span = hi - lo
    prompt = sum(r.prompt_tokens for r in reqs)
    shapes: dict[str, list[int]] = {}
    for r in down:
        acc = shapes.setdefault(sim.trace.chains[r.cid].shape, [0, 0])
        acc[0] += r.relayed + r.span_prefix_hit
        acc[1] += r.relayable
    return {
        "requests": len(reqs),
        "downstream": len(down),
        "hit_rate": reused / relayable if relayable else 0.0,
        "relayed_share": sum(r.relayed for r in down) / relayable if relayable else 0.0,
        "full_relay_share": (
            sum(r.relayed + r.span_prefix_hit == r.relayable for r in down) / len(down)
            if down
            else 0.0
        ),
        "prefix_hit_share": sum(r.prefix_hit for r in reqs) / prompt if prompt else 0.0,
        "busy_max_over_mean": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "utilization": float(busy.mean() / span),
        "queue_p99": float(np.percentile([r.queue_ahead for r in reqs], 99)),
        "ttft_mean": float(ttft.mean()),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "ttft_down_p50": float(np.percentile([r.ttft for r in down], 50)) if down else 0.0,
        "throughput_rps": len(reqs) / span,
        "capacity_rps_per_worker": (
            len(reqs) / (sim.n * float(busy.max())) if busy.max() > 0 else 0.0
        ),
        "hit_rate_by_shape": {k: v[0] / v[1] for k, v in sorted(shapes.items())},
        "decisions": dict(sorted(sim.policy.decisions.items())),
    }


# ---- experiments -------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One simulated configuration."""

    n: int
    policy: str
    scenario: str = "mix"
    offered: float = 0.9  # standard-prefill seconds offered per worker-second
    span_budget: int = CPU_POOL_TOKENS // 4
    pool_tokens: int = CPU_POOL_TOKENS
    threshold: float = 0.5
    fallback: str = "round_robin"
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    chains_per_worker: int = 100
    min_chains: int = 600


SCENARIOS = {"mix": Workload(), "hotspot": Workload(hot_share=0.01)}


def run_point(point: Point, costs: Costs, seed: int) -> dict:
    """Simulate one configuration. Every policy and every n see the same chains for one
    (scenario, seed); at n workers they arrive n times as often."""
    workload = SCENARIOS[point.scenario]
    rate = point.offered * point.n / chain_work(workload, costs, seed + 7919)
    n_chains = max(point.min_chains, point.chains_per_worker * point.n)
    trace = make_trace(workload, n_chains, rate, seed)  # the same chains at every n, denser
    policy = make_policy(
        point.policy,
        point.n,
        threshold=point.threshold,
        fallback=point.fallback,
        max_imbalance=point.max_imbalance,
    )
    sim = Simulation(trace, point.n, policy, costs, point.span_budget, point.pool_tokens).run()
    return {**asdict(point), "chains": n_chains, "chain_rate": rate, **summarize(sim)}


def experiments(quick: bool) -> dict[str, list[Point]]:
    """The grid: the N sweep, a hot-spot case, the fingerprint rule's imbalance bound, span
    budgets and cache_aware's threshold."""
    ns = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32, 64)
    base = (
        Point(1, "round_robin", chains_per_worker=15, min_chains=60)
        if quick
        else Point(1, "round_robin")
    )
    mid = 8 if quick else 16
    grid = {"sweep": [replace(base, n=n, policy=p) for n in ns for p in POLICIES]}
    hot = [replace(base, n=mid, policy=p, scenario="hotspot") for p in POLICIES]
    hot.append(
        replace(base, n=mid, policy="fingerprints", scenario="hotspot", fallback="least_load")
    )
    grid["hotspot"] = hot
    bounds = (8, 10**6) if quick else (2, 4, 8, 16, 32, 10**6)
    grid["imbalance"] = [
        replace(base, n=n, policy="fingerprints", scenario=scenario, max_imbalance=b)
        for scenario, n in (("mix", ns[-1]), ("hotspot", mid))
        for b in bounds
    ]
    budgets = (4096, 65_536) if quick else (4096, 16_384, 65_536, 10**9)
    grid["budget"] = [
        replace(base, n=mid, policy=p, span_budget=b)
        for b in budgets
        for p in ("round_robin", "prefix", "chain_key", "fingerprints", "fingerprints_key")
    ]
    grid["threshold"] = [replace(base, n=mid, policy="prefix", threshold=0.3)]
    return grid


# ---- output ------------------------------------------------------------------------------
def table(rows: list[dict], extra: tuple[str, ...] = ()) -> str:
    """A markdown table of the key metrics, one row per configuration, after the ``extra``
    fields that tell the rows apart."""
    head = ["N", "policy", *extra] + [
        "hit rate",
        "full relay",
        "busy max/mean",
        "queue p99",
        "TTFT mean s",
        "TTFT p50 s",
        "TTFT p99 s",
        "capacity req/s/worker",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["n"]), r["policy"], *(str(r[k]) for k in extra)]
        cells += [
            f"{r['hit_rate']:.2f}",
            f"{r['full_relay_share']:.2f}",
            f"{r['busy_max_over_mean']:.2f}",
            f"{r['queue_p99']:.0f}",
            f"{r['ttft_mean']:.2f}",
            f"{r['ttft_p50']:.2f}",
            f"{r['ttft_p99']:.2f}",
            f"{r['capacity_rps_per_worker']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Hit rate, TTFT p50, TTFT p99 and busy max/mean against N, one curve per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("hit_rate", "relay hit rate (pasted tokens reused)"),
        ("ttft_p50", "TTFT p50 (s, CPU costs)"),
        ("ttft_p99", "TTFT p99 (s, CPU costs, log scale)"),
        ("busy_max_over_mean", "prefill busy time, max / mean worker"),
    ]
    ns = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, title) in zip(axes.flat, panels, strict=True):
        for policy in POLICIES:
            pts = sorted((r["n"], r[metric]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("workers N")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes.flat[2].set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- prefill/decode disaggregation: moving a span vs prefilling it again ----------------
# docs/scale-out.md ("Prefill/decode disaggregation"). A span decoded on a decode server
# and needed on a prefill server can be moved (its KV in every layer plus relay's side
# data) or prefilled again there. Per relayed token and per GPU: the bytes moved, the time
# that takes on the link, and the prefill compute relay saves (reuse x the token's FLOPs).


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape (Hugging Face config names)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    def layer_params(self) -> int:
        """Weights a token's prefill multiplies by in one layer (q, k, v, o, gated MLP)."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.ffn


SHAPES = (
    Shape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336),
    Shape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672),
)
# (name, tensor-parallel GPUs per server) as each shape is commonly served
SERVING = (("Llama-3-8B", 1), ("Llama-3-70B", 8))
# per-GPU link bandwidth, Gbit/s: one 400G / 200G RDMA NIC per GPU (InfiniBand NDR / RoCE),
# 100G Ethernet per GPU, and a node's 100G Ethernet shared by 8 GPUs
LINKS_GBPS = (400.0, 200.0, 100.0, 12.5)
H100_BF16_TFLOPS = 989.0  # dense peak
PREFILL_MFU = 0.5  # prefill model-FLOP utilisation assumed
KV_BYTES = 2  # bf16 KV cache (FP8: 1)
SIDE_BYTES = 4 + 8  # per span token: its context mass (float32) and its slot stamp


def disagg_cost(
    shape: Shape,
    tp: int,
    link_gbps: float,
    *,
    reuse: float = 0.80,
    context: int = 4096,
    hidden_rows: bool = True,
    kv_bytes: int = KV_BYTES,
    tflops: float = H100_BF16_TFLOPS,
    mfu: float = PREFILL_MFU,
) -> dict:
    """Moving one relayed token's KV and side data to another server vs the prefill compute
    relay saves on it, per GPU of a ``tp``-GPU server. KV heads shard over TP (replicated
    when ``tp`` exceeds them); the stored hidden row (profiles with ``l_start`` > 0) is
    whole on every rank; attention FLOPs at the prompt's mean position ``context / 2``."""
    kv_per_gpu = max(1, shape.kv_heads // tp) * shape.head_dim
    kv = 2 * shape.layers * kv_per_gpu * kv_bytes
    side = SIDE_BYTES + (shape.hidden * 2 if hidden_rows else 0)
    nbytes = kv + side
    linear = 2 * shape.layers * shape.layer_params()
    attention = 4 * shape.layers * shape.q_heads * shape.head_dim * (context // 2)
    flops_per_gpu = (linear + attention) / tp
    saved_s = reuse * flops_per_gpu / (tflops * 1e12 * mfu)
    move_s = nbytes / (link_gbps * 1e9 / 8)
    return {
        "model": shape.name,
        "tp": tp,
        "link_gbps": link_gbps,
        "bytes_per_token_per_gpu": nbytes,
        "prefill_gflop_per_token": round((linear + attention) / 1e9, 2),
        "move_us": round(move_s * 1e6, 2),
        "saved_us": round(saved_s * 1e6, 2),
        "saved_over_move": round(saved_s / move_s, 2),
        "break_even_gbps": round(nbytes * 8 / saved_s / 1e9, 1),
    }


def disagg_rows() -> list[dict]:
    shapes = {s.name: s for s in SHAPES}
    return [disagg_cost(shapes[n], tp, g) for n, tp in SERVING for g in LINKS_GBPS]


def disagg_table(rows: list[dict]) -> str:
    head = "| model | TP | link Gb/s per GPU | bytes / token / GPU | prefill GFLOP / token |"
    head += " move us | saved us | saved / move | break-even Gb/s |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['link_gbps']:g} | {r['bytes_per_token_per_gpu']:,} "
            f"| {r['prefill_gflop_per_token']} | {r['move_us']} | {r['saved_us']} "
            f"| {r['saved_over_move']} | {r['break_even_gbps']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N in 1,4,16, fewer chains (< 60 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="out_json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument(
        "--disagg",
        action="store_true",
        help="only the disaggregation cost model: moving a span vs prefilling it (instant)",
    )
    args = p.parse_args(argv)
    if args.disagg:
        rows = disagg_rows()
        print(disagg_table(rows))
        meta = {"tflops": H100_BF16_TFLOPS, "mfu": PREFILL_MFU, "kv_bytes": KV_BYTES,
                "reuse": 0.80, "context": 4096, "shapes": [asdict(s) for s in SHAPES]}  # fmt: skip
        out = {"meta": meta, "rows": rows}
        if args.out_json:
            args.out_json.parent.mkdir(parents=True, exist_ok=True)
            args.out_json.write_text(json.dumps(out, indent=1) + "\n")
        return out
    t0 = time.perf_counter()
    costs = measured_costs()
    print(
        f"costs (s/token): standard {costs.standard:.5f}, relay {costs.relay:.5f}, "
        f"prefix hit {costs.prefix_hit:.5f}, decode {costs.decode:.4f}",
        flush=True,
    )
    results: dict[str, list[dict]] = {}
    for name, points in experiments(args.quick).items():
        results[name] = [run_point(pt, costs, args.seed) for pt in points]
        print(f"[{name}] {len(points)} runs, {time.perf_counter() - t0:.0f}s", flush=True)
    print("\n## N sweep\n" + table(results["sweep"]))
    print("\n## hot spot\n" + table(results["hotspot"], ("fallback",)))
    print(
        "\n## fingerprint imbalance bound\n"
        + table(results["imbalance"], ("scenario", "max_imbalance"))
    )
    print("\n## span budget\n" + table(results["budget"], ("span_budget",)))
    print("\n## cache_aware threshold\n" + table(results["threshold"], ("threshold",)))
    out = {
        "meta": {
            "seed": args.seed,
            "quick": args.quick,
            "costs_s_per_token": asdict(costs),
            "workloads": {k: asdict(v) for k, v in SCENARIOS.items()},
            "elapsed_s": round(time.perf_counter() - t0, 1),
        },
        **results,
    }
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(results["sweep"], args.plot)
    print(f"done in {out['meta']['elapsed_s']}s")
    return out


if __name__ == "__main__":
    main()
