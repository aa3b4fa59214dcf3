"""Stage 2: the down projection, scaled by the router weight and summed over
each token's top-k slots in a fixed order with fp32 accumulation."""
from __future__ import annotations

import torch

from kimi_k3_moe.kernels.common.alignment import AlignedPairs
from kimi_k3_moe.kernels.common.launch import Launch, cdiv, next_pow2
from kimi_k3_moe.kernels.common.topk_sum import topk_reduce
from kimi_k3_moe.kernels.triton._details.gemv_kernels import stage2_gemv_kernel
from kimi_k3_moe.kernels.triton._details.matmul_kernels import stage2_aligned_kernel
from kimi_k3_moe.kernels.triton.korder import stage2_args
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.stage1 import gemv_ahead, row_tile_args, weight_args
from kimi_k3_moe.kernels.triton.table import KernelConfig


def stage2_aligned(experts: TritonExperts, inter: torch.Tensor, pairs: AlignedPairs,
                   topk_weights: torch.Tensor, out: torch.Tensor, cfg: KernelConfig,
                   decode: str) -> list[Launch]:
    """Two launches: the matmul writes y[pair] (bf16), then y is summed per token in slot order."""
    y, args = _row_block_args(experts, inter, pairs, topk_weights, cfg, decode)
    args.update(SWAP=cfg.swap, **stage2_args(cfg), **row_tile_args(pairs))
    grid = (pairs.max_blocks * cdiv(experts.hidden_size, cfg.block_n * cfg.n_tiles),)
    matmul = Launch(stage2_aligned_kernel, grid, args, cfg.num_warps, cfg.num_stages, "stage2.aligned")
    return [matmul, topk_reduce(y, pairs, out, topk_weights.shape[1])]


def _row_block_args(experts: TritonExperts, inter: torch.Tensor, pairs: AlignedPairs, topk_weights: torch.Tensor,
                    cfg: KernelConfig, decode: str) -> tuple[torch.Tensor, dict]:
    """y ([pairs, H] bf16, per pair) and the arguments both row-block stage-2 kernels take."""
    y = torch.empty(pairs.num_pairs, experts.hidden_size, dtype=torch.bfloat16, device=inter.device)
    return y, dict(inter_ptr=inter, stride_im=inter.stride(0), **weight_args(experts, "w2", decode),
                   y_ptr=y, stride_ym=y.stride(0), topk_w_ptr=topk_weights.reshape(-1),
                   sorted_ptr=pairs.sorted_pairs, block_expert_ptr=pairs.block_expert, num_rows_ptr=pairs.num_rows,
                   num_pairs=pairs.num_pairs, hidden=experts.hidden_size, inter_size=experts.intermediate_size,
                   BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, N_TILES=cfg.n_tiles, PDL=False)


def gemv_block_k(cfg: KernelConfig, topk: int, inter_size: int, expert_map: torch.Tensor | None) -> int:
    """Stage 2's K step on the small-batch path (stage 1 writes inter in its word order). With an
    expert map the kernel takes one slot at a time: its tile keeps the all-slots tile's size by
    growing along K (up to SLOTS times, a power of two dividing inter_size), so each local slot
    streams in a few long steps instead of many short ones."""
    if expert_map is None:
        return cfg.block_k
    bk = cfg.block_k
    while bk * 2 <= cfg.block_k * next_pow2(topk) and inter_size % (bk * 2) == 0:
        bk *= 2
    return bk


def stage2_gemv(experts: TritonExperts, inter: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, expert_map: torch.Tensor | None, out: torch.Tensor,
                cfg: KernelConfig, decode: str, block_k: int) -> list[Launch]:
    """`inter` in word order of `block_k` tiles (gemv_block_k, what stage 1 was told to write)."""
    hidden = experts.hidden_size
    ids = topk_ids.reshape(-1)
    return [Launch(stage2_gemv_kernel, (out.shape[0], cdiv(hidden, cfg.block_n)), dict(
        inter_ptr=inter, stride_im=inter.stride(0), **weight_args(experts, "w2", decode),
        out_ptr=out, stride_om=out.stride(0),
        ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map,
        topk_w_ptr=topk_weights.reshape(-1), hidden=hidden, inter_size=experts.intermediate_size,
        TOPK=topk_ids.shape[1], SLOTS=next_pow2(topk_ids.shape[1]), HAS_MAP=expert_map is not None,
        num_ids=experts.num_experts if expert_map is None else expert_map.numel(),
        num_local=experts.num_experts,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, AHEAD=gemv_ahead(cfg), PDL=False),
        cfg.num_warps, cfg.num_stages, "stage2.gemv")]
