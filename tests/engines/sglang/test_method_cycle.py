"""Our MoE method's whole cycle inside SGLang's real Kimi-K3 MoE block, on CPU.

Build (SGLang's KimiK3MoE picks Mxfp4Config, the plugin hook picks our method)
-> create_weights -> K3's load_weights + FusedMoE.weight_loader on a synthetic
K3 checkpoint -> DefaultModelLoader.postprocess_weights -> FusedMoE.forward /
KimiK3MoE.forward, compared with our float64 reference over the experts read
by our own checkpoint reader.
"""
from __future__ import annotations

import logging

import pytest
import torch
from moe_helpers import SITU
from sglang_k3 import (
    INTER,
    LATENT,
    MOE_LAYERS,
    build_block,
    k3_topk,
    load_into,
    reference_experts,
    serving,
    tp_group_stand_in,
)

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.plugin_entrypoints import common
from kimi_k3_moe.reference import moe_forward, relative_l2

SILU = ActivationSpec.silu()
TOKENS = 7
BOUND = 1e-2  # bf16 activations and hand-off against float64; a wrong activation lands near 0.3


def test_k3_block_gets_our_method_with_sglang_parameter_contract(k3_checkpoint, k3_config, sglang_plugins_loaded):
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    from kimi_k3_moe.plugin_entrypoints._sglang_method import K3RoutedExpertsMethod

    path, config = k3_checkpoint, k3_config
    with serving(path):
        block = build_block(config, MOE_LAYERS[0])
    experts = block.experts
    assert type(experts.quant_config).__name__ == "Mxfp4Config"  # K3 swapped it in itself
    assert isinstance(experts.quant_method, K3RoutedExpertsMethod)
    assert experts.quant_method.activation == SITU
    assert experts.runner_backend is None and experts.runner is None
    assert block.topk.topk_config.output_format == TopKOutputFormat.STANDARD
    assert type(experts.dispatcher).__name__ == "StandardDispatcher"
    e = experts.num_local_experts
    expected = {"w13_weight": (e, 2 * INTER, LATENT // 2), "w13_weight_scale": (e, 2 * INTER, LATENT // 32),
                "w2_weight": (e, LATENT, INTER // 2), "w2_weight_scale": (e, LATENT, INTER // 32)}
    params = dict(experts.named_parameters())
    assert {n: tuple(p.shape) for n, p in params.items()} == expected
    for name, param in params.items():
        assert param.dtype == torch.uint8 and not param.requires_grad
        assert param.weight_loader.__func__ is type(experts).weight_loader
        assert getattr(param, "quant_method", None) == ("group" if "scale" in name else None)


def test_full_cycle_matches_float64_reference(k3_checkpoint, k3_config, sglang_plugins_loaded, gen, caplog):
    path, config = k3_checkpoint, k3_config
    common._logged.clear()
    with serving(path):
        blocks = {layer: build_block(config, layer) for layer in MOE_LAYERS}
        with caplog.at_level(logging.INFO, logger="kimi_k3_moe"):
            load_into(blocks, path)
        serving_lines = [r.getMessage() for r in caplog.records if "serving Kimi-K3" in r.getMessage()]
        assert len(serving_lines) == 1, serving_lines  # two MoE layers, one line per process
        assert "in sglang: backend torch[mxfp4], activation situv2(beta=4, linear_beta=25.0)" in serving_lines[0]

        for layer, block in blocks.items():
            ours = reference_experts(path, layer)
            experts = block.experts
            # K3's loader put the checkpoint's bytes where our method expects them.
            assert torch.equal(experts.w13_weight, ours.w13_packed)
            assert torch.equal(experts.w13_weight_scale, ours.w13_scale)
            assert torch.equal(experts.w2_weight, ours.w2_packed)
            assert torch.equal(experts.w2_weight_scale, ours.w2_scale)

            x = torch.randn(TOKENS, config["text_config"]["hidden_size"], generator=gen).to(torch.bfloat16)
            with torch.inference_mode(), tp_group_stand_in():
                topk = k3_topk(block, x)
                routed_input, _ = block.routed_expert_down_proj(x)
                got = experts(routed_input, topk)  # FusedMoE.forward -> dispatch -> our apply -> combine
                block_out = block(x)               # KimiK3MoE.forward, unfused front on CPU
                shared = block.shared_experts(x)
            assert got.dtype == torch.bfloat16 and got.shape == (TOKENS, LATENT)

            want = moe_forward(routed_input.double(), *ours.tensors(), topk.topk_weights, topk.topk_ids, SITU,
                               compute_dtype=torch.float64)
            silu = moe_forward(routed_input.double(), *ours.tensors(), topk.topk_weights, topk.topk_ids, SILU,
                               compute_dtype=torch.float64)
            err, off = relative_l2(got, want), relative_l2(got, silu)
            print(f"layer {layer}: relative L2 vs SiTUv2 reference {err:.2e}, vs SiLU {off:.2e}")
            assert err <= BOUND
            assert off > 10 * BOUND  # the activation really is SiTUv2

            # The block: latent norm and up-projection of our partial sum, plus the shared experts.
            with torch.inference_mode():
                latent = block.routed_expert_norm(want.to(torch.bfloat16))
                expected = block.routed_expert_up_proj(latent)[0].double() + shared.double()
            block_err = relative_l2(block_out, expected)
            print(f"layer {layer}: KimiK3MoE.forward vs block over the reference experts {block_err:.2e}")
            assert block_err <= BOUND


def test_empty_batch(k3_checkpoint, k3_config, sglang_plugins_loaded):
    """Idle ranks still enter the MoE with zero rows."""
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput, StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    path, config = k3_checkpoint, k3_config
    with serving(path):
        block = build_block(config, MOE_LAYERS[0])
        load_into({MOE_LAYERS[0]: block}, path)
    empty = StandardDispatchOutput(
        hidden_states=torch.empty(0, LATENT, dtype=torch.bfloat16), hidden_states_scale=None,
        topk_output=StandardTopKOutput(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.int32),
                                       torch.empty(0, 16)))
    out = block.experts.quant_method.apply(layer=block.experts, dispatch_output=empty)
    assert isinstance(out, StandardCombineInput) and out.hidden_states.shape == (0, LATENT)


def test_process_weights_twice_is_harmless(k3_checkpoint, k3_config, sglang_plugins_loaded, gen):
    """SGLang's overlap loader runs process_weights_after_loading more than once."""
    path, config = k3_checkpoint, k3_config
    with serving(path):
        block = build_block(config, MOE_LAYERS[0])
        load_into({MOE_LAYERS[0]: block}, path)
        method = block.experts.quant_method
        first = method.routed
        method.process_weights_after_loading(block.experts)
        assert method.routed is not first and method.routed.backend.name == "torch"
        x = torch.randn(5, LATENT, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(5)]).to(torch.int32)
        w = torch.rand(5, 4, generator=gen)
        assert relative_l2(first(x, w, ids), method.routed(x, w, ids)) == 0


def test_torch_fallback_refuses_cuda_graph_capture_with_a_clear_error(k3_checkpoint, k3_config, sglang_plugins_loaded,
                                                                       monkeypatch):
    """No GPU here: the capture state is stood in for by patching torch.cuda's two queries."""
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from kimi_k3_moe.plugin_entrypoints._sglang_method import UnsupportedSGLangSetup

    path, config = k3_checkpoint, k3_config
    with serving(path):
        block = build_block(config, MOE_LAYERS[0])
        load_into({MOE_LAYERS[0]: block}, path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    batch = StandardDispatchOutput(torch.zeros(2, LATENT, dtype=torch.bfloat16), None, StandardTopKOutput(
        torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 16)))
    with pytest.raises(UnsupportedSGLangSetup, match="--disable-cuda-graph"):
        block.experts.quant_method.apply(layer=block.experts, dispatch_output=batch)
