"""Token alignment for indexed MoE GEMMs, in PyTorch, CUDA-graph capturable (no host syncs).

Same contract as vLLM's `moe_align_block_size` with `ignore_invalid_experts`:
the flat (token, slot) indices grouped by expert, each expert's run padded to
a multiple of `block` with the sentinel `T*K`; one expert id per block; the
padded total in a 1-element tensor. Within an expert the pairs keep their
flat order (a stable sort), which vLLM's op does not promise; the GEMMs do not
depend on it.
"""
from __future__ import annotations

import torch


def max_padded(num_pairs: int, num_experts: int, block: int) -> int:
    n = num_pairs + num_experts * (block - 1)
    if num_pairs < num_experts:
        n = min(num_pairs * block, n)
    return -(-n // block) * block  # whole blocks: the kernels load a block's ids with vector loads


def align_block_size(topk_ids: torch.Tensor, block: int, num_experts: int):
    """-> (sorted_ids int32 [P], expert_ids int32 [P/block], num_tokens_padded int32 [1])."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    end = torch.cumsum(padded, 0)
    start = end - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = start[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    size = max_padded(n, num_experts, block)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(size // block, device=dev) * block
    expert_ids = torch.searchsorted(end, block_start, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, end[-1:].to(torch.int32)
