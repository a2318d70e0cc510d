"""Reference executor of the relay semantics on a Hugging Face Llama-family causal LM
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
the MoE families) or an MLA one (``DeepseekV3ForCausalLM``: one latent row a token, as
SGLang's MLA pool holds it, up-projected where the loop attends; :mod:`.model`).

This is the plain, per-request twin of :mod:`sglang_relay.runtime.forward.extend`: the same
layer loop with explicit per-layer active rows, written on the HF modules of the model
(``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, the model's rotary embedding,
``post_attention_layernorm``, ``mlp``) and :func:`positional_causal_attention`. It owns its
KV tensors (one dense ``[L, T, H_kv, D]`` pair per request, row = absolute position) and
never uses HF's cache classes, so both paths can be compared and the relay's fidelity
measured without a server. It imports no sglang.

Its four jobs, one module each (every name is re-exported here, so callers import from
``sglang_relay.core.reference``):

* :mod:`.model`: the model under the loop. :class:`RefModel` (handles on the HF modules:
  RoPE, q/k/v, MLP, K/V rounded as the engine's pool stores them, logits),
  :func:`load_model`, the dense per-request :class:`KVCache`, and ``_run_layer``, one
  layer on a set of active rows with causal attention by position.
* :mod:`.generate`: upstream generation. :func:`generate` runs requests greedily (batched
  decode) and returns, per request, an :class:`UpstreamRecord`: the output tokens, and for
  the span tokens (the outputs that were fed back, i.e. all but the last sampled token)
  the decode-phase KV of every layer (post-RoPE keys), the residual stream entering every
  layer and the influence score (attention mass received from decode queries) at every
  layer.
* :mod:`.relay`: the relay prefill. :func:`relay_prefill` computes a downstream prompt
  whose span occurrences (:class:`SpanOccurrence`) reuse upstream KV under a
  :class:`RelayConfig` (any of the five methods; ``standard`` is the exact full prefill,
  also :func:`exact_prefill`), with its splice, detection, selection signals (influence,
  context masses, the last-row probe) and oracles (:func:`exact_kv_prefill`,
  :func:`true_value_deviation`). Optional teacher-forced tokens after the prompt run as
  normal rows in the same pass, which equals prefilling and then extending with them. Its
  module docstring states the semantics.
* :mod:`.measures`: continuation and fidelity. :func:`extend`, :func:`greedy_continue`,
  :func:`teacher_forced`, :func:`greedy_after_forced` continue from a prefill;
  :func:`fidelity` compares a method's logits with the exact ones (first-token KL and
  top-1, teacher-forced top-1, free-running greedy prefix and first divergence).

Layering (no import cycle): ``model`` <- ``relay`` <- ``generate``, and ``model``,
``relay`` <- ``measures``.
"""

from sglang_relay.core.reference.generate import generate
from sglang_relay.core.reference.measures import (
    extend,
    fidelity,
    first_token_kl,
    greedy_after_forced,
    greedy_continue,
    teacher_forced,
)
from sglang_relay.core.reference.model import KVCache, RefModel, load_model
from sglang_relay.core.reference.model import _run_layer as _run_layer
from sglang_relay.core.reference.oracles import (
    exact_kv_prefill,
    exact_prefill,
    true_value_deviation,
)
from sglang_relay.core.reference.record import UpstreamRecord
from sglang_relay.core.reference.relay import _detect as _detect
from sglang_relay.core.reference.relay import (
    last_row_probe,
    record_context_mass,
    record_decode_queries,
    relay_prefill,
    span_context_mass,
)
from sglang_relay.core.reference.spans import RelayResult, SpanOccurrence
from sglang_relay.core.reference.spans import _check_selection as _check_selection
from sglang_relay.core.reference.spans import _check_spans as _check_spans
from sglang_relay.core.reference.spans import _influence as _influence
from sglang_relay.core.reference.spans import _span_rows as _span_rows
from sglang_relay.core.reference.spans import _splice as _splice
from sglang_relay.core.reference.spans import _upstream_kv as _upstream_kv

__all__ = [
    "KVCache",
    "RefModel",
    "RelayResult",
    "SpanOccurrence",
    "UpstreamRecord",
    "exact_kv_prefill",
    "exact_prefill",
    "extend",
    "fidelity",
    "first_token_kl",
    "generate",
    "greedy_after_forced",
    "greedy_continue",
    "last_row_probe",
    "load_model",
    "record_context_mass",
    "record_decode_queries",
    "relay_prefill",
    "span_context_mass",
    "teacher_forced",
    "true_value_deviation",
]
