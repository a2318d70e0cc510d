"""Mixtral (``MixtralForCausalLM``): Mistral's attention without ``forward_prepare_native``
(split sequence); its sparse block is ``block_sparse_moe`` and takes no forward batch."""

from sglang_relay.runtime.models.anatomy import SPARSE_MLP, Anatomy

ADAPTERS = (
    Anatomy(
        "MixtralForCausalLM",
        "sglang.srt.models.mixtral.MixtralModel.forward",
        prepare="split",
        mlp_blocks=(SPARSE_MLP,),
        mlp_name="block_sparse_moe",
    ),
)
