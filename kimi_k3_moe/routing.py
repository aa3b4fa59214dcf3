"""Kimi-K3's router: sigmoid scores, noaux_tc selection on score + bias.

Selection uses the bias-corrected scores; the weights handed to the experts
come from the unbiased sigmoid scores. Ties always go to the lower expert id.
"""
from __future__ import annotations

import torch


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    # torch.topk does not promise which of two equal values it keeps.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]).

    With several groups, a group's score is the sum of its two best biased
    scores (DeepSeek-V3's noaux_tc); only the `topk_group` best groups compete.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group {num_expert_group} must divide num_experts {num_experts}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group {topk_group} must be in [1, {num_expert_group}]")
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias shape {tuple(correction_bias.shape)} != ({num_experts},)")

    scores = torch.sigmoid(router_logits.float())
    biased = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        per_group = num_experts // num_expert_group
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * per_group} experts "
                             "of the selected groups")
        grouped = biased.view(num_tokens, num_expert_group, per_group)
        best_two = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, per_group)]
        keep_groups = _stable_topk(best_two.sum(-1), topk_group)
        group_mask = torch.zeros(num_tokens, num_expert_group, dtype=torch.bool, device=scores.device)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask.repeat_interleave(per_group, dim=1)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    topk_ids = _stable_topk(biased, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)
