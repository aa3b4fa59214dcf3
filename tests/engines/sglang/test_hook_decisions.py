"""Which layers the hook takes, and what it refuses (at model build, never at the first forward).

Layers are SGLang's real FusedMoE, built with the arguments KimiK3MoE passes,
under a published topology whose model config is the synthetic K3 checkpoint.
SGLang options that cannot be published on a CPU box (an all-to-all backend,
a FlashInfer runner) are set through SGLang's own flag-override primitive.
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU
from sglang_k3 import LATENT, MOE_LAYERS, build_fused_moe, load_into, reference_experts, serving, tp_group_stand_in

from kimi_k3_moe.plugin_entrypoints._sglang_method import K3RoutedExpertsMethod, UnsupportedSGLangSetup
from kimi_k3_moe.reference import moe_forward, relative_l2


def test_silu_mxfp4_layer_keeps_sglang_method(k3_checkpoint, sglang_plugins_loaded):
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    with serving(k3_checkpoint):
        layer = build_fused_moe(activation="silu", beta=None, linear_beta=None)
    assert type(layer.quant_method) is Mxfp4MoEMethod


def test_non_moe_layer_gets_sglang_answer(k3_checkpoint, sglang_plugins_loaded):
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    with pytest.raises(NotImplementedError, match="Mxfp4 attention layer"):  # SGLang's own refusal
        Mxfp4Config(is_checkpoint_mxfp4_serialized=True).get_quant_method(torch.nn.Linear(4, 4), "attn")


@pytest.mark.parametrize("beta,linear_beta,says", [
    (1.0, 25.0, r"situv2\(beta=1, linear_beta=25.0\), but the model's config.json says situv2\(beta=4"),
    (4.0, None, r"situv2\(beta=4, linear_beta=None\), but the model's config.json says"),
])
def test_betas_differing_from_the_model_config_are_refused_at_build(beta, linear_beta, says, k3_checkpoint,
                                                                    sglang_plugins_loaded):
    with serving(k3_checkpoint), pytest.raises(ValueError, match=says):
        build_fused_moe(beta=beta, linear_beta=linear_beta)


def test_situ_layer_without_beta_is_refused_not_handed_to_sglang(k3_checkpoint, sglang_plugins_loaded):
    with serving(k3_checkpoint), pytest.raises(UnsupportedSGLangSetup, match="gemm1_alpha=None"):
        build_fused_moe(beta=None)


def test_online_mxfp4_quantisation_of_a_situ_layer_is_refused(k3_checkpoint, sglang_plugins_loaded):
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    with serving(k3_checkpoint), pytest.raises(UnsupportedSGLangSetup, match="is_checkpoint_mxfp4_serialized"):
        build_fused_moe(quant=Mxfp4Config(is_checkpoint_mxfp4_serialized=False))


@pytest.mark.parametrize("flag,value,says", [
    ("a2a_backend", "deepep", "--moe-a2a-backend deepep"),
    ("a2a_backend", "mooncake", "--moe-a2a-backend mooncake"),
    ("a2a_backend", "deepep_v2", "--moe-a2a-backend deepep_v2"),
    ("runner_backend", "flashinfer_mxfp4", "--moe-runner-backend flashinfer_mxfp4"),
    ("runner_backend", "flashinfer_trtllm", "--moe-runner-backend flashinfer_trtllm"),
])
def test_backends_that_bypass_or_reshape_the_method_are_refused(flag, value, says, k3_checkpoint,
                                                                sglang_plugins_loaded):
    from sglang.srt.layers.moe.utils import MoeA2ABackend, MoeRunnerBackend
    from sglang.srt.runtime_context import get_flags

    enum = MoeA2ABackend if flag == "a2a_backend" else MoeRunnerBackend
    with serving(k3_checkpoint), get_flags().moe.override(**{flag: enum(value)}):
        with pytest.raises(UnsupportedSGLangSetup, match=says):
            build_fused_moe()


def test_per_rank_slice_off_the_mxfp4_grid_is_refused(k3_checkpoint, sglang_plugins_loaded):
    with serving(k3_checkpoint, tp_size=8), pytest.raises(UnsupportedSGLangSetup, match="multiples of"):
        build_fused_moe(inter=128)  # 16 per rank


def test_routed_scaling_factor_is_applied(k3_checkpoint, sglang_plugins_loaded, gen):
    """K3 ships 1.0; the factor still must not be dropped (TopK does not fuse it for our method)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    path = k3_checkpoint
    with serving(path):
        layer = build_fused_moe(routed_scaling_factor=2.5, hidden=LATENT, layer=MOE_LAYERS[0])
        assert isinstance(layer.quant_method, K3RoutedExpertsMethod)
        assert not layer.should_fuse_routed_scaling_factor_in_topk
        holder = torch.nn.Module()
        holder.experts = layer
        load_into({MOE_LAYERS[0]: holder}, path, experts_only=True)
        x = torch.randn(6, LATENT, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(6)]).to(torch.int32)
        weights = torch.rand(6, 4, generator=gen)
        with torch.inference_mode(), tp_group_stand_in():
            out = layer(x, StandardTopKOutput(weights, ids, torch.zeros(6, 16)))
    want = 2.5 * moe_forward(x.double(), *reference_experts(path, MOE_LAYERS[0]).tensors(), weights, ids,
                             SITU, compute_dtype=torch.float64)
    assert relative_l2(out, want) <= 1e-2
