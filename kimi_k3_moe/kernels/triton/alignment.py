"""Token alignment: (token, slot) pairs grouped by local expert into blocks of
`block_m` rows, on the GPU, without host synchronisation (see _details/align_kernels.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.kernels.triton._details import align_kernels as K
from kimi_k3_moe.kernels.triton.launch import Launch, cdiv, next_pow2

BLOCK = 256


@dataclass
class AlignedPairs:
    """Where each pair's row lives. Sizes are upper bounds; `num_rows` is on the device."""

    block_m: int
    num_pairs: int
    max_blocks: int
    local: torch.Tensor         # int32 [P]: local expert per pair, -1 = not on this rank
    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]: pair per row, num_pairs = padding
    block_expert: torch.Tensor  # int32 [max_blocks]: expert of each block (valid below num_rows)
    num_rows: torch.Tensor      # int32 [1]: rows in use (a multiple of block_m)
    offsets: torch.Tensor       # int32 [E]: first row of each expert
    # path "direct" (direct_pairs): block b is pair b alone; block_expert and local are topk_ids as
    # given, the kernels apply expert_map themselves; sorted_pairs, num_rows and offsets are unused
    direct: bool = False
    expert_map: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        return self.max_blocks * self.block_m


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    # sum over experts of ceil(c_e / block_m) <= num_pairs / block_m + (experts in use)
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def direct_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, block_m: int) -> AlignedPairs:
    """Path "direct": every (token, slot) pair is a block of its own (its one row first, block_m - 1
    padding rows), so nothing is launched to group them. With a few tokens nearly every pair has an
    expert to itself, and grouping cost more launches than it saved."""
    ids = topk_ids.reshape(-1)
    return AlignedPairs(block_m=block_m, num_pairs=ids.numel(), max_blocks=ids.numel(), local=ids,
                        sorted_pairs=ids, block_expert=ids, num_rows=ids, offsets=ids, direct=True,
                        expert_map=expert_map)


def align_launches(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int,
                   block_m: int) -> tuple[AlignedPairs, list[Launch]]:
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    device = ids.device
    max_blocks = max_blocks_for(num_pairs, num_experts, block_m)
    scratch = torch.empty(2 * num_experts, dtype=torch.int32, device=device)
    counts, fill = scratch[:num_experts], scratch[num_experts:]
    pairs = AlignedPairs(
        block_m=block_m, num_pairs=num_pairs, max_blocks=max_blocks,
        local=torch.empty(num_pairs, dtype=torch.int32, device=device),
        sorted_pairs=torch.empty(max_blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(max_blocks, dtype=torch.int32, device=device),
        num_rows=torch.empty(1, dtype=torch.int32, device=device),
        offsets=torch.empty(num_experts, dtype=torch.int32, device=device),
    )
    grid = (max(1, cdiv(num_pairs, BLOCK)),)
    launches = [
        Launch(K.align_zero_kernel, (cdiv(scratch.numel(), 1024),),
               dict(ptr=scratch, n=scratch.numel(), BLOCK=1024, PDL=False),
               num_warps=4, num_stages=1, label="align.zero"),
        Launch(K.align_count_kernel, grid, dict(
            ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map, local_ptr=pairs.local,
            counts_ptr=counts, sorted_ptr=pairs.sorted_pairs, num_pairs=num_pairs,
            max_rows=pairs.max_rows, HAS_MAP=expert_map is not None, BLOCK=BLOCK, PDL=False),
            num_warps=4, num_stages=1, label="align.count"),
        Launch(K.align_offsets_kernel, (1,), dict(
            counts_ptr=counts, offsets_ptr=pairs.offsets, num_rows_ptr=pairs.num_rows,
            num_experts=num_experts, BLOCK_M=block_m, E_POW2=max(16, next_pow2(num_experts)), PDL=False),
            num_warps=4, num_stages=1, label="align.offsets"),
        Launch(K.align_scatter_kernel, grid, dict(
            local_ptr=pairs.local, offsets_ptr=pairs.offsets, fill_ptr=fill,
            sorted_ptr=pairs.sorted_pairs, block_expert_ptr=pairs.block_expert,
            num_pairs=num_pairs, BLOCK_M=block_m, BLOCK=BLOCK, PDL=False),
            num_warps=4, num_stages=1, label="align.scatter"),
    ]
    return pairs, launches
