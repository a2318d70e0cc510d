"""gpt-oss (``GptOssForCausalLM``): sliding-window layers (128 keys in the released
models) alternating with full ones (``layer_types``), a learned sink logit per query head
in every layer (the attention block's ``sinks`` parameter, this rank's heads), q/k/v/o
biases, YaRN RoPE over the whole head, no q/k norm; its prepare takes the forward batch
(and may store KV in a fused RoPE kernel on CUDA), so the loop runs SGLang's unfused
sequence. Every layer is a sparse block whose router is ``router`` (experts with biases and
a clamped SwiGLU, inside SGLang's fused experts). Served with SGLang's hybrid SWA pool off
(``--disable-hybrid-swa-memory``: a relayed span's window layers keep all their KV)."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, Anatomy

GPT_OSS_MLP = frozenset({"router", "topk", "experts"})

ADAPTERS = (
    Anatomy(
        "GptOssForCausalLM",
        "sglang.srt.models.gpt_oss.GptOssModel.forward",
        attention_modules=BASE_ATTENTION,
        prepare="split",
        mlp_blocks=(GPT_OSS_MLP,),
        sinks="sinks",
        windows=True,
    ),
)
