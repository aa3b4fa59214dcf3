"""Which MoE method a layer gets, and which layers are refused while the model is built."""
from __future__ import annotations

import copy
import traceback

import pytest


def test_silu_layer_keeps_vllms_method(single_rank, tmp_path, seed, monkeypatch):
    """A SiLU MXFP4 MoE model: our config is the one vLLM resolves, and it hands the layer to
    vLLM's own `Mxfp4Config._make_moe_method`.

    vLLM's `Mxfp4MoEMethod` cannot be built on a CPU (its backend oracle needs
    a GPU, or x86 AMX for its CPU experts, which this box lacks): the test
    therefore stops where vLLM's own constructor raises its own error, and
    checks that the error comes from there and that our method was never made.
    """
    import vllm_k3 as k3

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config, K3RoutedExpertsMethod

    made = []
    original = K3RoutedExpertsMethod.for_moe.__func__
    monkeypatch.setattr(K3RoutedExpertsMethod, "for_moe",
                        classmethod(lambda cls, moe: made.append(moe) or original(cls, moe)))
    checkpoint = k3.write_checkpoint(tmp_path, seed, hidden_act="silu", activation_situ_beta=None,
                                     activation_situ_linear_beta=None)
    config = k3.make_vllm_config(checkpoint)
    assert type(config.quant_config) is K3Mxfp4Config
    with pytest.raises(NotImplementedError, match="No MXFP4 MoE backend supports") as info:
        k3.build_block(config)
    frames = [(f.filename, f.name) for f in traceback.extract_tb(info.value.__traceback__)]
    assert any(name == "_make_moe_method" and "kimi_k3_moe" not in file
               and file.endswith("quantization/mxfp4.py") for file, name in frames), frames
    assert any(name == "__init__" and file.endswith("quantization/mxfp4.py") for file, name in frames)
    assert made == []


def _text_config(checkpoint, **changes):
    import vllm_k3 as k3

    config = k3.make_vllm_config(checkpoint)
    text = copy.deepcopy(config.model_config.hf_text_config)
    for key, value in changes.items():
        setattr(text, key, value)
    return config, text


def test_betas_differing_from_config_json_are_refused_at_build(single_rank, k3_checkpoint):
    """The layer's betas (vLLM's moe config) must be the model's config.json betas."""
    import vllm_k3 as k3

    config, text = _text_config(k3_checkpoint, activation_situ_beta=1.0)
    with pytest.raises(ValueError, match=r"situv2\(beta=1.*config.json says situv2\(beta=4"):
        k3.build_block(config, text)
    config, text = _text_config(k3_checkpoint, activation_situ_linear_beta=None)
    with pytest.raises(ValueError, match=r"linear_beta=None.*config.json says.*linear_beta=25"):
        k3.build_block(config, text)


def test_situ_layer_without_beta_is_refused(single_rank, k3_checkpoint):
    import vllm_k3 as k3

    from kimi_k3_moe.plugin_entrypoints._vllm_method import UnsupportedVllmSetup

    config, text = _text_config(k3_checkpoint, activation_situ_beta=None)
    with pytest.raises(UnsupportedVllmSetup, match="activation_situ_beta=None"):
        k3.build_block(config, text)


def test_silu_layer_in_a_situ_model_is_refused(single_rank, k3_checkpoint):
    """Handing it to vLLM's method would serve SiLU where the model was trained with SiTUv2."""
    import vllm_k3 as k3

    from kimi_k3_moe.plugin_entrypoints._vllm_method import UnsupportedVllmSetup

    config, text = _text_config(k3_checkpoint, hidden_act="silu")
    with pytest.raises(UnsupportedVllmSetup, match="hidden_act='situ'"):
        k3.build_block(config, text)


def test_gfx950_with_aiters_k3_path_keeps_vllms_method_unless_forced(single_rank, k3_checkpoint, monkeypatch,
                                                                    caplog, tmp_path):
    """On gfx950, where vLLM 0.33 serves Kimi-K3 with aiter's hardware-tuned a16w4 kernels, the SiTU
    layers go to vLLM's own `_make_moe_method` (which cannot build on this CPU: it stops with its own
    error) and the log says why; KIMI_K3_MOE_BACKEND=flydsl makes the layer ours. Stand-ins: the
    platform (no MI355X here) and aiter's presence (no aiter wheel for a CPU)."""
    import logging

    import vllm_k3 as k3

    from kimi_k3_moe.platform import Platform
    from kimi_k3_moe.plugin_entrypoints import _vllm_method

    monkeypatch.setattr(_vllm_method, "detect_platform", lambda: Platform("rocm", "gfx950", "MI355X (stand-in)"))
    monkeypatch.setattr(_vllm_method, "aiter_situ_path", lambda: "vLLM's aiter a16w4 MoE (stand-in)")
    monkeypatch.delenv("KIMI_K3_MOE_BACKEND", raising=False)
    monkeypatch.setenv("KIMI_K3_MOE_TABLES", str(tmp_path))   # no measurement recorded
    config = k3.make_vllm_config(k3_checkpoint)
    with caplog.at_level(logging.INFO, logger="kimi_k3_moe"):
        with pytest.raises(NotImplementedError, match="No MXFP4 MoE backend supports") as info:
            k3.build_block(config)
    frames = [(f.filename, f.name) for f in traceback.extract_tb(info.value.__traceback__)]
    assert any(name == "_make_moe_method" and file.endswith("quantization/mxfp4.py") for file, name in frames)
    # one line per process; vLLM's handler may show it a second time (plugin_entrypoints/vllm.py)
    said = [r.getMessage() for r in caplog.records if "left to the engine's own path" in r.getMessage()]
    assert len(set(said)) == 1 and "aiter a16w4" in said[0] and "KIMI_K3_MOE_BACKEND=flydsl" in said[0], said
    monkeypatch.setenv("KIMI_K3_MOE_BACKEND", "flydsl")
    block = k3.build_block(k3.make_vllm_config(k3_checkpoint))
    assert type(k3.routed_layer(block).quant_method) is _vllm_method.K3RoutedExpertsMethod
