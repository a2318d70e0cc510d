"""Forced outputs through a real server: a custom logit processor (SGLang's
``--enable-custom-logit-processor``) that makes a request emit given token ids, one per
step (``custom_params: {"force": [ids]}``). Used where a model must produce a shape of
output it would not write by itself (a reasoning model's ``<think> ... </think> answer``
from a model that does not reason), with its KV decoded as that output's would be. It
lives in the package so the scheduler process can import it (dill pickles the class by
reference)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ForceTokens(CustomLogitProcessor):
    """Row ``i`` emits ``params["force"][step]`` while steps remain (others untouched).
    Steps are counted per request by the processor's own calls (one per sampled token):
    under the overlap schedule ``req.output_ids`` lags one step behind the sampling."""

    steps: dict[str, int] = {}  # rid -> tokens forced so far (this scheduler process)

    def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            force = (params or {}).get("force")
            if not force:
                continue
            rid = params["__req__"].rid
            step = ForceTokens.steps.get(rid, 0)
            if step < len(force):
                row = torch.full_like(logits[i], float("-inf"))
                row[int(force[step])] = 0.0
                logits[i] = row
            if step + 1 >= len(force):
                ForceTokens.steps.pop(rid, None)
            else:
                ForceTokens.steps[rid] = step + 1
        return logits


def forced_request(prompt: list[int], output: list[int]) -> dict[str, Any]:
    """A ``/generate`` body whose greedy output is exactly ``output`` (EOS ignored)."""
    params = {
        "max_new_tokens": len(output),
        "temperature": 0,
        "ignore_eos": True,
        "custom_params": {"force": list(output)},
    }
    return {
        "input_ids": list(prompt),
        "sampling_params": params,
        "custom_logit_processor": ForceTokens.to_str(),
    }
