import json
import math

import pytest
import torch

from kimi_k3_moe.activation import ActivationSpec, UnsupportedActivationError, silu_and_mul, situv2_and_mul
from kimi_k3_moe.configs import ConfigError

K3_BETA, K3_LINEAR_BETA = 4.0, 25.0


def situv2_float64(x, beta, linear_beta):
    g, u = x.double().chunk(2, -1)
    gate = beta * torch.tanh(g / beta) / (1 + torch.exp(-g))
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return gate * up


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("linear_beta", [K3_LINEAR_BETA, None, 1.5])
def test_situv2_matches_float64_formula(gen, dtype, tol, linear_beta):
    x = (torch.randn(37, 2 * 96, generator=gen) * 6).to(dtype)
    out = situv2_and_mul(x, K3_BETA, linear_beta)
    assert out.dtype == dtype and out.shape == (37, 96)
    expected = situv2_float64(x, K3_BETA, linear_beta)
    assert float((out.double() - expected).norm() / expected.norm()) < tol


def test_situv2_finite_and_saturating_at_1e4():
    big = 1e4
    g = torch.tensor([big, -big, big, -big, big])
    u = torch.tensor([big, big, -big, -big, 0.0])
    out = situv2_and_mul(torch.cat([g, u]).unsqueeze(0), K3_BETA, K3_LINEAR_BETA)[0]
    assert torch.isfinite(out).all()
    assert out[0] == pytest.approx(K3_BETA * K3_LINEAR_BETA, rel=1e-6)
    assert out[2] == pytest.approx(-K3_BETA * K3_LINEAR_BETA, rel=1e-6)
    assert abs(out[1]) < 1e-30 and abs(out[3]) < 1e-30 and out[4] == 0


def test_silu_and_situv2_differ_on_stage1_like_activations(gen):
    # Stage-1 outputs of trained experts spread over several units; here std 3.
    x = torch.randn(512, 2 * 384, generator=gen) * 3
    a = silu_and_mul(x).flatten().double()
    b = situv2_and_mul(x, K3_BETA, K3_LINEAR_BETA).flatten().double()
    cosine = float(a @ b / (a.norm() * b.norm()))
    assert cosine < 0.99


def test_odd_last_dim_is_refused():
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(3, 5))


def _k3_text(**overrides):
    text = {"hidden_act": "situ", "activation_situ_beta": K3_BETA,
            "activation_situ_linear_beta": K3_LINEAR_BETA}
    text.update(overrides)
    return text


def test_from_hf_config_flat_nested_path_and_object(tmp_path):
    flat = _k3_text()
    expected = ActivationSpec.situv2(K3_BETA, K3_LINEAR_BETA)
    assert ActivationSpec.from_hf_config(flat) == expected
    nested = {"model_type": "kimi_k3", "text_config": _k3_text()}
    assert ActivationSpec.from_hf_config(nested) == expected
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert ActivationSpec.from_hf_config(tmp_path) == expected
    assert ActivationSpec.from_hf_config(str(tmp_path / "config.json")) == expected

    class FakeTransformersConfig:  # transformers' PretrainedConfig exposes to_dict()
        def to_dict(self):
            return nested

    assert ActivationSpec.from_hf_config(FakeTransformersConfig()) == expected
    assert ActivationSpec.from_hf_config({"hidden_act": "silu"}) == ActivationSpec.silu()
    assert ActivationSpec.from_hf_config(_k3_text(hidden_act="situv2")) == expected


def test_missing_betas():
    with pytest.raises(ConfigError, match="activation_situ_beta"):
        ActivationSpec.from_hf_config({"hidden_act": "situ"})
    spec = ActivationSpec.from_hf_config({"hidden_act": "situ", "activation_situ_beta": 2.0})
    assert spec.linear_beta is None  # SiTUv2 then passes `up` unchanged
    with pytest.raises(ConfigError, match="hidden_act"):
        ActivationSpec.from_hf_config({"hidden_size": 8})


def test_unknown_activation_is_an_error_naming_it():
    with pytest.raises(UnsupportedActivationError, match="'gelu'.*silu"):
        ActivationSpec.from_hf_config(_k3_text(hidden_act="gelu"))
    assert issubclass(UnsupportedActivationError, ValueError)


@pytest.mark.parametrize("field", ["activation_situ_beta", "activation_situ_linear_beta"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "4"])
def test_bad_betas_are_errors(field, bad):
    with pytest.raises(ValueError, match=field):
        ActivationSpec.from_hf_config(_k3_text(**{field: bad}))


def test_spec_is_hashable_immutable_and_tags_every_bit():
    a = ActivationSpec.situv2(K3_BETA, K3_LINEAR_BETA)
    b = ActivationSpec.situv2(math.nextafter(K3_BETA, 5.0), K3_LINEAR_BETA)
    c = ActivationSpec.situv2(K3_BETA, math.nextafter(K3_LINEAR_BETA, 0.0))
    d = ActivationSpec.situv2(K3_BETA, None)
    tags = {s.cache_tag() for s in (a, b, c, d, ActivationSpec.silu())}
    assert len(tags) == 5
    assert len({a, b, c, d, ActivationSpec.situv2(4, 25)}) == 4
    with pytest.raises(AttributeError):
        a.beta = 1.0
    with pytest.raises(ValueError):
        ActivationSpec("silu", beta=1.0)
    with pytest.raises(UnsupportedActivationError):
        ActivationSpec("gelu")


def test_apply_dispatches_on_the_spec(gen):
    x = torch.randn(4, 64, generator=gen) * 4
    assert torch.equal(ActivationSpec.silu().apply(x), silu_and_mul(x))
    assert torch.equal(ActivationSpec.situv2(K3_BETA, K3_LINEAR_BETA).apply(x),
                       situv2_and_mul(x, K3_BETA, K3_LINEAR_BETA))
