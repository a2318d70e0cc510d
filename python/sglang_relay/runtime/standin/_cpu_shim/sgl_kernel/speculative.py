"""``sgl_kernel.speculative`` of the CPU stand-in: NGRAM's tree-mask op in pure torch
(sglang_relay.runtime.standin.cpu_spec)."""

from sglang_relay.runtime.standin.cpu_spec import reconstruct_indices_from_tree_mask

__all__ = ["reconstruct_indices_from_tree_mask"]
