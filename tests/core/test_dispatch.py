import pytest
import torch
from moe_helpers import SITU, Choice, SiluOnlyBackend, broken_plan, random_experts, random_routing

from kimi_k3_moe import dispatch, platform
from kimi_k3_moe.dispatch import ENV_BACKEND, plan_backends
from kimi_k3_moe.kernels import BackendUnavailable
from kimi_k3_moe.kernels.torch.backend import TorchBackend
from kimi_k3_moe.loading import resolve
from kimi_k3_moe.platform import Platform
from kimi_k3_moe.reference import moe_forward, relative_l2
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check, self_check_mode


def plan(vendor, arch=None, **env):
    return [(c.name, dict(c.options)) for c in plan_backends(Platform(vendor, arch, "test"), env)]


def test_plans_per_platform():
    bf16 = {"act_dtype": "bf16"}
    assert plan("rocm", "gfx950") == [("flydsl", {"arch": "gfx950", "weight_format": "mxfp4", **bf16}),
                                      ("triton", {"weight_format": "mxfp4", **bf16}),
                                      ("torch", {"weight_format": "mxfp4", **bf16})]
    assert plan("rocm", "gfx942") == [("flydsl", {"arch": "gfx942", "weight_format": "int4", **bf16}),
                                      ("triton", {"weight_format": "int4", **bf16}),
                                      ("torch", {"weight_format": "int4", **bf16})]
    assert [n for n, _ in plan("rocm", "gfx90a")] == ["triton", "torch"]
    assert [n for n, _ in plan("cuda", "sm_90")] == ["triton", "torch"]
    assert [n for n, _ in plan("cuda", "sm_75")] == ["torch"]
    assert [n for n, _ in plan("cpu")] == ["torch"]


def test_the_platform_states_which_weight_formats_an_arch_reads():
    assert platform.weight_formats("gfx942") == ("int4",)             # no FP4 path
    assert platform.weight_formats("gfx950") == ("mxfp4", "int4")
    assert platform.weight_formats("sm_90") == platform.weight_formats(None) == ("mxfp4", "int4")
    assert [Platform(*where).weight_format for where in (("rocm", "gfx942"), ("rocm", "gfx950"), ("rocm", "gfx90a"),
                                                         ("cuda", "sm_90"), ("cpu",))] == \
        ["int4", "mxfp4", "mxfp4", "mxfp4", "mxfp4"]
    assert platform.for_arch("gfx942") == Platform("rocm", "gfx942")
    assert platform.for_arch("sm_90a") == Platform("cuda", "sm_90a")
    assert platform.for_arch("interpreter") == Platform("cpu", "interpreter")
    assert platform.for_arch(None) == Platform("cpu")


def test_env_forces_one_backend():
    bf16 = {"act_dtype": "bf16"}
    assert plan("rocm", "gfx942", **{ENV_BACKEND: "triton"}) == [("triton", {"weight_format": "int4", **bf16})]
    assert plan("cpu", **{ENV_BACKEND: "torch"}) == [("torch", {"weight_format": "mxfp4", **bf16})]
    assert plan("cpu", **{ENV_BACKEND: "triton"}) == [("triton", bf16)]
    with pytest.raises(BackendUnavailable, match="flydsl.*gfx942.*cpu"):
        plan("cpu", **{ENV_BACKEND: "flydsl"})
    with pytest.raises(ValueError, match="'cuda-magic'"):
        plan("cpu", **{ENV_BACKEND: "cuda-magic"})


def test_resolve_skips_what_cannot_run():
    class Missing(dispatch.BackendChoice):
        def make(self):
            raise BackendUnavailable("not built here")

    chain = [Missing("flydsl", {}, "first choice"), dispatch.BackendChoice("torch", {}, "last")]
    backend, choice, skipped = resolve(chain)
    assert backend.name == "torch" and "not built here" in skipped[0]
    with pytest.raises(BackendUnavailable, match="first choice.*not built here"):
        resolve(chain[:1])


def test_self_check_catches_a_kernel_ignoring_the_activation(gen):
    experts = random_experts(gen)
    assert run_self_check(TorchBackend(), experts, SITU) < 1e-2
    with pytest.raises(SelfCheckFailed, match="silu-only.*relative L2"):
        run_self_check(SiluOnlyBackend(), experts, SITU)


def test_routed_experts_falls_back_loudly_or_raises_when_strict(gen, caplog):
    experts = random_experts(gen)
    chain = broken_plan("broken")
    runner = RoutedExperts(SITU, platform=Platform("cpu"), plan=chain, self_check="fallback")
    with caplog.at_level("ERROR", logger="kimi_k3_moe"):
        runner.load(experts)
    assert runner.backend.name == "torch"
    assert "REFUSING backend silu-only" in caplog.text
    strict = RoutedExperts(SITU, platform=Platform("cpu"), plan=chain, self_check="strict")
    with pytest.raises(SelfCheckFailed):
        strict.load(experts)
    off = RoutedExperts(SITU, platform=Platform("cpu"), plan=chain, self_check="off")
    assert off.load(experts).name == "silu-only"
    typo = RoutedExperts(SITU, platform=Platform("cpu"), plan=chain, self_check="of")  # was served as "fallback"
    with pytest.raises(ValueError, match="self_check='of'; choose one of fallback, strict, off"):
        typo.load(experts)


def test_routed_experts_runs_the_moe(gen):
    experts = random_experts(gen)
    runner = RoutedExperts(SITU, platform=Platform("cpu"))
    runner.load(experts)
    weights, ids = random_routing(gen, 7, 5, 2)
    hidden = torch.randn(7, 64, generator=gen)
    expected = moe_forward(hidden.double(), *experts.tensors(), weights, ids, SITU, compute_dtype=torch.float64)
    assert relative_l2(runner(hidden, weights, ids), expected) < 1e-5


def test_self_check_mode_from_env():
    assert self_check_mode({}) == "fallback"
    assert self_check_mode({"KIMI_K3_MOE_SELF_CHECK": "strict"}) == "strict"
    with pytest.raises(ValueError, match="KIMI_K3_MOE_SELF_CHECK='maybe'"):
        self_check_mode({"KIMI_K3_MOE_SELF_CHECK": "maybe"})


def test_holds_source_tells_whether_engine_weights_may_be_released(gen):
    experts = random_experts(gen)
    same = RoutedExperts(SITU, platform=Platform("cpu"), plan=[Choice("torch", {"weight_format": "mxfp4"})])
    same.load(experts)
    assert same.holds_source(experts)  # the torch backend reads the MXFP4 bytes as they are
    own = RoutedExperts(SITU, platform=Platform("cpu"), plan=[Choice("torch", {"weight_format": "int4"})],
                        self_check="off")
    own.load(experts)
    assert not own.holds_source(experts)  # requantised copy: the engine's bytes can go
    with pytest.raises(RuntimeError, match="before load"):
        RoutedExperts(SITU, platform=Platform("cpu")).holds_source(experts)
