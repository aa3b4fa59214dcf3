"""Quantized activations: the setting, its plumbing to the backends, and the reference.

Bounds against the float64 reference without activation quantization (the cost
of each variant; derivation in docs/FORMATS.md): three independent roundings
(hidden, then gate/up through stage 1, then the intermediate) of relative RMS at
most ulp/sqrt(12) each, i.e. sqrt(3) * 2^-3/sqrt(12) = 2^-4 for fp8 e4m3 and
sqrt(3) * 2^-1/sqrt(12) = 2^-2 for MXFP4 (e2m1). Measured at these tiny shapes:
fp8 4.5e-2..4.8e-2, fp4 0.21..0.22.
"""
import sys
import types

import pytest
import torch
from moe_helpers import SITU, random_experts, random_routing

from kimi_k3_moe import act_quant, dispatch, kernels
from kimi_k3_moe.act_quant import ENV_ACT_DTYPE, ActQuant, UnsupportedActDtype, resolve_act_dtype
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import ENV_BACKEND, plan_backends
from kimi_k3_moe.formats import fp8, mxfp4
from kimi_k3_moe.kernels import BackendSpec, get_backend
from kimi_k3_moe.kernels.torch.backend import TorchBackend
from kimi_k3_moe.platform import Platform, sm_version
from kimi_k3_moe.reference import moe_forward, relative_l2
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check

BOUND_VS_UNQUANTIZED = {"fp8": 2 ** -4, "fp4": 2 ** -2}


def layer(gen, e=8, h=256, i=128):
    return random_experts(gen, e, h, i)


def routing(gen, t, e, k, h):
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).double()
    weights, ids = random_routing(gen, t, e, k, floor=0.1)
    return x, weights.double(), ids


# ------------------------------------------------------------------ the setting
def test_setting_comes_from_the_argument_then_the_environment_then_bf16():
    assert resolve_act_dtype(None, {}) == "bf16"
    assert resolve_act_dtype(None, {ENV_ACT_DTYPE: "fp4"}) == "fp4"
    assert resolve_act_dtype("fp8", {ENV_ACT_DTYPE: "fp4"}) == "fp8"
    with pytest.raises(ValueError, match=f"{ENV_ACT_DTYPE}='int8'.*bf16.*fp8.*fp4"):
        resolve_act_dtype(None, {ENV_ACT_DTYPE: "int8"})
    with pytest.raises(ValueError, match="act_dtype='e5m2'"):
        resolve_act_dtype("e5m2")


def test_schemes_are_validated_and_named():
    assert ActQuant.for_dtype("fp8") == ActQuant("fp8", "block32", "block32")
    assert [ActQuant(*a).tag() for a in (("bf16",), ("fp8",), ("fp8", "token", "token"), ("fp4",))] == \
        ["bf16", "a8", "a8tok", "a4"]
    with pytest.raises(ValueError, match="MXFP4"):
        ActQuant("fp4", "token")
    with pytest.raises(ValueError, match="scaling 'row'"):
        ActQuant("fp8", "row")


def test_fake_quant_is_the_formats_quantizers():
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.equal(ActQuant().fake_quant(x, "hidden"), x)
    assert torch.equal(ActQuant("fp8").fake_quant(x, "inter"), fp8.dequantize_mx(*fp8.quantize_mx(x)).double())
    assert torch.equal(ActQuant("fp8", "token").fake_quant(x, "hidden"),
                       fp8.dequantize_per_token(*fp8.quantize_per_token(x)).double())
    assert torch.equal(ActQuant("fp4").fake_quant(x, "hidden"),
                       mxfp4.dequantize(*mxfp4.quantize(x.float())).double())


# ------------------------------------------------------------------ backends
def test_get_backend_takes_the_keyword_and_the_environment(monkeypatch):
    assert get_backend("torch").act_quant == ActQuant()
    assert get_backend("torch", act_dtype="fp4").act_quant == ActQuant("fp4")
    monkeypatch.setenv(ENV_ACT_DTYPE, "fp8")
    backend = get_backend("torch")
    assert backend.act_quant == ActQuant("fp8") and "a8 emulated" in backend.describe()
    assert get_backend("torch", act_dtype="bf16").act_quant == ActQuant()


@pytest.mark.parametrize("arch, act, ok", [("gfx950", "fp8", True), ("gfx950", "fp4", True),
                                           ("gfx942", "fp8", False), ("gfx942", "fp4", False)])
def test_flydsl_declares_scaled_mfma_activations_on_gfx950_only(arch, act, ok):
    if ok:
        backend = get_backend("flydsl", arch=arch, act_dtype=act)
        assert backend.act_quant == ActQuant.for_dtype(act) and act_quant.ActQuant.for_dtype(act).tag() in \
            backend.describe()
        return
    with pytest.raises(UnsupportedActDtype, match=rf"act_dtype='{act}'.*flydsl.*{arch}.*supported there: bf16$"):
        get_backend("flydsl", arch=arch, act_dtype=act)


