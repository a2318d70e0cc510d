"""The mode matrix: every SGLang 0.5.23 option that changes how forwards run is either
served correctly by relay or refused here, at start-up, with one message naming the option
and the way out. docs/limitations.md shows the same matrix; test/e2e/test_modes.py checks
that every refusal below is real.

Per-request refusals (a request relay cannot serve safely runs standard prefill, with a
``fallback`` reason, counted) live in
:func:`sglang_relay.runtime.sglang.scheduling.request_refusal`.

Supported and tested end to end (test/e2e): chunked prefill (any chunk size, spans across
chunks), ``--enable-mixed-chunk`` (mixed batches run SGLang's forward; its hidden-state
hook keeps their rows' states, :mod:`.decode`),
the overlap schedule (on by default; the stamps are written inside the forward),
retraction (re-prefilled outputs carry no hidden state: their runs are trimmed), eviction,
aborts, input logprobs and hidden states (per request: standard prefill), tensor parallel,
data parallel (``--dp-size``: requests routed to their spans' rank, :mod:`.dp_routing`) and
graph-mode decode (the decode capture is installed before SGLang captures its graphs,
:mod:`.decode`; refused only by :func:`graph_refusal`).
"""

from __future__ import annotations

from sglang_relay.runtime.models.registry import SUPPORTED_ARCHITECTURES, anatomy_of
from sglang_relay.runtime.sglang.server_view import ServerView

# --kv-cache-dtype values relay serves: the model's own dtype, a lower-precision float, or
# an unscaled FP8 element format (the splice rounds re-rotated keys once into it; relay's
# attention reads the elements as SGLang's backends do). mxfp8 / nvfp4 / fp4_mx_block16
# carry block scales relay does not read.
SERVED_KV_CACHE_DTYPES = frozenset({"auto", None, "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"})
# the live KV buffer dtypes (torch names) relay serves, whatever the model's dtype
SERVED_KV_BUFFER_DTYPES = frozenset(
    {"bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"}
)

OUT = "or serve without relay (drop --radix-cache-backend relay / use --no-relay)"


# architectures whose bitsandbytes 8-bit checkpoints relay serves: where the all-selected
# oracle equals standard prefill through the quantized modules on a real-weight checkpoint
# (test/e2e/test_quantized.py). The method is discontinuous at the scale of fp32's last
# bits (activations are cast to fp16 and rounded to int8 per row): a 1e-7 relative nudge of
# each layer's input moves next-token logprobs by up to 1.6 in Hugging Face's own forward,
# against <1e-4 unquantized (research/studies/bnb8_sensitivity.py). So only a checkpoint
# whose oracle is bit-exact can verify a family, random weights cannot (their oracle
# differs as any other kernel's would), and the one real checkpoint here is a Llama.
BNB_8BIT_ARCHITECTURES = frozenset({"LlamaForCausalLM"})


# relay's CPU stand-in for activation-quantizing methods (runtime/standin/quant_standin.py): it
# exists in a server only when the tests opted in, and is served on every architecture
STANDIN_QUANTIZATION = "relay_int8_pt"


def served_quantization(view: ServerView, architecture: str | None) -> bool:
    """Weight quantization relay serves (:mod:`.quant_methods` classifies every method and
    says how each treats a matmul's rows): bitsandbytes only for 8-bit checkpoints of the
    architectures in :data:`BNB_8BIT_ARCHITECTURES` (the one method that runs here, so the
    one whose families are verified one by one); relay's CPU stand-in when the tests
    registered it."""
    from sglang_relay.runtime.config.quant_methods import classified

    if view.quantization == STANDIN_QUANTIZATION:
        return True
    if view.quantization == "bitsandbytes":
        return view.bnb_8bit and architecture in BNB_8BIT_ARCHITECTURES
    method = classified(view.quantization)
    return method is not None and method.served


