"""The gfx942 load path (int4 experts), run here by telling the method it is on an MI300X.

Only the platform is a stand-in: this box has no AMD GPU, so
`detect_platform` is replaced to report gfx942. The FlyDSL and Triton
backends of gfx942's plan cannot run here and are skipped with their
reasons; the plan's last member, the torch backend on int4, serves. What
this shows is the lookup and hand-over logic (pre-converted checkpoint found
and used, or MXFP4 converted at load; parameters released), not kernels on
AMD hardware.
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.platform import Platform

MI300X = Platform("rocm", "gfx942", "AMD Instinct MI300X (stand-in)")


@pytest.fixture
def on_gfx942(monkeypatch):
    from kimi_k3_moe.plugin_entrypoints import _vllm_method

    monkeypatch.setattr(_vllm_method, "detect_platform", lambda: MI300X)
    monkeypatch.delenv("KIMI_K3_MOE_BACKEND", raising=False)
    monkeypatch.delenv("KIMI_K3_MOE_CONVERTED", raising=False)


def _serve(checkpoint, seed):
    import vllm_k3 as k3

    config = k3.make_vllm_config(checkpoint)
    block = k3.build_block(config)
    k3.load_block(block, config, checkpoint)
    k3.process_after_loading(block, config)
    layer = k3.routed_layer(block)
    recorder = k3.ApplyRecorder(layer.quant_method)
    x = torch.randn(6, k3.HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    k3.forward(block, config, x)
    return layer, recorder.calls[0]


def _check_against_reference(prepared, call):
    from kimi_k3_moe.reference import dense_moe, relative_l2

    def ref(activation):
        return dense_moe(call["x"].double(), lambda e: prepared.dequantize(e)[0].double(),
                         lambda e: prepared.dequantize(e)[1].double(), call["topk_weights"], call["topk_ids"],
                         activation, compute_dtype=torch.float64)

    assert relative_l2(call["out"], ref(SITU)) <= 1e-2
    assert relative_l2(call["out"], ref(ActivationSpec.silu())) > 5e-2


def test_preconverted_int4_checkpoint_is_used(single_rank, on_gfx942, tmp_path, seed, monkeypatch):
    import vllm_k3 as k3

    from kimi_k3_moe.weights import requant
    from kimi_k3_moe.weights.convert_run import convert_checkpoint
    from kimi_k3_moe.weights.converted import CONVERTED_DIRNAME

    checkpoint = k3.write_checkpoint(tmp_path / "model", seed)
    found = convert_checkpoint(checkpoint, checkpoint / CONVERTED_DIRNAME, target="gfx942", tp_size=1,
                               progress=False, log=lambda line: None)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the experts were converted again instead of read from the converted checkpoint")

    monkeypatch.setattr(requant, "requantize_experts", no_conversion)
    layer, call = _serve(checkpoint, seed)
    routed = layer.quant_method.routed
    assert routed.backend.describe() == f"torch[int4/{found.method}]"
    on_disk = found.load_layer(k3.LAYER, 0)
    assert torch.equal(routed.prepared.w13.packed, on_disk.w13.packed)
    assert torch.equal(routed.prepared.w2.scales, on_disk.w2.scales)
    assert layer.w13_weight.numel() == layer.w2_weight_scale.numel() == 0  # MXFP4 released
    _check_against_reference(routed.prepared, call)


def test_without_one_the_mxfp4_experts_are_converted_at_load(single_rank, on_gfx942, tmp_path, seed):
    import vllm_k3 as k3

    from kimi_k3_moe.formats import int4

    layer, call = _serve(k3.write_checkpoint(tmp_path / "model", seed), seed)
    routed = layer.quant_method.routed
    assert routed.backend.describe() == f"torch[int4/{int4.DEFAULT_METHOD}]"
    assert layer.w13_weight.numel() == 0
    _check_against_reference(routed.prepared, call)


def test_a_converted_folder_named_but_missing_stops_the_load(single_rank, on_gfx942, tmp_path, seed,
                                                             monkeypatch):
    import vllm_k3 as k3

    from kimi_k3_moe.weights.converted import ConvertedCheckpointError

    monkeypatch.setenv("KIMI_K3_MOE_CONVERTED", str(tmp_path / "nowhere"))
    with pytest.raises(ConvertedCheckpointError, match="nowhere does not exist"):
        _serve(k3.write_checkpoint(tmp_path / "model", seed), seed)