def test_flydsl_quantized_activations_need_mxfp4_weights():
    with pytest.raises(ValueError, match="MXFP4 weights"):
        get_backend("flydsl", arch="gfx950", weight_format="int4", act_dtype="fp8")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_flydsl_backend_is_made_exactly_where_its_spec_says_it_serves(arch):
    spec, platform = kernels.get_spec("flydsl"), Platform("rocm", arch, "test")
    for weight_format in ("mxfp4", "int4"):
        for act in act_quant.ACT_DTYPES:
            ok, why = spec.supports(platform, weight_format, act)
            try:
                get_backend("flydsl", arch=arch, weight_format=weight_format, act_dtype=act)
            except ValueError as exc:
                assert not ok, (weight_format, act, why, exc)
            else:
                assert ok, (weight_format, act, why)


def stand_in_spec(monkeypatch, name, **declared):
    """A stand-in backend package in the Triton backend's place in the plan (index 1 of SPECS)."""
    module = types.ModuleType(f"stand_in_{name}")
    module.make_backend = lambda **options: options
    monkeypatch.setitem(sys.modules, module.__name__, module)
    spec = BackendSpec(name, module.__name__, lambda platform, weight_format: (platform.vendor == "cuda", "stand-in"),
                       **declared)
    assert kernels.SPECS[1].name == "triton"
    monkeypatch.setattr(kernels, "SPECS", (kernels.SPECS[0], spec, *kernels.SPECS[2:]))
    return spec


def test_a_backend_declaring_no_act_dtypes_runs_bf16_only(monkeypatch):
    spec = stand_in_spec(monkeypatch, "plain")
    assert get_backend("plain", weight_format="mxfp4") == {"weight_format": "mxfp4", "act_dtype": "bf16"}
    assert spec.act_dtypes(Platform("cuda", "sm_90", "test"), "mxfp4") == ("bf16",)
    ok, why = spec.supports(Platform("cuda", "sm_90", "test"), "mxfp4", "fp8")
    assert not ok and "plain backend does not run fp8 activations" in why and why.endswith("supported there: bf16")
    with pytest.raises(UnsupportedActDtype, match="fp8.*sm_90.*supported on sm_90: bf16$"):
        plan("cuda", "sm_90", **{ENV_ACT_DTYPE: "fp8"})


# ------------------------------------------------------------------ dispatch
def plan(vendor, arch=None, **env):
    return [(c.name, dict(c.options)) for c in plan_backends(Platform(vendor, arch, "test"), env)]


def test_gfx950_plans_flydsl_then_torch_emulating_the_same_scheme():
    got = plan("rocm", "gfx950", **{ENV_ACT_DTYPE: "fp4"})
    assert got == [("flydsl", {"arch": "gfx950", "weight_format": "mxfp4", "act_dtype": "fp4"}),
                   ("torch", {"weight_format": "mxfp4", "act_dtype": "fp4", "act_quant": ActQuant("fp4")})]
    torch_choice = plan_backends(Platform("rocm", "gfx950", "test"), {}, act_dtype="fp8")[-1]
    assert torch_choice.make().act_quant == ActQuant("fp8")


@pytest.mark.parametrize("vendor, arch", [("rocm", "gfx942"), ("cuda", "sm_90"), ("rocm", "gfx90a")])
def test_unsupported_combinations_fail_at_load_naming_arch_and_choices(vendor, arch, monkeypatch):
    with pytest.raises(UnsupportedActDtype, match=rf"{ENV_ACT_DTYPE}='fp4' is not available on {vendor} {arch}"
                                                  rf".*supported on {arch}: bf16"):
        plan(vendor, arch, **{ENV_ACT_DTYPE: "fp4"})
    monkeypatch.setenv(ENV_ACT_DTYPE, "fp4")
    with pytest.raises(UnsupportedActDtype, match=arch):      # the plugins' layer core, when it is built
        RoutedExperts(SITU, platform=Platform(vendor, arch, "test"))


def test_forcing_a_backend_that_cannot_run_it_is_refused_too():
    with pytest.raises(UnsupportedActDtype, match="flydsl backend .*gfx942.*supported there: bf16"):
        plan("rocm", "gfx942", **{ENV_ACT_DTYPE: "fp8", ENV_BACKEND: "flydsl"})
    # the torch emulation may be forced anywhere (slow, but the function asked for)
    assert plan("rocm", "gfx942", **{ENV_ACT_DTYPE: "fp8", ENV_BACKEND: "torch"})[0][1]["act_dtype"] == "fp8"


def test_cpu_serves_every_act_dtype_with_the_torch_emulation():
    for act in ("fp8", "fp4"):
        assert plan("cpu", **{ENV_ACT_DTYPE: act}) == [("torch", {"weight_format": "mxfp4", "act_dtype": act})]