def quantization_note(view: ServerView, architecture: str | None) -> str:
    from sglang_relay.runtime.config.quant_methods import refusal_note

    if view.quantization != "bitsandbytes":
        return f": {refusal_note(str(view.quantization))}"
    if not view.bnb_8bit:  # 4-bit, or quantized at load: SGLang's loader builds it on cuda
        return (
            " without an 8-bit bitsandbytes checkpoint (4-bit and quantizing at load build "
            "their state on cuda in SGLang's loader)"
        )
    return (
        f" 8-bit on {architecture or 'an unknown architecture'} (verified on Llama only: "
        "no real checkpoint of this family here, and random weights cannot verify this "
        "method, research/log.md)"
    )


def ship_refusal(view: ServerView, ship_role: str | None) -> str | None:
    """Prefill/decode disaggregation is served with span shipping only (a decode server
    publishes the spans it decodes, a prefill server receives them: runtime/scale/ship); the
    shipping itself is built for one scheduler per server, without LoRA."""
    mode = view.disaggregation_mode if view.disaggregation_mode not in (None, "") else "null"
    wanted = {"decode": "publisher", "prefill": "receiver"}.get(mode)
    flag = {"publisher": "--relay-ship-to HOST:PORT", "receiver": "--relay-ship-listen HOST:PORT"}
    checks = [
        (
            mode not in ("null", "decode", "prefill"),
            f"--disaggregation-mode {mode}",
            "use prefill or decode",
        ),
        (
            wanted is not None and ship_role != wanted,
            f"--disaggregation-mode {mode} without span shipping (an output decoded on a "
            "decode server reaches a prefill server only as a prefix, never by content)",
            f"add {flag.get(wanted or '', '')} (docs/scale-out.md), or drop --disaggregation-mode",
        ),
        (
            mode == "decode" and view.disable_radix_cache,
            "--disaggregation-mode decode without its radix cache (relay is a radix cache)",
            "add --disaggregation-decode-enable-radix-cache",
        ),
        (
            ship_role is not None and (view.tp_size != 1 or view.dp_size != 1),
            f"span shipping at --tp-size {view.tp_size} --dp-size {view.dp_size} (built for "
            "one scheduler per server: each rank would ship its own KV shard)",
            "use --tp-size 1 --dp-size 1 on shipping servers, or drop --relay-ship-*",
        ),
        (
            ship_role is not None and view.enable_lora,
            "span shipping with LoRA (adapter ids are each server's own)",
            "drop the LoRA flags or --relay-ship-*",
        ),
        (
            ship_role == "publisher" and mode == "prefill",
            "--relay-ship-to on a prefill server (it decodes nothing to publish)",
            "use --relay-ship-listen on prefill servers",
        ),
        (
            ship_role == "receiver" and mode == "decode",
            "--relay-ship-listen on a decode server (it prefills nothing to relay)",
            "use --relay-ship-to on decode servers",
        ),
    ]
    for refused, what, way_out in checks:
        if refused:
            return f"sglang-relay cannot serve {what}; {way_out}, {OUT}"
    return None


# speculative algorithms relay serves: NGRAM has no draft model, its verify forwards are
# the target's own (captured like decode), its compaction is followed (KV_MOVE_TARGET);
# EAGLE's draft prefills every row of a relay extend from the hidden rows relay returns
# (its own KV for a span's rows is recomputed, not spliced: acceptance is at stake, not
# the target's tokens), its verify forwards are NGRAM's
SERVED_SPECULATIVE = frozenset({"NGRAM", "EAGLE"})


def speculating(view: ServerView) -> bool:
    return str(view.speculative_algorithm or "").upper() not in ("", "NONE")


