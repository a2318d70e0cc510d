"""Every weight-quantization method of SGLang 0.5.23 (``--quantization`` or a checkpoint's
``quant_method``), classified for relay: served or refused, and why.

Relay's layer driver runs a layer's rows through SGLang's own linear modules (``proj(x)``,
which calls the method's ``apply``), the rows a relay forward computes at that layer: the
same module call for every method (``test/e2e/test_quantized.py`` covers it on this CPU
with bitsandbytes 8-bit and a per-tensor stand-in). What differs between methods is how
they treat a matmul's activation rows, which decides what a row subset means:

* ``weight-only``: activations stay in the model's dtype: a row's result is its own;
* ``per-row``: each row's activations get their own scale (per token, or per group of
  columns of one row): a row's result is its own;
* ``static``: a scale calibrated into the checkpoint: a row's result is its own;
* ``per-tensor``: one dynamic scale per matmul, the largest magnitude over all its rows
  (or LLM.int8's outlier columns, chosen over all rows): a row's result depends on the
  rows beside it (dynamic FP8 on ROCm with per-tensor weights; on CUDA SGLang 0.5.23
  quantizes dynamic FP8 activations per token). SGLang's own prefill is batch-coupled
  under these (a prefix hit of the same prompt already gives other logprobs: measured on
  the CPU stand-in and on bitsandbytes 8-bit, ``sglang-relay bench quantized``), and a
  relay forward's rows are one more such batch; the rows relay does not recompute have no
  activations to take a batch-level scale over, so none is passed. Served; the server reports
  ``linear_rows: batch-coupled`` (measured at start-up, ``sglang/model.py: linear_rows``).

A served GPU method has not run here (none of them runs on this CPU): docs/gpu.md gives the
check a GPU run makes for it (``sglang-relay bench quantized --url``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantMethod:
    activations: str  # weight-only | per-row | static | per-tensor | a mix ("static, per-tensor")
    served: bool
    note: str  # how it treats activations (served) or why it is refused


_GPU = "GPU only in SGLang 0.5.23"
METHODS: dict[str, QuantMethod] = {
    # served: the module call the CPU tests cover, activations per row / static / per tensor
    "bitsandbytes": QuantMethod(
        "per-row, per-tensor",
        True,
        "LLM.int8: int8 rows with per-row scales; with llm_int8_threshold > 0 the fp16 outlier "
        "columns are chosen over all rows (8-bit Llama checkpoints; 4-bit and other families "
        "refused: modes.quantization_note)",
    ),
    "w8a8_fp8": QuantMethod(
        "per-row, per-tensor",
        True,
        "FP8 weights, dynamic activation scales: per token on CUDA (apply_fp8_linear calls "
        "sglang_per_token_quant_fp8 there), one per matmul on ROCm with per-tensor weights",
    ),
    "w8a8_int8": QuantMethod("per-row", True, "int8 activations, per-token dynamic scales"),
    "awq": QuantMethod("weight-only", True, "4-bit weights, activations in the model's dtype"),
    "awq_marlin": QuantMethod("weight-only", True, "AWQ weights through Marlin kernels"),
    "gptq": QuantMethod("weight-only", True, "4/8-bit weights, activations in the model's dtype"),
    "gptq_marlin": QuantMethod("weight-only", True, "GPTQ weights through Marlin kernels"),
    "compressed-tensors": QuantMethod(
        "weight-only, static, per-row",
        True,
        "per layer scheme: W4A16/W8A16 weight-only; W8A8 FP8/int8 static or per-token "
        "dynamic (use_per_token_if_dynamic on); W4A4 NVFP4 per 16-element block of a row (a "
        "kv_cache_scheme is refused at start-up: scaled KV)",
    ),
    "modelopt": QuantMethod(
        "static",
        True,
        "ModelOpt FP8: calibrated per-tensor input scales (a checkpoint that also quantizes "
        "the KV cache, kv_cache_quant_algo, is refused at start-up: scaled KV)",
    ),
    "modelopt_fp8": QuantMethod("static", True, "ModelOpt FP8: calibrated input scales"),
    "modelopt_fp4": QuantMethod(
        "static, per-row", True, "NVFP4: a calibrated global scale, per-16-element block scales"
    ),
    # refused
    "fp8": QuantMethod(
        "static, per-row, per-tensor",
        False,
        "SGLang's Fp8Config gives every attention layer k/v scales (Fp8KVCacheMethod, 1.0 "
        "when the checkpoint has none), which relay refuses as scaled KV; to serve it, a GPU "
        "run must show scales of 1.0 read as the unscaled pool relay splices",
    ),
    "mxfp8": QuantMethod("", False, f"MX block formats not reviewed for row subsets ({_GPU})"),
    "mxfp4": QuantMethod("", False, f"MX block formats not reviewed for row subsets ({_GPU})"),
    "mxfp_w4a8": QuantMethod("", False, f"MX block formats not reviewed ({_GPU})"),
    "w4afp8": QuantMethod("", False, f"mixed int4/FP8 MoE kernels not reviewed ({_GPU})"),
    "moe_wna16": QuantMethod("", False, f"MoE-only weight kernels not reviewed ({_GPU})"),
    "gguf": QuantMethod("", False, "GGUF checkpoints (refused with --load-format gguf)"),
}


def classified(name: str | None) -> QuantMethod | None:
    return METHODS.get(name) if name else None


def refusal_note(name: str) -> str:
    """Why ``name`` is refused (a method not in :data:`METHODS` was never reviewed)."""
    method = METHODS.get(name)
    if method is not None and not method.served:
        return method.note
    return "not reviewed against relay's row subsets (runtime/config/quant_methods.py)"
