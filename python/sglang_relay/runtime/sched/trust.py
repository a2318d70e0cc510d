"""The request trust boundary: what a client sends is checked in the tokenizer manager,
before anything reaches a scheduler.

SGLang passes ``sampling_params.custom_params`` to the scheduler unchecked, and any
exception raised in a scheduler process is fatal to the whole server. So on a relay server:

- every ``custom_params`` key that starts with :data:`PRIVATE_PREFIX` (relay's own
  transport between its processes: the early-stop guard's redo note, the DP controller's
  routing decision) is removed from a client's request; only requests the guard builds in
  this process (registered with :func:`trust`) keep theirs;
- the one relay field a client may set, ``custom_params["relay"]`` (method, reuse level,
  config, key, store), is resolved here exactly as the scheduler will resolve it; a bad value
  is a ``ValueError``, which SGLang's HTTP and OpenAI servers answer with 400 and the message
  (the field and what it accepts).

The schedulers still parse what they read defensively (:func:`.sglang.scheduling.guard_redo_of`,
:func:`.sglang.scheduling.dp_route`): a value that is not what relay itself writes is ignored, never
raised on.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import GenerateReqInput, TokenizerManager

logger = logging.getLogger(__name__)

PRIVATE_PREFIX = "__sglang_relay"
RELAY_FIELD = "relay"
MAX_TENANT = 256  # characters of a tenant header

# Requests this process built itself (the guard's redo) carry this process-private
# sentinel as an attribute no request body can set (SGLang builds request objects from the
# dataclass fields only): their private keys are relay's own.
_SENTINEL = object()
_MARK = "_sglang_relay_trusted"


def trust(obj: GenerateReqInput) -> Any:
    """Mark a request object built inside this process as carrying relay's own private
    keys (kept by :func:`admit`). Returns ``obj``."""
    setattr(obj, _MARK, _SENTINEL)
    return obj


def trusted(obj: GenerateReqInput) -> bool:
    return getattr(obj, _MARK, None) is _SENTINEL


def _param_dicts(obj: GenerateReqInput) -> list[dict]:
    """The sampling-parameter dicts of a (single or batch) generate request."""
    sp = getattr(obj, "sampling_params", None)
    if isinstance(sp, dict):
        return [sp]
    if isinstance(sp, list | tuple):
        return [p for p in sp if isinstance(p, dict)]
    return []


def strip_private(obj: GenerateReqInput) -> int:
    """Remove every private relay key from a client request's ``custom_params``; the
    number removed (0 for a request this process built, :func:`trust`)."""
    if trusted(obj):
        return 0
    removed = 0
    for sp in _param_dicts(obj):
        params = sp.get("custom_params")
        if not isinstance(params, dict):
            continue
        private = [k for k in params if isinstance(k, str) and k.startswith(PRIVATE_PREFIX)]
        if private:
            # a new dict: the caller's object may be shared (a batch's entries)
            sp["custom_params"] = {k: v for k, v in params.items() if k not in private}
            removed += len(private)
    return removed


class RequestValidator:
    """Resolves each request's relay option as the scheduler will (same settings, same
    layer count, same stored layers), so a bad one is refused with 400 at the door."""

    def __init__(self, settings: Any, num_layers: int, vocab_size: int) -> None:
        from sglang_relay.runtime.cache.budget import context_layer, side_layers

        self.settings = settings
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.capture_layer, _ = side_layers(settings, num_layers)
        self.context_layer = context_layer(settings, num_layers)

    def check_option(self, option: Any) -> None:
        """ValueError naming the field and what it accepts, for a relay option the
        scheduler would not run."""
        from sglang_relay.runtime.sched.options import (
            check_option_fields,
            relay_key,
            resolve_config,
        )

        if option is None:
            return
        try:
            check_option_fields(option)
            resolve_config(
                self.settings,
                option,
                num_layers=self.num_layers,
                capture_layer=self.capture_layer,
                context_layer=self.context_layer,
            )
            relay_key(option)
        except (TypeError, ValueError) as exc:
            message = str(exc)
            if len(message) > 400:
                message = message[:400] + "..."
            if not message.startswith("custom_params.relay"):
                message = f"custom_params.relay: {message}"
            raise ValueError(f"sampling_params.{message}") from None

    def check_input_ids(self, ids: Any) -> None:
        """ValueError for token ids outside the model's vocabulary: SGLang would index its
        embedding with them inside the scheduler, which ends the server."""
        rows = ids if ids and isinstance(ids[0], list | tuple) else [ids]
        for row in rows:
            for i in row:
                try:  # ints and integer scalars (numpy, from SGLang's Engine API)
                    ok = not isinstance(i, bool) and 0 <= operator.index(i) < self.vocab_size
                except TypeError:
                    ok = False
                if not ok:
                    raise ValueError(
                        f"input_ids: token id {i!r} is outside the vocabulary "
                        f"[0, {self.vocab_size})"
                    )

    def admit(self, obj: GenerateReqInput, request: Any = None) -> None:
        """Strip private keys and check every relay option of a generate request;
        ValueError (HTTP 400) on a bad one. Under a ``header:<Name>`` scope, file the
        request under the tenant of that header of the HTTP ``request`` (none: no tenant,
        so it neither stores nor reuses spans)."""
        if strip_private(obj):
            logger.debug("sglang-relay: removed private custom_params keys from a request")
        self.file_tenant(obj, request)
        ids = getattr(obj, "input_ids", None)
        if isinstance(ids, list | tuple):
            self.check_input_ids(ids)
        text = getattr(obj, "text", None)
        texts = text if isinstance(text, list) else [text]
        rows = ids if ids and isinstance(ids[0], list | tuple) else [ids]
        if "" in texts or any(isinstance(r, list | tuple) and not r for r in rows):
            # a forward of zero new tokens fails inside the scheduler, ending the server
            raise ValueError("text / input_ids: the prompt is empty (at least one token)")
        for sp in _param_dicts(obj):
            params = sp.get("custom_params")
            if params is None:
                continue
            if not isinstance(params, dict):
                raise ValueError(
                    "sampling_params.custom_params must be an object (a JSON dict); got "
                    f"{type(params).__name__}"
                )
            self.check_option(params.get(RELAY_FIELD))

    def file_tenant(self, obj: GenerateReqInput, request: Any) -> None:
        """Under a ``header:<Name>`` scope: every sampling-parameter dict of ``obj`` gets the
        tenant the operator's header names (:data:`TENANT_KEY`). The header is read from
        the HTTP request alone; a request without one (the Engine API, a gateway that did
        not set it) gets no tenant. ValueError for a header longer than
        :data:`MAX_TENANT`."""
        from sglang_relay.runtime.config.settings import scope_header
        from sglang_relay.runtime.sched.options import TENANT_KEY

        header = scope_header(self.settings.scope)
        if header is None or trusted(obj):  # relay's own requests carry their tenant
            return
        headers = getattr(request, "headers", None)
        tenant = headers.get(header) if headers is not None else None
        if tenant is not None and len(tenant) > MAX_TENANT:
            raise ValueError(f"header {header}: longer than {MAX_TENANT} characters")
        if getattr(obj, "sampling_params", None) is None:
            obj.sampling_params = {}
        for sp in _param_dicts(obj):
            params = sp.get("custom_params")
            params = dict(params) if isinstance(params, dict) else {}
            params.pop(TENANT_KEY, None)
            if tenant:
                params[TENANT_KEY] = tenant
            sp["custom_params"] = params


def validator_for(manager: TokenizerManager) -> RequestValidator | None:
    """The validator of a tokenizer manager on a relay server (None: relay is not selected).
    Built once per manager; a server whose settings do not resolve was refused at launch,
    so failing here is a start-up error, raised."""
    validator = getattr(manager, "_sglang_relay_validator", False)
    if validator is not False:
        return validator
    from sglang_relay.runtime.backend import serves_relay
    from sglang_relay.runtime.config.settings import server_settings

    args = getattr(manager, "server_args", None)
    validator = None
    if serves_relay(args):
        from sglang_relay.runtime.sglang.views import check_surface

        check_surface("TokenizerManager", manager)
        check_surface("TokenizerModelConfig", manager.model_config)
        settings = server_settings(args.model_path)
        config = manager.model_config
        validator = RequestValidator(
            settings, int(config.num_hidden_layers), int(config.vocab_size)
        )
    manager._sglang_relay_validator = validator
    return validator