def spec_refusal(
    view: ServerView, ship_role: str | None = None, *, influence: bool = False
) -> str | None:
    """Speculative decoding relay serves: NGRAM and EAGLE (topk 1), on the shapes
    test_speculative.py runs (one scheduler, token pages, eager verify, no overlap: SGLang
    turns it off on a CPU). EAGLE3's aux states are not returned by a relay extend
    (research/design-speculative.md). ``influence``: ``tau_inf`` scores accumulate in plain
    decode only."""
    if not speculating(view):
        return None
    algo = str(view.speculative_algorithm)
    checks = [
        (
            algo.upper() not in SERVED_SPECULATIVE,
            f"--speculative-algorithm {algo} (EAGLE3 reads auxiliary hidden states from "
            "inside the target's forward, which a relay extend does not return; other draft "
            "models are not verified with relay)"
            if algo.upper() == "EAGLE3"
            else f"--speculative-algorithm {algo} (not verified with relay)",
            "use --speculative-algorithm NGRAM or EAGLE",
        ),
        (
            algo.upper() == "EAGLE" and view.speculative_eagle_topk != 1,
            f"EAGLE with --speculative-eagle-topk {view.speculative_eagle_topk} (relay's "
            "end-to-end test drafts one token a step: a draft tree's KV compaction is not "
            "verified with relay)",
            "use --speculative-eagle-topk 1",
        ),
        (
            view.device != "cpu" and not view.disable_overlap_schedule,
            "speculative decoding with the overlap schedule (SGLang runs NGRAM overlapped on "
            "GPUs; relay's end-to-end test runs it on a CPU, where SGLang turns overlap off)",
            "add --disable-overlap-schedule",
        ),
        (
            influence,
            "speculative decoding with influence scores (the profile's tau_inf: they "
            "accumulate in plain decode forwards, a speculative server verifies drafts)",
            "use a profile without tau_inf, or drop --speculative-algorithm",
        ),
        (
            view.tp_size != 1 or view.dp_size != 1,
            f"speculative decoding at --tp-size {view.tp_size} --dp-size {view.dp_size} (not "
            "verified with relay)",
            "use --tp-size 1 --dp-size 1 with --speculative-algorithm",
        ),
        (
            view.page_size != 1,
            f"speculative decoding with --page-size {view.page_size} (verify windows are "
            "allocated past the committed page; not verified with relay)",
            "use --page-size 1 with --speculative-algorithm",
        ),
        (
            view.enable_torch_compile,
            "speculative decoding with --enable-torch-compile (verify graphs are not "
            "verified with relay)",
            "drop --enable-torch-compile",
        ),
        (
            view.enable_lora,
            "speculative decoding with LoRA (not verified with relay)",
            "drop the LoRA flags or --speculative-algorithm",
        ),
        (
            view.enable_hierarchical_cache,
            "speculative decoding with --enable-hierarchical-cache (not verified with relay)",
            "drop --enable-hierarchical-cache or --speculative-algorithm",
        ),
        (
            ship_role is not None or view.disaggregation_mode not in (None, "", "null"),
            "speculative decoding with disaggregation or span shipping (not verified with relay)",
            "drop --speculative-algorithm on shipping servers",
        ),
    ]
    for refused, what, way_out in checks:
        if refused:
            return f"sglang-relay cannot serve {what}; {way_out}, {OUT}"
    return None