def test_routed_experts_reads_the_setting(gen, monkeypatch):
    monkeypatch.setenv(ENV_ACT_DTYPE, "fp4")
    experts = layer(gen, e=4, h=64, i=32)
    runner = RoutedExperts(SITU, platform=Platform("cpu"))
    assert runner.load(experts).act_quant == ActQuant("fp4")
    x, tw, ids = routing(gen, 5, 4, 2, 64)
    # the torch backend is the fp32 reference's own arithmetic (a float64 reference could round
    # an intermediate element that sits on an e2m1 boundary the other way)
    expected = moe_forward(x.float(), *experts.tensors(), tw.float(), ids, SITU, act_quant=ActQuant("fp4"))
    assert torch.equal(runner(x.float(), tw.float(), ids), expected)


# ------------------------------------------------------------------ reference and self-check
@pytest.mark.parametrize("scheme", [ActQuant("fp8"), ActQuant("fp8", "token", "token"), ActQuant("fp4")],
                         ids=lambda s: s.tag())
def test_reference_cost_of_each_variant_is_within_its_bound(gen, scheme):
    experts = layer(gen)
    x, tw, ids = routing(gen, 64, 8, 4, 256)
    exact = moe_forward(x, *experts.tensors(), tw, ids, SITU, compute_dtype=torch.float64)
    quant = moe_forward(x, *experts.tensors(), tw, ids, SITU, compute_dtype=torch.float64, act_quant=scheme)
    silu = moe_forward(x, *experts.tensors(), tw, ids, ActivationSpec.silu(), compute_dtype=torch.float64,
                       act_quant=scheme)
    err = relative_l2(quant, exact)
    print(f"{scheme.tag()}: relative L2 vs unquantized float64 reference {err:.3e}")
    assert 1e-3 < err < BOUND_VS_UNQUANTIZED[scheme.dtype]
    assert relative_l2(silu, quant) > 0.2                       # the activation still matters


def test_reference_quantizes_hidden_once_and_the_intermediate_per_expert(gen):
    experts = layer(gen, e=3, h=64, i=32)
    x, tw, ids = routing(gen, 6, 3, 2, 64)
    scheme = ActQuant("fp4")
    q = scheme.fake_quant(x, "hidden")
    # quantizing an already quantized hidden changes nothing: the reference's first step is idempotent
    assert torch.equal(scheme.fake_quant(q, "hidden"), q)
    a = moe_forward(x, *experts.tensors(), tw, ids, SITU, compute_dtype=torch.float64, act_quant=scheme)
    b = moe_forward(q, *experts.tensors(), tw, ids, SITU, compute_dtype=torch.float64, act_quant=scheme)
    assert torch.equal(a, b)


def test_self_check_compares_with_the_same_activation_quantization(gen):
    experts = layer(gen, e=5, h=64, i=32)
    assert run_self_check(TorchBackend(act_dtype="fp4"), experts, SITU) < 1e-2   # bf16 output rounding

    class Bf16ClaimingFp4(TorchBackend):
        """A deliberately wrong backend: says fp4, computes bf16 activations."""
        name = "liar"

        def forward(self, prepared, hidden, topk_weights, topk_ids, activation, expert_map=None):
            return TorchBackend().forward(prepared, hidden, topk_weights, topk_ids, activation, expert_map)

    with pytest.raises(SelfCheckFailed, match="liar.*fp4"):
        run_self_check(Bf16ClaimingFp4(act_dtype="fp4"), experts, SITU)


def test_dispatch_module_names_the_setting_in_its_docstring():
    assert ENV_ACT_DTYPE in dispatch.__doc__


def test_a_backend_plugs_fp8_in_through_its_spec(monkeypatch):
    """A stand-in for the Triton package declaring fp8 on sm_89+ with per-token scales: the plan keeps
    it first and the torch fallback emulates the same scheme."""
    stand_in_spec(monkeypatch, "triton",
                  act_dtypes=lambda p, weight_format: ("bf16", "fp8") if sm_version(p.arch) >= 89 else ("bf16",),
                  act_quant_for=lambda arch, act: ActQuant(act, "token", "token") if act == "fp8" else ActQuant(act))
    got = plan("cuda", "sm_90", **{ENV_ACT_DTYPE: "fp8"})
    assert got == [("triton", {"weight_format": "mxfp4", "act_dtype": "fp8"}),
                   ("torch", {"weight_format": "mxfp4", "act_dtype": "fp8",
                              "act_quant": ActQuant("fp8", "token", "token")})]
    assert get_backend("triton", weight_format="mxfp4", act_dtype="fp8") == {"weight_format": "mxfp4",
                                                                          "act_dtype": "fp8"}
    with pytest.raises(UnsupportedActDtype, match="sm_80.*supported on sm_80: bf16"):
        plan("cuda", "sm_80", **{ENV_ACT_DTYPE: "fp8"})
    with pytest.raises(UnsupportedActDtype, match="fp4.*sm_90.*supported on sm_90: bf16, fp8"):
        plan("cuda", "sm_90", **{ENV_ACT_DTYPE: "fp4"})
