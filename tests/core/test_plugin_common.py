"""Engine-independent parts of the plugins (the engines' own suites test the adapters)."""
import logging

import pytest
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec, UnsupportedActivationError
from kimi_k3_moe.plugin_entrypoints import common

K3 = {"text_config": {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}}


def test_plugin_filter():
    assert common.plugin_enabled("VLLM_PLUGINS", {})
    assert common.plugin_enabled("VLLM_PLUGINS", {"VLLM_PLUGINS": ""})
    assert common.plugin_enabled("VLLM_PLUGINS", {"VLLM_PLUGINS": "other, kimi_k3_moe"})
    assert not common.plugin_enabled("VLLM_PLUGINS", {"VLLM_PLUGINS": "other"})


def test_plugin_filter_read_as_vllm_does():
    """vLLM: set (even empty) filters, names unstripped (`envs.VLLM_PLUGINS` is value.split(","))."""
    def enabled(env):
        return common.plugin_enabled("VLLM_PLUGINS", env, verbatim=True)

    assert enabled({}) and enabled({"VLLM_PLUGINS": "other,kimi_k3_moe"})
    assert not enabled({"VLLM_PLUGINS": ""}) and not enabled({"VLLM_PLUGINS": "other, kimi_k3_moe"})


class FakeEnum:  # stands in for an engine's activation enum member (only .value is read)
    value = "situ"


def test_is_situ_reads_names_and_enums():
    assert common.is_situ("situ") and common.is_situ(FakeEnum()) and common.is_situ("MoEActivation.SITU")
    assert not common.is_situ("silu") and not common.is_situ("swiglu") and not common.is_situ(None)


def test_engine_activation_names_and_unset_linear_beta():
    assert common.engine_activation(FakeEnum(), 4.0, 25.0) == SITU
    assert common.engine_activation("MoEActivation.SITU", 4.0, 0.0) == ActivationSpec.situv2(4.0, None)
    assert common.engine_activation("silu", None, None) == ActivationSpec.silu()
    with pytest.raises(UnsupportedActivationError, match="gelu"):
        common.engine_activation("gelu", None, None)
    with pytest.raises(ValueError, match="beta"):
        common.engine_activation("situ", None, 25.0)


def test_mismatch_with_hf_config_is_refused():
    good = SITU
    assert common.verify_against_hf(good, K3, "layer 3") == good
    with pytest.raises(ValueError, match="layer 3.*beta=1.*config.json says situv2\\(beta=4"):
        common.verify_against_hf(ActivationSpec.situv2(1.0, 25.0), K3, "layer 3")
    with pytest.raises(ValueError, match="silu"):
        common.verify_against_hf(ActivationSpec.silu(), K3, "layer 3")


def test_serving_line_logged_once(caplog):
    common._logged.clear()
    with caplog.at_level(logging.INFO, logger="kimi_k3_moe"):
        for _ in range(3):
            common.log_serving_once("vllm", "triton[mxfp4]", SITU)
    lines = [r.getMessage() for r in caplog.records if "serving Kimi-K3" in r.getMessage()]
    assert len(lines) == 1 and "triton[mxfp4]" in lines[0] and "situv2(beta=4" in lines[0]
