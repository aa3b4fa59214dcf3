"""The whole routed-expert MoE for one chunk of tokens, as a list of launches."""
from __future__ import annotations

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs.triton_table import MoEConfig
from kimi_k3_moe.kernels.triton.alignment import align_launches
from kimi_k3_moe.kernels.triton.launch import Launch
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.stage1 import stage1_aligned, stage1_gemv
from kimi_k3_moe.kernels.triton.stage2 import stage2_aligned, stage2_gemv


def plan_moe(experts: TritonExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None,
             out: torch.Tensor, config: MoEConfig) -> list[Launch]:
    """Launches computing `out` ([T, H], written in full) in order; buffers are allocated here."""
    config.validate(experts.hidden_size, experts.intermediate_size)
    if config.path == "gemv":
        inter, s1 = stage1_gemv(experts, hidden, topk_ids, expert_map, activation, config.stage1, config.decode)
        return [s1, *stage2_gemv(experts, inter, topk_ids, topk_weights, expert_map, out,
                                 config.stage2, config.decode)]
    pairs, align = align_launches(topk_ids, expert_map, experts.num_experts, config.block_m)
    inter, s1 = stage1_aligned(experts, hidden, pairs, topk_ids.shape[1], activation,
                               config.stage1, config.decode)
    return [*align, s1, *stage2_aligned(experts, inter, pairs, topk_weights, out,
                                        config.stage2, config.decode)]
