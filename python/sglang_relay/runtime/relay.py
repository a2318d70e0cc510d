"""The per-process relay runtime: span store, stored hidden states, per-request planning
and the batch plan the relay forward executes.

Data path of one relayed request (see docs/architecture.md):
1. upstream request A decodes; :func:`capture_decode` stores the residual stream entering
   ``l_start`` of each decoded token at its KV slot (``RelayRuntime.hidden``);
2. A finishes; the relay radix cache records its output tokens as a span (slots,
   positions) in the :class:`SpanStore`;
3. downstream request B is scheduled; ``prepare_for_extend`` calls :meth:`plan_request`,
   which finds stored spans in B's extend tokens (same namespace only);
4. B's extend runs; the model hook calls :meth:`batch_plan`, which re-validates every
   span's slots and builds a :class:`BatchPlan`; :func:`relay_extend` splices, re-rotates
   and rectifies. Any error falls back to SGLang's own forward for the whole batch.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from sglang_relay.core.config import METHODS, RelayConfig
from sglang_relay.kernels import kernel_family, pick_extend_attention
from sglang_relay.runtime import compat
from sglang_relay.runtime.metrics import RelayCounters
from sglang_relay.runtime.model_loop import BatchPlan, SpanGroup
from sglang_relay.runtime.settings import RelaySettings
from sglang_relay.runtime.span_store import SpanSource, SpanStore

logger = logging.getLogger(__name__)

_CURRENT: RelayRuntime | None = None

SUPPORTED_ROPE = frozenset(
    {
        "RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
    }
)


def current() -> RelayRuntime | None:
    """The runtime of this process, if the relay backend was built here."""
    return _CURRENT


def _set_current(rt: RelayRuntime | None) -> None:
    global _CURRENT
    _CURRENT = rt


@dataclass
class RequestPlan:
    cfg: RelayConfig
    prefix_len: int
    sources: list[SpanSource]
    stats: dict[str, Any]


def new_stats(method: str) -> dict[str, Any]:
    return {
        "method": method,
        "spans_matched": 0,
        "reused_tokens": 0,
        "selected_tokens": 0,
        "recomputed_token_layers": 0,
        "reuse_rate": 0.0,
        "fallback": None,
    }


class RelayRuntime:
    """Owns the relay state of one scheduler process (tensor parallel size 1)."""

    def __init__(
        self,
        settings: RelaySettings,
        model_runner: Any,
        *,
        span_budget: int,
        prometheus: bool = False,
    ) -> None:
        self.settings = settings
        self.cfg = settings.config
        outer = model_runner.model
        self.model = getattr(outer, "model", outer)
        layers = self.model.layers
        self.num_layers = len(layers)
        rope = layers[0].self_attn.rotary_emb
        if type(rope).__name__ not in SUPPORTED_ROPE:
            raise ValueError(
                f"sglang-relay cannot re-rotate keys of {type(rope).__name__} "
                f"(supported: {', '.join(sorted(SUPPORTED_ROPE))})"
            )
        pool = model_runner.token_to_kv_pool
        self.kv_pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        kbuf = pool.get_key_buffer(layers[0].self_attn.attn.layer_id)
        self.pool_slots = kbuf.shape[0]
        self.device = kbuf.device
        model_dtype = self.model.embed_tokens.weight.dtype
        if kbuf.dtype != model_dtype:
            raise ValueError(
                f"sglang-relay does not support a {kbuf.dtype} KV cache with a {model_dtype} "
                "model yet (re-rotation and the relay attention ignore KV scales); drop "
                "--kv-cache-dtype"
            )
        relay_sched = RelayConfig.from_dict({**self.cfg.to_dict(), "method": "relay"}).schedule(
            self.num_layers
        )
        if self.cfg.method != "standard":
            self.cfg.schedule(self.num_layers)  # validates the layer range for this model
        start = relay_sched.l_start
        self.capture_layer = start if 0 < start < self.num_layers else None
        hidden_size = self.model.embed_tokens.weight.shape[-1]
        dtype = self.model.embed_tokens.weight.dtype
        # [pool_slots, hidden] residual stream entering capture_layer, by KV slot
        self.hidden = (
            torch.zeros(self.pool_slots, hidden_size, dtype=dtype, device=self.device)
            if self.capture_layer is not None
            else None
        )
        # [pool_slots] float32 attention mass received, by KV slot (only when tau_inf is set)
        self.influence_layer = relay_sched.l_det if self.cfg.tau_inf is not None else None
        self.influence = (
            torch.zeros(self.pool_slots, dtype=torch.float32, device=self.device)
            if self.influence_layer is not None and self.influence_layer < self.num_layers
            else None
        )
        if self.influence is None:
            self.influence_layer = None
        self.cuda_graphs = {
            phase: compat.cuda_graphs_enabled(model_runner, phase)
            for phase in ("decode", "prefill")
        }
        if self.device.type == "cuda":
            self._check_cuda_graphs()
        self.extend_attention = pick_extend_attention(
            compat.attention_backend_name(model_runner), self.device
        )
        self.flashinfer = None
        if self.extend_attention == "flashinfer":  # pragma: no cover - CUDA only
            from sglang_relay.kernels.flashinfer_extend import FlashInferExtend

            self.flashinfer = FlashInferExtend(self.device)
        from sglang_relay.runtime.model_loop import bind_pool

        bind_pool(self.model, pool)
        self.store = SpanStore(
            self.pool_slots, self.device, min_match=self.cfg.min_span, max_tokens=span_budget
        )
        self.pending: dict[str, RequestPlan] = {}
        self.relayed_from: dict[str, int] = {}
        self.counters: Counter[str] = RelayCounters(prometheus=prometheus)

    def _check_cuda_graphs(self) -> None:
        """Refuse CUDA graph settings under which relay would serve wrong KV silently.
        SGLang captures its graphs before the tree cache (and this runtime) exists, so a
        captured decode replays the stock forward and never stores the hidden states at
        ``l_start`` (nor influence): relayed spans would be rebuilt from stale side data.
        A captured prefill would replay the stock forward instead of the relay extend."""
        if self.captures and self.cuda_graphs["decode"]:
            stored = [f"hidden states at layer {self.capture_layer}"] if self.capture_layer else []
            stored += ["influence scores"] if self.influence is not None else []
            what = " and ".join(stored)
            raise ValueError(
                f"sglang-relay stores {what} in its own eager decode loop, which decode CUDA "
                "graphs would skip; add --cuda-graph-backend-decode disabled (sglang-relay "
                "serve does on a GPU) or use a relay profile with l_start 0 and no tau_inf"
            )
        if self.cuda_graphs["prefill"]:
            raise ValueError(
                "sglang-relay runs relay extends in its own eager layer loop, which prefill "
                "CUDA graphs would skip; add --disable-prefill-cuda-graph"
            )

    # ---- memory --------------------------------------------------------------------
    def side_bytes(self) -> int:
        total = self.store.owner.numel() * self.store.owner.element_size()
        for t in (self.hidden, self.influence):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    @property
    def captures(self) -> bool:
        """Whether decode must run the relay loop (to store hidden states or influence)."""
        return self.capture_layer is not None or self.influence is not None

    # ---- scheduler side --------------------------------------------------------------
    def request_config(self, req: Any) -> RelayConfig | None:
        """The config for ``req`` (None: standard prefill). Raises ValueError on bad options.

        Per-request option ``sampling_params.custom_params["relay"]``: a method name
        (``"off"`` = standard) or ``{"method": name, "config": {RelayConfig fields}}``.
        """
        params = getattr(req.sampling_params, "custom_params", None)
        option = params.get("relay") if isinstance(params, dict) else None
        overrides: dict[str, Any] = {}
        if option is None:
            method = self.cfg.method
        elif isinstance(option, str):
            method = option
        elif isinstance(option, dict) and set(option) <= {"method", "config"}:
            method = option.get("method", self.cfg.method)
            overrides = option.get("config") or {}
            if not isinstance(method, str) or not isinstance(overrides, dict):
                raise ValueError("relay option: method must be a string, config an object")
        else:
            raise ValueError("custom_params.relay must be a method name or {method, config}")
        if method == "off":
            method = "standard"
        if method not in METHODS:
            raise ValueError(f"unknown relay method {method!r}")
        if method == "standard":
            return None
        base = self.cfg.for_method(method) if method in ("cacheblend", "epic") else self.cfg
        cfg = RelayConfig.from_dict({**base.to_dict(), **overrides, "method": method})
        sched = cfg.schedule(self.num_layers)
        if sched.needs_hidden() and 0 < sched.l_start < self.num_layers:
            if sched.l_start != self.capture_layer:
                raise ValueError(
                    f"l_start must be 0 or {self.capture_layer} (the layer whose hidden "
                    "states this server stores)"
                )
        return cfg

    def plan_request(self, req: Any) -> None:
        """Called after ``prepare_for_extend``: find spans in this extend chunk."""
        info = req.customized_info
        if info is None:
            info = req.customized_info = {}
        if "relay" not in info:
            info["relay"] = [new_stats(self.cfg.method)]
        stats = info["relay"][0]
        try:
            cfg = self.request_config(req)
        except ValueError as exc:
            self._fallback(stats, f"bad_options: {exc}")
            return
        stats["method"] = cfg.method if cfg is not None else "standard"
        if cfg is None:
            return
        if req.return_logprob and req.logprob_start_len < len(req.origin_input_ids) - 1:
            self._fallback(stats, "input_logprobs")
            return
        if getattr(req, "input_embeds", None) is not None or req.multimodal_inputs is not None:
            self._fallback(stats, "unsupported_input")
            return
        fill = req.get_fill_ids()
        start = req.prefix_len
        end = start + req.extend_len
        tokens = list(fill[start:end])
        if end >= len(fill):
            tokens = tokens[:-1]  # the last prompt token is always computed normally
        namespace = (req.extra_key, req.cache_salt)
        sources = self.store.find(tokens, namespace)
        if sources:
            self.pending[req.rid] = RequestPlan(cfg, start, sources, stats)

    def planning_failed(self, req: Any) -> None:
        """Planning raised: the request runs standard prefill and says so."""
        info = req.customized_info if isinstance(req.customized_info, dict) else {}
        stats = (info.get("relay") or [new_stats(self.cfg.method)])[0]
        self._fallback(stats, "error")

    def _fallback(self, stats: dict[str, Any], reason: str) -> None:
        stats["fallback"] = reason
        self.counters["fallbacks"] += 1
        self.counters[f"fallback_{reason.split(':')[0]}"] += 1

    # ---- model side ----------------------------------------------------------------
    def batch_plan(self, fb: Any) -> BatchPlan | None:
        """The plan for this extend batch, or None when no request relays anything."""
        pending, self.pending = self.pending, {}
        rids = fb.rids or []
        plans = [pending.get(rid) for rid in rids]
        if not any(plans):
            return None
        ext_lens = list(fb.extend_seq_lens_cpu)
        prefix_lens = list(fb.extend_prefix_lens_cpu)
        row_starts, acc = [], 0
        for n in ext_lens:
            row_starts.append(acc)
            acc += n
        groups: dict[RelayConfig, dict[str, list]] = {}
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            if prefix_lens[i] != plan.prefix_len:
                self._fallback(plan.stats, "stale_plan")
                continue
            g = groups.setdefault(plan.cfg, {"rows": [], "src": [], "delta": [], "seg": []})
            first = None
            for s in plan.sources:
                if not self.store.slots_valid(s.span_id, s.slots):
                    self._fallback(plan.stats, "span_evicted")
                    continue
                n = s.length
                offs = torch.arange(n, device=self.device)
                dest_pos = plan.prefix_len + s.prompt_start + offs
                lo = sum(len(r) for r in g["rows"])
                g["rows"].append(row_starts[i] + s.prompt_start + offs)
                g["src"].append(s.slots)
                g["delta"].append(dest_pos - s.positions)
                g["seg"].append((lo, lo + n, plan.stats))
                plan.stats["spans_matched"] += 1
                plan.stats["reused_tokens"] += n
                self.counters["spans_matched"] += 1
                pos0 = plan.prefix_len + s.prompt_start
                first = pos0 if first is None else min(first, pos0)
            if first is not None:
                rid = rids[i]
                self.relayed_from[rid] = min(self.relayed_from.get(rid, first), first)
        built = []
        for cfg, g in groups.items():
            if not g["rows"]:
                continue
            built.append(
                SpanGroup(
                    cfg=cfg,
                    sched=cfg.schedule(self.num_layers),
                    rows=torch.cat(g["rows"]),
                    src=torch.cat(g["src"]),
                    delta=torch.cat(g["delta"]),
                    segments=g["seg"],
                )
            )
        if not built:
            return None
        span_rows = torch.cat([g.rows for g in built])
        order = span_rows.argsort()
        span_rows = span_rows[order]
        mask = torch.ones(acc, dtype=torch.bool, device=self.device)
        mask[span_rows] = False
        return BatchPlan(
            groups=built,
            span_rows=span_rows,
            span_src=torch.cat([g.src for g in built])[order],
            span_delta=torch.cat([g.delta for g in built])[order],
            normal_rows=mask.nonzero().flatten(),
            row_starts=row_starts,
            seq_lens=[p + n for p, n in zip(prefix_lens, ext_lens, strict=False)],
            num_rows=acc,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token,
            attention=self.extend_attention,
            flashinfer=self.flashinfer,
        )

    def finish_plan(self, plan: BatchPlan) -> None:
        """Fill per-request reuse figures after a successful relay forward."""
        touched = {}
        for g in plan.groups:
            counts = g.seg_selected or [0] * len(g.segments)
            for (lo, hi, stats), chosen in zip(g.segments, counts, strict=False):
                stats["selected_tokens"] += chosen
                stats["recomputed_token_layers"] += (
                    hi - lo
                ) * g.sched.dense_layers + chosen * g.sched.sparse_layers
                touched[id(stats)] = stats
        for stats in touched.values():
            total = stats["reused_tokens"] * self.num_layers
            stats["reuse_rate"] = (
                round(1.0 - stats["recomputed_token_layers"] / total, 4) if total else 0.0
            )
        self.counters["relay_extends"] += 1
        self.counters["relayed_tokens"] += int(plan.span_rows.numel())

    def fail_plan(self, plan: BatchPlan, exc: BaseException) -> None:
        for g in plan.groups:
            for _, _, stats in g.segments:
                stats.update(new_stats(stats["method"]))
                stats["fallback"] = f"error: {type(exc).__name__}"
        self.counters["fallbacks"] += 1
        self.counters["fallback_error"] += 1
        logger.exception("relay extend failed; fell back to standard prefill")

    def stats(self) -> dict[str, Any]:
        return {
            "method": self.cfg.method,
            "config": self.cfg.to_dict(),
            "capture_layer": self.capture_layer,
            "extend_attention": self.extend_attention,
            "cuda_graphs": self.cuda_graphs,
            "kernels": kernel_family(self.device),
            "side_bytes": self.side_bytes(),
            **self.store.stats(),
            **dict(self.counters),
        }
