"""Stage 1: gate and up projections with the activation in the epilogue.

Gate and up tiles of the same columns are computed by the same program, so
only the activated [rows, I] result reaches memory, never [rows, 2I].
"""
from __future__ import annotations

import torch

from kimi_k3_moe.activation import SILU, SITUV2, ActivationSpec, UnsupportedActivationError
from kimi_k3_moe.kernels.common.alignment import AlignedPairs
from kimi_k3_moe.kernels.common.launch import Launch, cdiv, next_pow2
from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details.gemv_kernels import stage1_gemv_kernel
from kimi_k3_moe.kernels.triton._details.matmul_kernels import stage1_aligned_kernel
from kimi_k3_moe.kernels.triton._details.permute_kernels import permute_pairs_kernel, permute_words_kernel
from kimi_k3_moe.kernels.triton._details.split_kernels import stage1_split_kernel
from kimi_k3_moe.kernels.triton.korder import stage1_args
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.table import KernelConfig
from kimi_k3_moe.kernels.triton.tickets import tickets
from kimi_k3_moe.kernels.triton.weight_codes import decode_code, weights_code


def activation_args(activation: ActivationSpec) -> dict:
    """ACT (compiled in) and the betas (runtime fp32): see _details/activation.py."""
    if not isinstance(activation, ActivationSpec):
        raise TypeError(f"activation must be an ActivationSpec, got {type(activation).__name__}")
    if activation.name == SILU:
        return dict(ACT=C.ACT_SILU, beta=1.0, linear_beta=1.0)
    if activation.name == SITUV2:
        if activation.linear_beta is None:
            return dict(ACT=C.ACT_SITU_NO_LINEAR, beta=float(activation.beta), linear_beta=1.0)
        return dict(ACT=C.ACT_SITU, beta=float(activation.beta), linear_beta=float(activation.linear_beta))
    raise UnsupportedActivationError(f"the Triton backend has no kernel for activation {activation.name!r}")


def row_tile_args(pairs: AlignedPairs) -> dict:
    """The aligned kernels' row-block arguments: BLOCK_ROWS rows per block (the kernels split them as
    row_tiles does: a main and a tail tile), and PATH: whether each block is one pair whose expert the
    kernel looks up itself (PATH_DIRECT, PATH_DIRECT_MAP through the expert map)."""
    emap = pairs.expert_map
    if not pairs.direct:
        path = C.PATH_ALIGNED
    else:
        path = C.PATH_DIRECT if emap is None else C.PATH_DIRECT_MAP
    return dict(BLOCK_ROWS=pairs.block_m, PATH=path,
                map_ptr=pairs.block_expert if emap is None else emap,
                num_ids=pairs.num_ids, num_local=pairs.num_experts)


def weight_args(experts: TritonExperts, which: str, decode: str) -> dict:
    """A stage's weight pointers, strides and WEIGHTS: the code of their format, offsets, and the
    decoder `decode` ("ptx" | "bits") resolves to for them."""
    w = getattr(experts, which)
    s = getattr(experts, f"{which}_scale")
    o = getattr(experts, f"{which}_offset")
    return dict(w_ptr=w, stride_we=w.stride(0), stride_wn=w.stride(1),
                s_ptr=s, stride_se=s.stride(0), stride_sn=s.stride(1),
                o_ptr=s if o is None else o,
                WEIGHTS=weights_code(experts.weight_format, decode_code(decode, experts.wide_scales), o is not None))


GEMV_MAX_AHEAD = 4


def gemv_ahead(cfg: KernelConfig) -> int:
    """K steps of weights a GEMV program keeps in flight: the stage's num_stages on the gemv path (whose
    loops have no dot for the compiler to pipeline), at most GEMV_MAX_AHEAD."""
    return min(cfg.num_stages, GEMV_MAX_AHEAD)


def word_order(hidden: torch.Tensor, block_k: int) -> tuple[torch.Tensor, Launch]:
    """hidden (any float dtype) -> bf16 copy in word order of block_k tiles (see permute_kernels.py)."""
    out = torch.empty(hidden.shape, dtype=torch.bfloat16, device=hidden.device)
    return out, Launch(permute_words_kernel, (hidden.shape[0], cdiv(hidden.shape[1], block_k)), dict(
        x_ptr=hidden, stride_xm=hidden.stride(0), out_ptr=out, stride_om=out.stride(0), BLOCK_K=block_k, PDL=False),
        4, 1, "stage1.word_order")


def pair_order(hidden: torch.Tensor, block_t: int = 16, block_k: int = 512) -> tuple[torch.Tensor, Launch]:
    """hidden (any float dtype, K a multiple of 32) -> bf16 copy in pair order (decode.pair_order)."""
    rows, k = hidden.shape
    if k % 32:
        raise ValueError(f"hidden: K = {k} must be a multiple of 32 for the pair order")
    out = torch.empty(hidden.shape, dtype=torch.bfloat16, device=hidden.device)
    block_k = min(block_k, next_pow2(k))
    return out, Launch(permute_pairs_kernel, (cdiv(rows, block_t), cdiv(k, block_k)), dict(
        x_ptr=hidden, stride_xm=hidden.stride(0), out_ptr=out, stride_om=out.stride(0), num_rows=rows, K=k,
        BLOCK_T=block_t, BLOCK_K=block_k, PDL=False), 4, 1, "stage1.pair_order")


