"""The "flydsl" backend object on a machine without an AMD GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fly_helpers import SITU, random_layer, with_offsets

from k3lab.flydsl import emulator
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import plan_backends
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.kernels import BackendUnavailable, get_backend
from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
from kimi_k3_moe.kernels.flydsl.experts import FlyDSLExperts
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.platform import Platform
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check
from kimi_k3_moe.weights.requant import requantize_experts


def test_importing_the_backend_does_not_import_flydsl():
    code = ("import sys, kimi_k3_moe.kernels.flydsl.backend, k3lab.flydsl.emulator, "
            "kimi_k3_moe.kernels.flydsl.build, k3lab.flydsl.sweep; "
            "from kimi_k3_moe.kernels import get_backend; b = get_backend('flydsl', arch='gfx942'); b.describe(); "
            "print(sorted(m for m in sys.modules if m == 'flydsl' or m.startswith('flydsl.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])   # k3lab sits at the repository root
    assert out.stdout.strip() == "[]"


def test_available_says_why_not_here():
    ok, why = get_backend("flydsl", arch="gfx942").available()
    assert not ok and ("flydsl" in why or "ROCm" in why or "AMD GPU" in why), why


def test_without_arch_and_without_gpu_it_says_so():
    backend = get_backend("flydsl")
    assert backend.arch is None and "no AMD GPU" in backend.describe()
    assert not backend.available()[0]
    with pytest.raises(BackendUnavailable, match="no AMD GPU"):
        backend.prepare(random_layer(torch.Generator().manual_seed(0), experts=1))


def test_dispatch_plans_flydsl_first_with_options_the_backend_accepts():
    for arch, weight_format in (("gfx942", "int4"), ("gfx950", "mxfp4")):
        plan = plan_backends(Platform("rocm", arch, "test"), env={})
        assert [c.name for c in plan][:2] == ["flydsl", "triton"]
        backend = plan[0].make()
        assert (backend.arch, backend.weight_format) == (arch, weight_format)


def test_gfx942_prepares_int4_and_dequantizes_what_it_encodes(gen):
    layer = random_layer(gen, experts=3, hidden=256, inter=128)
    backend = get_backend("flydsl", arch="gfx942", weight_format="int4")
    prepared = prepare_for(backend, layer)
    expected = requantize_experts(layer, progress=False)
    assert prepared.weight_format == "int4" and not prepared.has_offsets
    for e in range(3):
        w13, w2 = backend.dequantize_prepared(prepared, e)
        assert w13.dtype == w2.dtype == torch.float32
        assert tuple(w13.shape) == (256, 256) and tuple(w2.shape) == (256, 128)
        assert torch.equal(w13, expected.dequantize(e)[0]) and torch.equal(w2, expected.dequantize(e)[1])


def test_gfx942_takes_already_converted_int4_with_offsets(gen):
    int4 = with_offsets(gen, requantize_experts(random_layer(gen, experts=2), progress=False))
    prepared = get_backend("flydsl", arch="gfx942").prepare(int4)
    assert prepared.has_offsets
    w13, _ = prepared.dequantize(1)
    assert torch.equal(w13, int4.w13[1].dequantize())            # value = code * scale + offset
    assert not torch.equal(w13, replace_offsets_none(int4).w13[1].dequantize())


def replace_offsets_none(int4):
    from kimi_k3_moe.experts import Int4Experts
    from kimi_k3_moe.formats.int4 import Int4Weights
    return Int4Experts(Int4Weights(int4.w13.packed, int4.w13.scales), Int4Weights(int4.w2.packed, int4.w2.scales))


def test_gfx950_keeps_mxfp4(gen):
    layer = random_layer(gen, experts=2)
    prepared = get_backend("flydsl", arch="gfx950").prepare(layer)
    assert prepared.weight_format == "mxfp4" and torch.equal(prepared.w13, layer.w13_packed)
    assert torch.equal(prepared.dequantize(1)[1], mxfp4.dequantize(layer.w2_packed[1], layer.w2_scale[1]))


def test_wrong_format_and_nan_scales_are_refused_by_name(gen):
    layer = random_layer(gen, experts=2)
    with pytest.raises(ValueError, match="weight_format 'mxfp4' not in"):
        get_backend("flydsl", arch="gfx942", weight_format="mxfp4")
    with pytest.raises(ValueError, match="runs mxfp4 weights; got int4"):
        get_backend("flydsl", arch="gfx950").prepare(requantize_experts(layer, progress=False))
    layer.w2_scale[0, 0, 0] = 255
    with pytest.raises(ValueError, match="w2_scale holds 1 NaN"):
        get_backend("flydsl", arch="gfx950").prepare(layer)


def test_a_layer_shape_the_kernels_cannot_tile_is_unavailable_not_an_error(gen):
    odd = random_layer(gen, experts=2, hidden=256, inter=96)   # I = 96: stage 2's K is not a multiple of 128
    with pytest.raises(BackendUnavailable, match="cannot serve this layer.*K % 128"):
        get_backend("flydsl", arch="gfx950").prepare(odd)


class EmulatedFlyDSL(FlyDSLBackend):
    """The real backend with `emulator.launch` in place of the GPU launch.

    A stand-in only for what cannot happen here (running FlyDSL code objects on an
    AMD GPU); prepare, the forward pipeline and the self-check are the real ones.
    """

    def available(self):
        return True, "emulated on the CPU"

    def _launch(self, cfg, args):
        emulator.launch(cfg, args)


class SiluOnlyEmulated(EmulatedFlyDSL):
    """A deliberately broken kernel: it ignores the activation it is asked for."""

    def forward(self, prepared, hidden, topk_weights, topk_ids, activation, expert_map=None):
        return super().forward(prepared, hidden, topk_weights, topk_ids, ActivationSpec.silu(), expert_map)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_load_time_self_check_passes_the_emulated_kernels_and_refuses_a_wrong_one(gen, arch):
    layer = random_layer(gen, experts=4, hidden=256, inter=128)
    err = run_self_check(EmulatedFlyDSL(arch=arch), layer, SITU, num_tokens=11)
    assert err < 1.5e-2
    with pytest.raises(SelfCheckFailed, match="relative L2"):
        run_self_check(SiluOnlyEmulated(arch=arch), layer, SITU, num_tokens=11)


def test_forward_here_refuses_with_the_reason(gen):
    backend = get_backend("flydsl", arch="gfx950")
    prepared = backend.prepare(random_layer(gen, experts=2))
    x = torch.zeros(1, prepared.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="cannot run here"):
        backend.forward(prepared, x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), SITU)


def test_prepared_form_rejects_inconsistent_tensors(gen):
    layer = random_layer(gen, experts=2)
    with pytest.raises(ValueError, match="w13_scale"):
        FlyDSLExperts("mxfp4", layer.w13_packed, layer.w13_scale[:, :, :-1].contiguous(),
                      layer.w2_packed, layer.w2_scale)


# ------------------------------------------------------------------ quantized activations
@pytest.mark.parametrize("act_dtype", ["fp8", "fp4"])
def test_self_check_passes_emulated_quantized_kernels_and_refuses_a_wrong_one(gen, act_dtype):
    layer = random_layer(gen, experts=4, hidden=256, inter=128)
    backend = EmulatedFlyDSL(arch="gfx950", act_dtype=act_dtype)
    assert backend.act_quant.dtype == act_dtype
    err = run_self_check(backend, layer, SITU, num_tokens=11)
    assert err < 1.5e-2
    with pytest.raises(SelfCheckFailed, match=f"activations {act_dtype}.*relative L2"):
        run_self_check(SiluOnlyEmulated(arch="gfx950", act_dtype=act_dtype), layer, SITU, num_tokens=11)


def test_gfx942_refuses_quantized_activations_when_the_backend_is_made():
    """Refused with a message at get_backend time, before anything could reach LLVM (which would abort)."""
    for act in ("fp8", "fp4"):
        with pytest.raises(ValueError, match=f"act_dtype='{act}'.*gfx942.*supported there: bf16"):
            get_backend("flydsl", arch="gfx942", act_dtype=act)
    plan = plan_backends(Platform("rocm", "gfx950", "test"), env={"KIMI_K3_MOE_ACT_DTYPE": "fp4"})
    backend = plan[0].make()
    assert backend.act_quant.dtype == "fp4" and "a4" in backend.describe()


def test_precompile_list_includes_the_quantizer(gen, monkeypatch):
    backend = EmulatedFlyDSL(arch="gfx950", act_dtype="fp8")
    prepared = backend.prepare(random_layer(gen, experts=2))
    monkeypatch.setattr(backend, "_compiled_for", lambda cfg: None)
    names = backend.precompile(prepared, SITU, top_k=2)
    assert names[0] == "k3moe_q_gfx950_fp8_w4" and all("_a8_" in n for n in names[1:])
