"""Token alignment: (token, slot) pairs sorted by expert, each expert padded to BM rows.

Plain PyTorch with shapes fixed by (T, k, E, BM), no host synchronisation and no
data-dependent shapes, so it runs inside a CUDA/HIP graph on the GPU and
identically on the CPU (where the emulator and the tests use it). Ties keep slot
order (stable sort), so the layout is deterministic.

  sorted_slots [P]      int32: flat slot t*k + j of each sorted row; T*k on padding rows
  block_expert [P/BM]   int32: local expert of each BM-row block; -1 for unused blocks
P = round_up(T*k + min(E, T*k) * (BM - 1), BM) bounds every routing: each expert
that gets any row wastes at most BM - 1 rows of padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AlignedRouting:
    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    num_slots: int       # T*k, also the padding sentinel
    block_m: int

    @property
    def num_rows(self) -> int:
        return self.sorted_slots.numel()


def padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_tokens(local_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """`local_ids` [T, k]: local expert per slot, -1 where the expert lives on another rank."""
    if local_ids.dim() != 2:
        raise ValueError(f"local expert ids must be [tokens, top_k], got {tuple(local_ids.shape)}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m ({block_m}) and num_experts ({num_experts}) must be >= 1")
    device = local_ids.device
    flat = local_ids.reshape(-1).long()
    S = flat.numel()
    P = padded_rows(S, num_experts, block_m)
    # slots of other ranks (and anything out of range) sort last, under key E, and are dropped
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    order = torch.sort(key, stable=True).indices
    key_sorted = key[order]
    run_start = torch.cumsum(counts, 0) - counts                    # first sorted index of each key
    rank = torch.arange(S, device=device) - run_start[key_sorted]
    dest_base = torch.cat([starts, starts.new_full((1,), P)])       # key E -> beyond P: dropped
    dest = dest_base[key_sorted] + rank
    sorted_slots = torch.full((P + S,), S, dtype=torch.int32, device=device)
    sorted_slots[dest] = order.to(torch.int32)
    block_start = torch.arange(0, P, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return AlignedRouting(sorted_slots[:P].contiguous(), block_expert.to(torch.int32), S, block_m)