def _aligned_args(experts: TritonExperts, hidden: torch.Tensor, pairs: AlignedPairs, topk: int,
                  activation: ActivationSpec, cfg: KernelConfig, decode: str) -> tuple[torch.Tensor, dict]:
    """inter ([pairs, I] bf16, per pair) and the arguments both row-block stage-1 kernels take."""
    inter = torch.empty(pairs.num_pairs, experts.intermediate_size, dtype=torch.bfloat16, device=hidden.device)
    return inter, dict(x_ptr=hidden, stride_xm=hidden.stride(0), **weight_args(experts, "w13", decode),
                       inter_ptr=inter, stride_im=inter.stride(0),
                       sorted_ptr=pairs.sorted_pairs, block_expert_ptr=pairs.block_expert,
                       num_rows_ptr=pairs.num_rows, num_pairs=pairs.num_pairs,
                       inter_size=experts.intermediate_size, hidden=experts.hidden_size,
                       **activation_args(activation), TOPK=topk, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=False)


def stage1_aligned(experts: TritonExperts, hidden: torch.Tensor, pairs: AlignedPairs, topk: int,
                   activation: ActivationSpec, cfg: KernelConfig, decode: str,
                   stage2: KernelConfig) -> tuple[torch.Tensor, Launch]:
    """`hidden` must already be in the order cfg reads (KOrder.stored_order); inter comes out in
    the order `stage2` (stage 2's config) reads."""
    inter, args = _aligned_args(experts, hidden, pairs, topk, activation, cfg, decode)
    args.update(SWAP=cfg.swap, **stage1_args(cfg, stage2), **row_tile_args(pairs))
    grid = (pairs.max_blocks * cdiv(experts.intermediate_size, cfg.block_n),)
    return inter, Launch(stage1_aligned_kernel, grid, args, cfg.num_warps, cfg.num_stages, "stage1.aligned")


def _pair_args(experts: TritonExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
               expert_map: torch.Tensor | None, activation: ActivationSpec, decode: str) -> tuple[torch.Tensor, dict]:
    """inter ([pairs, I] bf16) and the arguments of the stage-1 kernels with a program per pair."""
    inter = torch.empty(topk_ids.numel(), experts.intermediate_size, dtype=torch.bfloat16, device=hidden.device)
    ids = topk_ids.reshape(-1)
    return inter, dict(x_ptr=hidden, stride_xm=hidden.stride(0), **weight_args(experts, "w13", decode),
                       inter_ptr=inter, stride_im=inter.stride(0),
                       ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map,
                       inter_size=experts.intermediate_size, hidden=experts.hidden_size,
                       **activation_args(activation), TOPK=topk_ids.shape[1], HAS_MAP=expert_map is not None,
                       num_ids=experts.num_experts if expert_map is None else expert_map.numel(),
                       num_local=experts.num_experts, PDL=False)


def stage1_split(experts: TritonExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None, activation: ActivationSpec, cfg: KernelConfig,
                 decode: str, out_order: int) -> tuple[torch.Tensor, Launch]:
    """The tensor-core stage 1 with K in cfg.k_split parts (_details/split_kernels.py); `hidden` as the
    layer gives it; inter comes out in `out_order` (the kernel's OUT_ORDER: what stage 2 reads)."""
    inter, args = _pair_args(experts, hidden, topk_ids, expert_map, activation, decode)
    grid = (topk_ids.numel(), cdiv(experts.intermediate_size, cfg.block_n), cfg.k_split)
    slots = grid[0] * grid[1]
    parts = torch.empty(slots * cfg.k_split * 2 * cfg.block_n if cfg.k_split > 1 else 1, dtype=torch.float32,
                        device=hidden.device)
    args.update(part_ptr=parts, ticket_ptr=tickets(hidden.device, slots), BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, K_SPLIT=cfg.k_split, OUT_ORDER=out_order)
    return inter, Launch(stage1_split_kernel, grid, args, cfg.num_warps, cfg.num_stages, "stage1.split")


def stage1_gemv(experts: TritonExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor | None, activation: ActivationSpec, cfg: KernelConfig,
                decode: str, out_block_k: int) -> tuple[torch.Tensor, Launch]:
    """`hidden` as the layer gives it (row-major, any float dtype); inter comes out in word order of
    out_block_k."""
    num_pairs = topk_ids.numel()
    topk = topk_ids.shape[1]
    inter_size = experts.intermediate_size
    inter = torch.empty(num_pairs, inter_size, dtype=torch.bfloat16, device=hidden.device)
    ids = topk_ids.reshape(-1)
    args = dict(x_ptr=hidden, stride_xm=hidden.stride(0), **weight_args(experts, "w13", decode),
                inter_ptr=inter, stride_im=inter.stride(0),
                ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map,
                inter_size=inter_size, hidden=experts.hidden_size, **activation_args(activation),
                TOPK=topk, HAS_MAP=expert_map is not None,
                num_ids=experts.num_experts if expert_map is None else expert_map.numel(),
                num_local=experts.num_experts,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OUT_BLOCK_K=out_block_k,
                AHEAD=gemv_ahead(cfg), PDL=False)
    grid = (num_pairs, cdiv(inter_size, cfg.block_n))
    return inter, Launch(stage1_gemv_kernel, grid, args, cfg.num_warps, cfg.num_stages, "stage1.gemv")
