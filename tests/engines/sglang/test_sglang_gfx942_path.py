"""The gfx942 load path in SGLang (int4 experts), run here by telling the method it is on an MI300X.

Only the platform is a stand-in, as in the vLLM suite: this box has no AMD
GPU, so `detect_platform` is replaced to report gfx942. The FlyDSL and Triton
backends of gfx942's plan cannot run here and are skipped with their reasons;
the plan's last member, the torch backend on int4, serves. What this shows is
the lookup and hand-over through real SGLang layers and loaders (a
pre-converted checkpoint found and used, or MXFP4 converted at load;
parameters released), not kernels on AMD hardware.
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SILU, SITU, random_routing
from sglang_k3 import LATENT, MOE_LAYERS, build_fused_moe, load_into, serving

from kimi_k3_moe.platform import Platform
from kimi_k3_moe.reference import dense_moe, relative_l2

MI300X = Platform("rocm", "gfx942", "AMD Instinct MI300X (stand-in)")
LAYER = MOE_LAYERS[0]


@pytest.fixture
def on_gfx942(monkeypatch):
    from kimi_k3_moe.plugin_entrypoints import _sglang_method

    monkeypatch.setattr(_sglang_method, "detect_platform", lambda: MI300X)
    monkeypatch.delenv("KIMI_K3_MOE_BACKEND", raising=False)
    monkeypatch.delenv("KIMI_K3_MOE_CONVERTED", raising=False)


def served_layer(path):
    with serving(path):
        layer = build_fused_moe(hidden=LATENT, layer=LAYER)
        holder = torch.nn.Module()
        holder.experts = layer
        load_into({LAYER: holder}, path, experts_only=True)
    return layer


def check_against_reference(layer, gen):
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    prepared = layer.quant_method.routed.prepared
    x = torch.randn(6, LATENT, generator=gen).to(torch.bfloat16)
    weights, ids = random_routing(gen, 6, 16, 4)
    out = layer.quant_method.apply(layer=layer, dispatch_output=StandardDispatchOutput(
        x, None, StandardTopKOutput(weights, ids, torch.zeros(6, 16)))).hidden_states

    def ref(activation):
        return dense_moe(x.double(), lambda e: prepared.dequantize(e)[0].double(),
                         lambda e: prepared.dequantize(e)[1].double(), weights, ids, activation,
                         compute_dtype=torch.float64)

    assert relative_l2(out, ref(SITU)) <= 1e-2
    assert relative_l2(out, ref(SILU)) > 5e-2


def test_preconverted_int4_checkpoint_is_used(k3_checkpoint, sglang_plugins_loaded, on_gfx942, tmp_path,
                                              monkeypatch, gen):
    import shutil

    from kimi_k3_moe.weights import requant
    from kimi_k3_moe.weights.convert_run import convert_checkpoint
    from kimi_k3_moe.weights.converted import CONVERTED_DIRNAME

    path = tmp_path / "model"
    shutil.copytree(k3_checkpoint, path)  # the session checkpoint stays without a converted folder
    found = convert_checkpoint(path, path / CONVERTED_DIRNAME, target="gfx942", tp_size=1, progress=False,
                               log=lambda line: None)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the experts were converted again instead of read from the converted checkpoint")

    monkeypatch.setattr(requant, "requantize_experts", no_conversion)
    layer = served_layer(path)
    routed = layer.quant_method.routed
    assert routed.backend.describe() == f"torch[int4/{found.method}]"
    on_disk = found.load_layer(LAYER, 0)
    assert torch.equal(routed.prepared.w13.packed, on_disk.w13.packed)
    assert torch.equal(routed.prepared.w2.scales, on_disk.w2.scales)
    assert layer.w13_weight.numel() == layer.w2_weight_scale.numel() == 0  # MXFP4 released
    check_against_reference(layer, gen)


def test_without_one_the_mxfp4_experts_are_converted_at_load(k3_checkpoint, sglang_plugins_loaded, on_gfx942,
                                                             gen):
    from kimi_k3_moe.formats import int4

    layer = served_layer(k3_checkpoint)
    assert layer.quant_method.routed.backend.describe() == f"torch[int4/{int4.DEFAULT_METHOD}]"
    assert layer.w13_weight.numel() == 0
    check_against_reference(layer, gen)


def test_a_converted_folder_named_but_missing_stops_the_load(k3_checkpoint, sglang_plugins_loaded, on_gfx942,
                                                            tmp_path, monkeypatch):
    from kimi_k3_moe.weights.converted import ConvertedCheckpointError

    monkeypatch.setenv("KIMI_K3_MOE_CONVERTED", str(tmp_path / "nowhere"))
    with pytest.raises(ConvertedCheckpointError, match="nowhere does not exist"):
        served_layer(k3_checkpoint)
