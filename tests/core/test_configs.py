import pytest
from moe_helpers import SITU

from kimi_k3_moe.configs import ConfigError, K3MoEConfig
from kimi_k3_moe.weights.synthetic import synthetic_config

K3_TEXT = dict(num_layers=93, hidden_size=7168, routed_expert_hidden_size=3584,
               moe_intermediate_size=3072, num_experts=896, num_experts_per_token=16,
               num_shared_experts=2, first_k_dense_replace=1, hidden_act="situ",
               activation_situ_beta=4.0, activation_situ_linear_beta=25.0)


def k3():
    return synthetic_config(**K3_TEXT)


def test_kimi_k3_shapes_nested_and_flat():
    nested = K3MoEConfig.from_hf_config(k3())
    flat_dict = dict(k3()["text_config"], quantization_config=k3()["quantization_config"])
    flat = K3MoEConfig.from_hf_config(flat_dict)
    for cfg in (nested, flat):
        assert cfg.num_experts == 896 and cfg.num_experts_per_token == 16
        assert cfg.routed_expert_hidden_size == 3584 and cfg.hidden_size == 7168
        assert cfg.intermediate_per_rank(8) == 384 and cfg.intermediate_per_rank(16) == 192
        assert cfg.expert_bytes(8) == 2_193_408  # K3_FACTS / anchors: bytes per expert at TP8
        assert len(cfg.moe_layers()) == 92
        assert cfg.activation == SITU
        assert cfg.quantization.format == "mxfp4-pack-quantized"
        assert cfg.router.use_grouped_topk and cfg.router.renormalize


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", None, "num_experts"),
    ("num_experts", 0, "positive integer"),
    ("num_experts_per_token", 1000, "exceeds num_experts"),
    ("moe_intermediate_size", 100, "multiple of the MXFP4 block"),
    ("moe_router_activation_func", "softmax", "softmax"),
    ("hidden_act", "gelu", "gelu"),
])
def test_bad_fields_are_named(field, value, match):
    cfg = k3()
    if value is None:
        del cfg["text_config"][field]
    else:
        cfg["text_config"][field] = value
    with pytest.raises(ValueError, match=match):
        K3MoEConfig.from_hf_config(cfg)


def test_tp_that_does_not_split_is_refused():
    cfg = K3MoEConfig.from_hf_config(k3())
    with pytest.raises(ConfigError, match="tensor parallel size 5"):
        cfg.intermediate_per_rank(5)
    with pytest.raises(ConfigError, match="per rank 48"):
        cfg.intermediate_per_rank(64)


def test_other_quant_formats_are_refused():
    cfg = k3()
    cfg["quantization_config"]["format"] = "int-quantized"
    with pytest.raises(ConfigError, match="int-quantized"):
        K3MoEConfig.from_hf_config(cfg)
