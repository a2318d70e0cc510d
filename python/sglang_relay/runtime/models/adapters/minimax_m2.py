"""MiniMax-M2 to M2.5 (``MiniMaxM2ForCausalLM``): partial rotary (``rotary_dim`` 64 of a
128-dim head: the first 64 dims turn, the rest never do), GQA with q/k/v in one projection
and no native prepare (its ``forward_prepare`` takes the forward batch), one RMSNorm over
all heads of q and one over all heads of k before RoPE (``use_qk_norm``; SGLang's
``qk_norm_impl`` reduces the sums across attention-TP ranks), a sigmoid-routed sparse block
with a score-correction bias under ``block_sparse_moe`` in every layer."""

from sglang_relay.runtime.models.anatomy import BASE_ATTENTION, SPARSE_MLP, Anatomy

ADAPTERS = (
    Anatomy(
        "MiniMaxM2ForCausalLM",
        "sglang.srt.models.minimax_m2.MiniMaxM2Model.forward",
        attention_modules=BASE_ATTENTION,
        prepare="split",
        mlp_blocks=(SPARSE_MLP,),
        mlp_name="block_sparse_moe",
        optional_attention=frozenset({"q_norm", "k_norm"}),
        qk_norm="across_heads",
    ),
)
