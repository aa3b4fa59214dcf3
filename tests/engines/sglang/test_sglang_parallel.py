"""TP and EP ranks, each built as SGLang builds it (published topology per rank).

SGLang's loader narrows I for TP and keeps this rank's experts for EP; the
standard dispatcher hands our method local expert ids with -1 for experts
held elsewhere. Summing the ranks' partial outputs (what K3's latent
all-reduce does in a server) must give the whole layer.
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU
from sglang_k3 import (
    EXPERTS,
    INTER,
    LATENT,
    MOE_LAYERS,
    build_block,
    config_of,
    cpu_device_for_ep_dispatch,
    k3_topk,
    load_into,
    reference_experts,
    serving,
    tp_group_stand_in,
)

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.reference import moe_forward, relative_l2

LAYER = MOE_LAYERS[0]
TOKENS = 9


def routing_and_input(path, config, gen):
    """Routing by the block's real gate and TopK (replicated across ranks), latent input."""
    with serving(path):
        block = build_block(config, LAYER)
        load_into({LAYER: block}, path)
        x = torch.randn(TOKENS, config["text_config"]["hidden_size"], generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            topk = k3_topk(block, x)
    routed_input = torch.randn(TOKENS, LATENT, generator=gen).to(torch.bfloat16)
    return topk, routed_input


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_hold_their_slice_and_partials_sum_to_the_layer(tp, k3_checkpoint_4d_scales,
                                                                   sglang_plugins_loaded, gen):
    path, config = k3_checkpoint_4d_scales, config_of(k3_checkpoint_4d_scales)
    topk, x = routing_and_input(path, config, gen)
    whole = moe_forward(x.double(), *reference_experts(path, LAYER).tensors(), topk.topk_weights,
                        topk.topk_ids, SITU, compute_dtype=torch.float64)
    total = torch.zeros_like(whole)
    for rank in range(tp):
        with serving(path, tp_size=tp, rank=rank):
            block = build_block(config, LAYER)
            experts = block.experts
            assert (experts.moe_tp_rank, experts.intermediate_size_per_partition) == (rank, INTER // tp)
            load_into({LAYER: block}, path)
            mine = reference_experts(path, LAYER, tp_rank=rank, tp_size=tp)
            assert torch.equal(experts.w13_weight, mine.w13_packed)
            assert torch.equal(experts.w13_weight_scale, mine.w13_scale)
            assert torch.equal(experts.w2_weight, mine.w2_packed)
            assert torch.equal(experts.w2_weight_scale, mine.w2_scale)
            with torch.inference_mode(), tp_group_stand_in():
                part = experts(x, topk)
            assert relative_l2(part, moe_forward(x.double(), *mine.tensors(), topk.topk_weights, topk.topk_ids,
                                                 SITU, compute_dtype=torch.float64)) <= 1e-2
            total += part.double()
    assert relative_l2(total, whole) <= 1e-2


def test_ep_ranks_skip_remote_experts_and_partials_sum_to_the_layer(k3_checkpoint, k3_config, sglang_plugins_loaded,
                                                                  gen):
    path, config = k3_checkpoint, k3_config
    ep = 4
    topk, x = routing_and_input(path, config, gen)
    whole = moe_forward(x.double(), *reference_experts(path, LAYER).tensors(), topk.topk_weights,
                        topk.topk_ids, SITU, compute_dtype=torch.float64)
    total = torch.zeros_like(whole)
    per_rank = EXPERTS // ep
    for rank in range(ep):
        with serving(path, tp_size=ep, ep_size=ep, rank=rank):
            block = build_block(config, LAYER)
            experts = block.experts
            assert (experts.moe_ep_rank, experts.num_local_experts) == (rank, per_rank)
            load_into({LAYER: block}, path)
            owned = list(range(rank * per_rank, (rank + 1) * per_rank))
            mine = reference_experts(path, LAYER, experts=owned)
            assert torch.equal(experts.w13_weight, mine.w13_packed)
            assert torch.equal(experts.w2_weight_scale, mine.w2_scale)
            with torch.inference_mode(), cpu_device_for_ep_dispatch(), tp_group_stand_in():
                dispatched = experts.dispatcher.dispatch(hidden_states=x, topk_output=topk)
                local_ids = dispatched.topk_output.topk_ids
                assert (local_ids == -1).any() and local_ids.max() < per_rank
                part = experts(x, topk)
            total += part.double()
    assert relative_l2(total, whole) <= 1e-2


def test_dp_attention_ranks_serve_their_slice_and_partials_sum_to_the_layer(k3_checkpoint_4d_scales,
                                                                          sglang_plugins_loaded, gen):
    """`--tp 2 --dp 2 --enable-dp-attention --moe-a2a-backend none`: attention is data-parallel, the MoE
    stays tensor-parallel over both ranks and sees the tokens SGLang gathered from the DP ranks through
    its standard dispatcher; the plugin serves each rank's slice. (The gather itself is SGLang's, run by the
    model's communicator; rank by rank here, as in the TP test.)"""
    path, config = k3_checkpoint_4d_scales, config_of(k3_checkpoint_4d_scales)
    topk, x = routing_and_input(path, config, gen)
    whole = moe_forward(x.double(), *reference_experts(path, LAYER).tensors(), topk.topk_weights,
                        topk.topk_ids, SITU, compute_dtype=torch.float64)
    total = torch.zeros_like(whole)
    for rank in range(2):
        with serving(path, tp_size=2, rank=rank, dp_size=2, enable_dp_attention=True):
            from sglang.srt.layers.moe.utils import get_moe_a2a_backend

            assert get_moe_a2a_backend().is_none()
            block = build_block(config, LAYER)
            experts = block.experts
            assert type(experts.quant_method).__name__ == "K3RoutedExpertsMethod"
            assert (experts.moe_tp_rank, experts.intermediate_size_per_partition) == (rank, INTER // 2)
            load_into({LAYER: block}, path)
            with torch.inference_mode(), tp_group_stand_in():
                total += experts(x, topk).double()
    assert relative_l2(total, whole) <= 1e-2
    silu = moe_forward(x.double(), *reference_experts(path, LAYER).tensors(), topk.topk_weights, topk.topk_ids,
                       ActivationSpec.silu(), compute_dtype=torch.float64)
    assert relative_l2(total, silu) > 5e-2
