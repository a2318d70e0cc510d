"""What an upstream request of the reference executor leaves behind for relays
(:class:`UpstreamRecord`): made by :func:`.generate.generate`, read by :mod:`.relay`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class UpstreamRecord:
    """What an upstream request leaves behind for relays.

    Attributes:
        prompt: the prompt token ids ``P_A``.
        output: every sampled token (the last one never got KV).
        k, v: ``[L, n, H_kv, D]`` decode-phase KV of the span tokens ``output[:n]``
            (keys post-RoPE at their upstream positions), ``n = len(output) - 1``.
        hidden: ``[n, L, hidden]`` residual stream entering each layer during decode
            (layer 0: the embedding), or ``None`` when not captured.
        influence: ``[n, L]`` float32 attention mass each span token received at each
            layer from the decode queries (its own and every later fed token), summed over
            query heads: METHOD.md's ``s_inf``, as the runtime accumulates it at ``l_det``.
        context: context masses by layer, filled by :func:`record_context_mass`.
        prompt_k: ``[L, P, H_kv, D]`` the prompt keys the decode attended to when the prompt
            was itself relayed (a chain's later agent, :func:`generate`'s ``relayed``);
            ``None``: the exact prefill's.
    """

    prompt: list[int]
    output: list[int]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    influence: torch.Tensor | None = None
    context: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    prompt_k: torch.Tensor | None = field(default=None, repr=False)

    @property
    def span_tokens(self) -> list[int]:
        """The tokens that have KV: all outputs but the last sampled one."""
        return self.output[:-1]

    @property
    def span_start_pos(self) -> int:
        """Absolute position of the first span token in the upstream request."""
        return len(self.prompt)
