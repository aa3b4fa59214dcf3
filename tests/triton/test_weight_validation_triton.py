"""The Triton path under the interpreter: a NaN scale byte is refused at load, not served as NaN rows."""
import pytest
import torch

from kimi_k3_moe import settings
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import ENV_BACKEND, plan_backends
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.platform import Platform
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.weights.validate import WeightValidationError

E, H, I = 4, 64, 64
SITU = ActivationSpec.situv2(4.0, 25.0)


def experts_with_a_nan_scale(gen, expert):
    def linear(rows, cols):
        return mxfp4.quantize(torch.randn(E, rows, cols, generator=gen) * 3 / cols ** 0.5)
    experts = Mxfp4Experts(*linear(2 * I, H), *linear(H, I))
    experts.w13_scale[expert, 3, 0] = 0xFF  # w1 (gate) row 3
    return experts


def layer(self_check):
    plan = plan_backends(Platform("cpu"), {ENV_BACKEND: "triton"})
    return RoutedExperts(SITU, platform=Platform("cpu"), plan=plan, self_check=self_check, layer_name="layer 7")


def test_triton_load_refuses_a_nan_scale_byte(monkeypatch, gen, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expert = seed % E
    with pytest.raises(WeightValidationError,
                       match=rf"layer 7: expert {expert} tensor w13_scale holds 1 NaN scale byte\(s\) 0xFF.*"
                             r"checkpoint w1 \(gate\) row 3"):
        layer("strict").load(experts_with_a_nan_scale(gen, expert))


def test_without_the_check_triton_rows_routed_there_are_nan(monkeypatch, gen):
    """Why the check exists: opted out, the kernels serve NaN for every row routed to the expert."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(settings.VALIDATE_WEIGHTS, "off")
    routed = layer("off")
    routed.load(experts_with_a_nan_scale(gen, 1))
    assert routed.backend.name == "triton"
    hidden = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 3], [2, 3], [1, 0]], dtype=torch.int32)
    out = routed(hidden, torch.full((4, 2), 0.5), ids)
    assert out[[1, 3]].isnan().any(-1).all() and out[[0, 2]].isfinite().all()
