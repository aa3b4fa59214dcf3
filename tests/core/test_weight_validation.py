"""Load-time validation of expert tensors: NaN and overflowing scale bytes are refused by name."""
import pytest
import torch

from kimi_k3_moe import settings
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.platform import Platform
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.weights.requant import requantize_experts
from kimi_k3_moe.weights.validate import MAX_SCALE_BYTE, WeightValidationError, find_problems, validate_experts

E, H, I = 6, 64, 64
SITU = ActivationSpec.situv2(4.0, 25.0)


def random_experts(gen):
    def linear(rows, cols):
        return mxfp4.quantize(torch.randn(E, rows, cols, generator=gen) * 3 / cols ** 0.5)
    return Mxfp4Experts(*linear(2 * I, H), *linear(H, I))


def torch_layer():
    plan = [BackendChoice("torch", {"weight_format": "mxfp4"})]
    return RoutedExperts(SITU, platform=Platform("cpu"), plan=plan, self_check="strict", layer_name="layer 3")


def test_clean_experts_pass_and_load(gen):
    experts = random_experts(gen)
    assert find_problems(experts, layer="layer 3") == []
    torch_layer().load(experts)


def test_nan_scale_byte_refused_on_the_torch_path_naming_expert_and_tensor(gen, seed):
    experts = random_experts(gen)
    e = seed % E
    experts.w13_scale[e, I + 5, 1] = 0xFF   # w3 (up) row 5
    experts.w13_scale[e, I + 6, 0] = 0xFF
    with pytest.raises(WeightValidationError) as info:
        torch_layer().load(experts)
    msg = str(info.value)
    assert msg.startswith(f"layer 3: expert {e} tensor w13_scale holds 2 NaN scale byte(s) 0xFF")
    assert "checkpoint w3 (up) row 5" in msg and "[row 69, block 1]" in msg
    assert settings.VALIDATE_WEIGHTS + "=off" in msg


def test_overflowing_scales_refused_only_where_codes_are_nonzero(gen):
    experts = random_experts(gen)
    experts.w2_scale[2, 7, 0] = MAX_SCALE_BYTE + 1
    experts.w2_packed[2, 7, :16] = 0x88   # -0 codes only: the block decodes to zeros whatever its scale
    assert find_problems(experts) == []
    experts.w2_packed[2, 7, 3] = 0x07     # one code 6 x 2^(223-127): the K-sum may overflow
    (problem,) = find_problems(experts, layer="layer 1")
    assert problem.startswith("layer 1: expert 2 tensor w2_scale holds 1 scale byte(s) above 0xDE")
    assert "first 0xDF at [row 7, block 0] = checkpoint w2 (down) row 7" in problem


def test_every_bad_expert_is_counted_across_chunks(gen):
    experts = random_experts(gen)
    for e in (1, 4, 5):
        experts.w2_scale[e, 0, 0] = 0xFF
    (problem,) = find_problems(experts, chunk_bytes=1)  # one expert per chunk
    assert "expert 1 tensor w2_scale" in problem and "2 more expert(s) of this layer too: [4, 5]" in problem


def test_opt_out_is_explicit_and_validated(gen):
    experts = random_experts(gen)
    experts.w13_scale[0, 0, 0] = 0xFF
    validate_experts(experts, env={settings.VALIDATE_WEIGHTS: "off"})
    with pytest.raises(WeightValidationError):
        validate_experts(experts, env={settings.VALIDATE_WEIGHTS: "on"})
    with pytest.raises(settings.SettingError, match="KIMI_K3_MOE_VALIDATE_WEIGHTS='no' is not accepted; "
                                                    "choose one of on, off"):
        validate_experts(experts, env={settings.VALIDATE_WEIGHTS: "no"})


def test_int4_experts_with_non_finite_scales_are_refused(gen):
    converted = requantize_experts(random_experts(gen), method="search", progress=False)
    assert find_problems(converted) == []
    converted.w2.scales[3, 1, 0] = float("inf")
    (problem,) = find_problems(converted, layer="layer 2")
    assert problem.startswith("layer 2: expert 3 tensor w2.scales holds 1 non-finite value(s), first inf")
