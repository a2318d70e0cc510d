"""``sglang-relay profile``: the offline layer-range profiler (see docs/profiling.md).

On calibration relays (a workload disjoint from the fidelity bench's), with the HF
reference executor:

1. curves per layer, comparing the reused KV (decode-phase, keys re-rotated) with the
   downstream exact prefill over the span tokens: mean key and value cosine, relative
   deviation of the residual stream, the adjacent-layer Spearman rank correlation of the
   per-token value deviation, and how concentrated that deviation is (share carried by the
   top 15 % of tokens, ratio first 16 tokens / rest);
2. a search over relay configs (layer range, then the selection rule by coordinate
   descent), each candidate measured on every calibration relay: first-token KL vs exact,
   teacher-forced top-1 over the exact 64-token continuation, token-layer reuse. Every
   candidate carries the ``max_ratio`` cap that makes its reuse >= ``--min-reuse`` on
   every span by construction;
3. the rule: among candidates whose reuse is >= ``--min-reuse`` on every calibration
   relay and whose first-token top-1 and greedy prefix are no worse than the best such
   candidate's beyond the paired 95 % interval over the relays, the lowest mean
   first-token KL; candidates within 2 % of it are ranked by teacher-forced top-1, then
   by reuse.

Writes ``profile.json`` (``{"model", "config", "curves", "search", "chosen", ...}``, the
``config`` loadable by :func:`~sglang_relay.core.config.load_profile`) and
``profile.png`` into ``--out``.

Modules: :mod:`.curves`, :mod:`.search`, :mod:`.rules` (the operating points), :mod:`.cli`.
"""
