"""K3 pads the intermediate size per rank at TP > 1: the padding must contribute nothing."""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.platform import Platform
from kimi_k3_moe.reference import relative_l2
from kimi_k3_moe.routed_experts import RoutedExperts

H, I, PADDED, E = 64, 32, 128, 3


def _experts(gen):
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 2
    w2 = torch.randn(E, H, I, generator=gen) * 0.3
    return Mxfp4Experts(*mxfp4.quantize(w13), *mxfp4.quantize(w2))


def _padded(experts):
    """As vLLM leaves a padded layer: zero-initialised parameters, real rows/columns loaded."""
    w13p = torch.zeros(E, 2 * PADDED, H // 2, dtype=torch.uint8)
    w13s = torch.zeros(E, 2 * PADDED, H // 32, dtype=torch.uint8)
    w2p = torch.zeros(E, H, PADDED // 2, dtype=torch.uint8)
    w2s = torch.zeros(E, H, PADDED // 32, dtype=torch.uint8)
    for full, src in ((w13p, experts.w13_packed), (w13s, experts.w13_scale)):
        full[:, :I], full[:, PADDED:PADDED + I] = src[:, :I], src[:, I:]
    w2p[:, :, :I // 2], w2s[:, :, :I // 32] = experts.w2_packed, experts.w2_scale
    return Mxfp4Experts(w13p, w13s, w2p, w2s)


@pytest.mark.parametrize("activation", [SITU, ActivationSpec.silu()])
def test_zero_padding_contributes_nothing_and_is_dropped(gen, activation):
    from kimi_k3_moe.plugin_entrypoints._vllm_method import unpad_intermediate

    experts = _experts(gen)
    padded = _padded(experts)
    trimmed = unpad_intermediate(padded, I)
    for ours, original in zip(trimmed.tensors(), experts.tensors()):
        assert torch.equal(ours, original)
    assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for t, p in zip(trimmed.tensors(), padded.tensors()))  # copies: the parameters can go
    x = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (5, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    plan = [BackendChoice("torch", {"weight_format": "mxfp4"})]
    outs = []
    for layer in (experts, padded):
        routed = RoutedExperts(activation, platform=Platform("cpu"), plan=plan, self_check="off")
        routed.load(layer)
        outs.append(routed(x, weights, ids).float())
    # act(0) = 0 for SiTUv2 and SiLU, and zero w2 columns add 0: the same result, up to
    # the fp32 summation order of longer matmuls (and a bf16 rounding it may flip).
    assert relative_l2(outs[1], outs[0]) < 1e-3


def test_padding_that_is_not_whole_blocks_stays(gen):
    from kimi_k3_moe.plugin_entrypoints._vllm_method import unpad_intermediate

    padded = _padded(_experts(gen))
    assert unpad_intermediate(padded, 16) is padded
    assert unpad_intermediate(padded, PADDED) is padded
    assert unpad_intermediate(padded, None) is padded
