"""The whole routed-expert MoE for one chunk of tokens, as a list of launches."""
from __future__ import annotations

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.common.alignment import align_launches, direct_pairs
from kimi_k3_moe.kernels.common.launch import Launch, chain_dependents
from kimi_k3_moe.kernels.triton.korder import stage1_args
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.stage1 import pair_order, stage1_aligned, stage1_gemv, stage1_split, word_order
from kimi_k3_moe.kernels.triton.stage2 import gemv_block_k, stage2_aligned, stage2_gemv
from kimi_k3_moe.kernels.triton.table import KOrder, MoEConfig


def plan_moe(experts: TritonExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None,
             out: torch.Tensor, config: MoEConfig) -> list[Launch]:
    """Launches computing `out` ([T, H], written in full) in order; buffers are allocated here.
    With config.pdl each launch after the first is a programmatic dependent of the one before."""
    config.validate(experts.hidden_size, experts.intermediate_size)
    launches = _launches(experts, hidden, topk_weights, topk_ids, activation, expert_map, out, config)
    return chain_dependents(launches) if config.pdl else launches


def _launches(experts, hidden, topk_weights, topk_ids, activation, expert_map, out, config) -> list[Launch]:
    s1_cfg, s2_cfg = config.stage1, config.stage2
    if config.path in ("gemv", "split"):  # two launches: stage 1 reads hidden as it is, stage 2 inter in word order
        s2_block_k = gemv_block_k(s2_cfg, topk_ids.shape[1], experts.intermediate_size, expert_map)
        stage1 = stage1_gemv if config.path == "gemv" else stage1_split
        inter, s1 = stage1(experts, hidden, topk_ids, expert_map, activation, s1_cfg, config.decode,
                           s2_block_k)  # stage 2 reads inter in that word order
        return [s1, *stage2_gemv(experts, inter, topk_ids, topk_weights, expert_map, out,
                                 s2_cfg, config.decode, s2_block_k)]
    bm1, bm2 = config.block_ms
    if config.path == "direct":
        pairs = pairs2 = direct_pairs(topk_ids, expert_map, bm1, experts.num_experts)
        if s1_cfg.k_split > 1:  # the split stage 1 writes inter as the direct stage 2 reads it
            inter, s1 = stage1_split(experts, hidden, topk_ids, expert_map, activation, s1_cfg, config.decode,
                                     stage1_args(s1_cfg, s2_cfg)["OUT_ORDER"])
            return [s1, *stage2_aligned(experts, inter, pairs2, topk_weights, out, s2_cfg, config.decode)]
        launches = []
    else:  # stage 2 may take row blocks of its own over the same pairs (inter is stored per pair)
        block_ms = (bm1,) if bm2 == bm1 else (bm1, bm2)
        (pairs, *rest), launches = align_launches(topk_ids, expert_map, experts.num_experts, block_ms)
        pairs2 = rest[0] if rest else pairs
    x = hidden
    stored = s1_cfg.order.stored_order  # stage 1 reads hidden from memory in that order
    if stored == KOrder.PAIRS:
        x, permute = pair_order(hidden)
        launches.append(permute)
    elif stored == KOrder.WORDS:
        x, permute = word_order(hidden, s1_cfg.block_k)
        launches.append(permute)
    inter, s1 = stage1_aligned(experts, x, pairs, topk_ids.shape[1], activation, s1_cfg, config.decode, s2_cfg)
    return [*launches, s1, *stage2_aligned(experts, inter, pairs2, topk_weights, out, s2_cfg, config.decode)]