def refusal(
    view: ServerView, *, architecture: str | None = None, ship_role: str | None = None
) -> str | None:
    """The one-line refusal for a server relay cannot serve correctly, else None."""
    if architecture is not None and architecture not in SUPPORTED_ARCHITECTURES:
        return (
            f"sglang-relay does not support the {architecture} architecture yet (supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}); drop --radix-cache-backend "
            "relay to serve this model without relay"
        )
    # MLA (DeepSeek-V2/V3, Kimi-K2): the modes that keep MHA's KV layout in relay, LoRA
    # (SGLang corrects the absorbed kv_b weights per request), latent rows in another dtype
    if architecture is not None and anatomy_of(architecture).prepare == "mla":
        shipping = ship_role is not None or view.disaggregation_mode not in (None, "", "null")
        off = [what for what, on in (
            ("speculative decoding (--speculative-algorithm)", speculating(view)),
            ("LoRA (--enable-lora / --lora-paths)", view.enable_lora),
            ("--enable-hierarchical-cache", view.enable_hierarchical_cache),
            ("span shipping or disaggregation", shipping),
            (f"--kv-cache-dtype {view.kv_cache_dtype}", view.kv_cache_dtype not in (None, "auto")),
        ) if on]  # fmt: skip
        if off:
            return (f"sglang-relay cannot serve {off[0]} on an MLA model (not verified on "
                    f"latent rows); drop it, {OUT}")  # fmt: skip
    for check in (ship_refusal(view, ship_role), spec_refusal(view, ship_role)):
        if check is not None:
            return check
    moe = architecture is not None and any(
        "experts" in block for block in anatomy_of(architecture).mlp_blocks
    )
    checks = [
        (view.hybrid_model, "Mamba / linear-attention or DSA models", "use a dense model"),
        (
            view.hybrid_swa,
            "SGLang's hybrid sliding-window KV pool (it frees a window layer's KV past the "
            "window, which a relayed span's later readers still need)",
            "add --disable-hybrid-swa-memory",
        ),
        (
            view.enable_lora and moe,
            f"--enable-lora on a mixture-of-experts model ({architecture}: SGLang's MoE LoRA "
            "reads per-request expert info that relay's row subsets do not rebuild)",
            "serve LoRA on a dense model, or drop the LoRA flags",
        ),
        (
            view.disable_radix_cache,
            "--disable-radix-cache (relay is a radix cache)",
            "drop --disable-radix-cache",
        ),
        (view.pp_size != 1, f"--pp-size {view.pp_size}", "use --pp-size 1"),
        (
            view.enable_dp_attention or view.attn_dp_size != 1,
            "data-parallel attention (--attn-dp-size, --enable-dp-attention: ranks share "
            "one batch, relay plans per rank)",
            "use --dp-size N (one scheduler per rank, routed to its spans)",
        ),
        (
            view.kv_cache_dtype not in SERVED_KV_CACHE_DTYPES,
            f"--kv-cache-dtype {view.kv_cache_dtype} (block-scaled or packed KV: relay's "
            "splice and attention read unscaled elements)",
            f"use --kv-cache-dtype {' / '.join(sorted(SERVED_KV_CACHE_DTYPES - {None}))}",
        ),
        (
            view.quantization is not None and not served_quantization(view, architecture),
            f"--quantization {view.quantization}{quantization_note(view, architecture)}",
            "serve an unquantized checkpoint or one of a served method (docs/limitations.md)",
        ),
        (
            view.load_format == "gguf" or view.model_path.endswith(".gguf"),
            "GGUF checkpoints (--load-format gguf)",
            "serve the Hugging Face checkpoint",
        ),
        (
            view.enable_lora and view.lora_backend != "torch_native",
            f"--enable-lora / --lora-paths with --lora-backend {view.lora_backend} (relay "
            "recomputes row subsets through LoRA layers; their per-row adapter info is built "
            "for torch_native only, runtime/forward/lora_rows.py)",
            "add --lora-backend torch_native, or drop the LoRA flags",
        ),
        (
            view.enable_deterministic_inference,
            "--enable-deterministic-inference (relayed KV is approximate by design)",
            "drop --enable-deterministic-inference",
        ),
        (
            view.dllm_algorithm not in (None, ""),
            f"--dllm-algorithm {view.dllm_algorithm} (reuses row slots as outputs)",
            "drop --dllm-algorithm",
        ),
        (
            view.enable_hisparse,
            "--enable-hisparse (stages KV outside model forwards)",
            "drop --enable-hisparse",
        ),
        (
            view.enable_pdmux,
            "--enable-pdmux (prefill runs through forward_split_prefill, outside relay's "
            "hooked forward)",
            "drop --enable-pdmux",
        ),
        (
            view.attn_cp_size != 1,
            f"--attn-cp-size {view.attn_cp_size} (context-parallel attention: each rank "
            "holds a shard of a row, relay's loop the whole row)",
            "use --attn-cp-size 1",
        ),
        (
            view.enable_prefill_cp,
            "--enable-prefill-cp (prefill context parallelism shards a row's tokens across ranks)",
            "drop --enable-prefill-cp",
        ),
        (
            view.dcp_size != 1,
            f"--dcp-size {view.dcp_size} (decode context parallelism shards the KV of a "
            "row across ranks)",
            "use --dcp-size 1",
        ),
        (
            view.enable_attn_tp_input_scattered,
            "--enable-attn-tp-input-scattered (scatters the residual stream across TP "
            "ranks at layer boundaries relay's loop does not run)",
            "drop --enable-attn-tp-input-scattered",
        ),
        (
            view.enable_layernorm_sp,
            "--enable-layernorm-sp (sequence-parallel layer boundaries relay's loop does not run)",
            "drop --enable-layernorm-sp",
        ),
        (
            view.prefill_only_disable_kv_cache,
            "--prefill-only-disable-kv-cache (no KV cache to relay into)",
            "drop --prefill-only-disable-kv-cache",
        ),
    ]
    for refused, what, way_out in checks:
        if refused:
            return f"sglang-relay cannot serve {what}; {way_out}, {OUT}"
    return None


