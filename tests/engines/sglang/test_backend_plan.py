"""process_weights_after_loading goes through the core's backend plan and self-check,
and the layer never keeps two copies of its experts.

On this CPU box the plan is [torch]; GPU plans are covered by tests/core. To
reach the self-check and the release path here, two tests replace the plan
with a deliberately wrong kernel or with the torch backend's int4 form.
"""
from __future__ import annotations

import logging

import pytest
import torch
from moe_helpers import SITU, broken_plan, random_routing
from sglang_k3 import LATENT, MOE_LAYERS, build_fused_moe, load_into, serving

from kimi_k3_moe import routed_experts
from kimi_k3_moe.dispatch import BackendChoice, plan_backends
from kimi_k3_moe.loading import SelfCheckCache
from kimi_k3_moe.platform import detect_platform
from kimi_k3_moe.reference import dense_moe, relative_l2
from kimi_k3_moe.self_check import SelfCheckFailed

LAYER = MOE_LAYERS[0]


def loaded_layer(path):
    layer = build_fused_moe(hidden=LATENT, layer=LAYER)
    holder = torch.nn.Module()
    holder.experts = layer
    model = load_into({LAYER: holder}, path, experts_only=True)
    return layer, model


def test_plan_is_the_core_plan_and_params_are_the_prepared_weights(k3_checkpoint, sglang_plugins_loaded):
    with serving(k3_checkpoint):
        layer, _ = loaded_layer(k3_checkpoint)
    routed = layer.quant_method.routed
    assert routed.plan == plan_backends(detect_platform()) and routed.backend.describe() == "torch[mxfp4]"
    assert routed.activation == SITU
    # The torch backend reads the loaded MXFP4 bytes in place: one copy, the parameters.
    assert routed.prepared.w13_packed.data_ptr() == layer.w13_weight.data_ptr()
    assert layer.w2_weight_scale.numel() > 0


def test_self_check_refuses_a_wrong_kernel_at_load(k3_checkpoint, sglang_plugins_loaded, monkeypatch, caplog):
    from kimi_k3_moe.plugin_entrypoints._sglang_method import K3RoutedExpertsMethod

    plan = broken_plan("broken on purpose")
    monkeypatch.setattr(routed_experts, "plan_backends", lambda platform: plan)
    monkeypatch.setattr(K3RoutedExpertsMethod, "self_checks", SelfCheckCache())
    monkeypatch.setenv("KIMI_K3_MOE_SELF_CHECK", "strict")
    with serving(k3_checkpoint), pytest.raises(SelfCheckFailed, match="silu-only"):
        loaded_layer(k3_checkpoint)
    monkeypatch.setenv("KIMI_K3_MOE_SELF_CHECK", "fallback")
    with serving(k3_checkpoint), caplog.at_level(logging.ERROR, logger="kimi_k3_moe"):
        layer, _ = loaded_layer(k3_checkpoint)
    assert layer.quant_method.routed.backend.name == "torch"
    assert "REFUSING backend silu-only" in caplog.text


def test_converted_experts_release_the_checkpoint_bytes_and_restore_for_reload(
        k3_checkpoint, sglang_plugins_loaded, monkeypatch, gen):
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.model_loader.loader import DefaultModelLoader

    monkeypatch.setattr(routed_experts, "plan_backends",
                        lambda platform: [BackendChoice("torch", {"weight_format": "int4"}, "converts")])
    path = k3_checkpoint
    with serving(path):
        layer, model = loaded_layer(path)
        e, i = 16, 128
        shapes = {"w13_weight": (e, 2 * i, LATENT // 2), "w13_weight_scale": (e, 2 * i, LATENT // 32),
                  "w2_weight": (e, LATENT, i // 2), "w2_weight_scale": (e, LATENT, i // 32)}
        method = layer.quant_method
        assert all(p.numel() == 0 for p in layer.parameters()), "checkpoint bytes kept beside the int4 copy"

        x = torch.randn(6, LATENT, generator=gen).to(torch.bfloat16)
        weights, ids = random_routing(gen, 6, 16, 4)
        out = method.apply(layer=layer, dispatch_output=StandardDispatchOutput(
            x, None, StandardTopKOutput(weights, ids, torch.zeros(6, 16)))).hidden_states
        prepared, backend = method.routed.prepared, method.routed.backend
        want = dense_moe(x.double(), lambda e: backend.dequantize_prepared(prepared, e)[0],
                         lambda e: backend.dequantize_prepared(prepared, e)[1], weights, ids, SITU,
                         compute_dtype=torch.float64)
        assert relative_l2(out, want) <= 1e-2

        # A weight update: SGLang restores the parameters, loads again, converts again.
        DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
        assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == shapes
        load_into({LAYER: model.language_model.model.layers[LAYER]}, path, experts_only=True)
        assert method.routed is not None and all(p.numel() == 0 for p in layer.parameters())
