"""SGLang's frontend language against a relay server, with the relay method chosen per program.

Programs written with ``@sgl.function`` / ``fork`` / ``gen`` need no change: every ``gen``
whose prompt contains text an earlier request on the same server decoded is relayed by the
server's default method. To pick the method (or a config) from the client side, use
:class:`RelayEndpoint` as the backend::

    import sglang as sgl
    from sglang_relay.frontend import RelayEndpoint

    sgl.set_default_backend(RelayEndpoint("http://127.0.0.1:30000", relay="relay"))
    state = my_program.run(task="...")
    state.get_meta_info("answer")["relay"]   # reuse, spans, fallback of that gen

``relay`` is what ``sampling_params.custom_params.relay`` takes on the HTTP API: a method
name (``standard``, ``naive``, ``cacheblend``, ``epic``, ``relay``) or
``{"method": ..., "config": {...}}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.ir import SglSamplingParams


@dataclasses.dataclass
class _RelaySamplingParams(SglSamplingParams):
    relay: Any = None

    def to_srt_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_srt_kwargs()
        if self.relay is not None:
            kwargs["custom_params"] = {"relay": self.relay}
        return kwargs


class RelayEndpoint(RuntimeEndpoint):
    """A :class:`RuntimeEndpoint` that sends ``custom_params.relay`` with every ``gen``.

    ``chat_template_name`` defaults to ``chatml`` (SmolLM2, Qwen2) when SGLang cannot
    tell the template from the model path.
    """

    def __init__(self, base_url: str, *, relay: Any = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.relay = relay
        if kwargs.get("chat_template_name") is None and self.chat_template.name == "default":
            from sglang.lang.chat_template import get_chat_template

            self.chat_template = get_chat_template("chatml")

    def _with_relay(self, params: SglSamplingParams) -> SglSamplingParams:
        if self.relay is None:
            return params
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        return _RelaySamplingParams(**values, relay=self.relay)

    def generate(self, s: Any, sampling_params: SglSamplingParams):
        return super().generate(s, self._with_relay(sampling_params))

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams):
        return super().generate_stream(s, self._with_relay(sampling_params))