def kv_layout_refusal(
    page_size: int, kv_dtype: str, model_dtype: str, scaled: bool = False
) -> str | None:
    """Refuse the live KV pools (checked in the scheduler, whatever the arguments said):
    a page size below one token, a KV buffer dtype relay cannot read as plain elements,
    or a pool that keeps scales beside its elements (``scaled``: SGLang's quantized KV
    methods, e.g. the CPU FP8 pool of AMX machines, FP4). The model's own dtype, bfloat16 /
    float16 and unscaled FP8 (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) are served.
    Dtypes by torch name (``bfloat16``)."""
    if page_size < 1:
        return f"sglang-relay cannot serve a KV allocator with page size {page_size}, {OUT}"
    if scaled:
        return (
            f"sglang-relay cannot serve a scaled {kv_dtype} KV cache (SGLang keeps per-block "
            "or per-token scales beside it; relay's splice and attention read unscaled "
            "elements); use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2 on a backend "
            f"that stores them unscaled, {OUT}"
        )
    if kv_dtype != model_dtype and kv_dtype not in SERVED_KV_BUFFER_DTYPES:
        return (
            f"sglang-relay cannot serve a {kv_dtype} KV cache for a {model_dtype} model "
            "(relay's splice and attention read plain float or FP8 elements); use "
            f"--kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2, {OUT}"
        )
    return None


def graph_refusal(
    graphs: dict[str, bool], *, capture_in_graph: bool, influence: bool, speculative: bool = False
) -> str | None:
    """Refuse captured graphs that would skip relay's work. ``graphs``: whether ``decode`` /
    ``prefill`` batches may replay a graph (CUDA graphs, the CPU graph runner);
    ``capture_in_graph``: the decode capture (stamps, hidden states) was installed before
    SGLang captured its decode graphs, so replays run it; ``influence``: the profile
    accumulates influence scores, a per-request host loop no graph can hold;
    ``speculative``: the server verifies drafts (its decode graphs are verify graphs, not
    verified with relay)."""
    if graphs.get("decode") and speculative:
        return (
            "sglang-relay has not verified speculative decoding's captured verify graphs; add "
            f"--cuda-graph-backend-decode disabled (on a CPU: drop --enable-torch-compile), {OUT}"
        )
    if graphs.get("decode") and influence:
        return (
            "sglang-relay accumulates influence scores (the profile's tau_inf) in eager "
            "decode only, and captured decode graphs would skip it; use a profile without "
            "tau_inf, or add --cuda-graph-backend-decode disabled (on a CPU: drop "
            f"--enable-torch-compile), {OUT}"
        )
    if graphs.get("decode") and not capture_in_graph:
        return (
            "sglang-relay's decode capture was not installed before SGLang captured its "
            "decode graphs, so a replay would skip the slot stamps and hidden states; add "
            "--cuda-graph-backend-decode disabled (on a CPU: drop --enable-torch-compile), "
            f"{OUT}"
        )
    if graphs.get("prefill"):
        return (
            "sglang-relay runs relay extends in its own eager layer loop, which prefill "
            f"graphs would skip; add --disable-prefill-cuda-graph, {OUT}"
        )
    return None
