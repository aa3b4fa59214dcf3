"""Token alignment for indexed MoE GEMMs, in PyTorch, CUDA-graph capturable (no host syncs).

Same contract as vLLM's `moe_align_block_size` with `ignore_invalid_experts`:
the flat (token, slot) indices grouped by expert, each expert's run padded to
a multiple of `block` with the sentinel `T*K`; one expert id per block; the
padded total in a 1-element tensor. Ids below 0 (experts of other ranks, after an
expert map) take no row, as vLLM's op skips them. Within an expert the pairs keep their
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
    flat = torch.where(flat < 0, num_experts, flat)  # other ranks' pairs: a bucket past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block - 1) // block * block
    end = torch.cumsum(padded, 0)
    start = torch.cat([end - padded, end[-1:]])
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    size = max_padded(n, num_experts, block)
    # the skipped pairs land in one spare slot past the end (no boolean indexing: graph capturable)
    dest = torch.where(expert_of < num_experts, start[expert_of] + torch.arange(n, device=dev) - first[expert_of],
                       size)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    sorted_ids = sorted_ids[:size]
    block_start = torch.arange(size // block, device=dev) * block
    expert_ids = torch.searchsorted(end, block_start, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, end[-1:].to(torch.int32)
