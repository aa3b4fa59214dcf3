"""A K3-shaped checkpoint resolves to our quantization config through vLLM's own config path."""
from __future__ import annotations


def test_model_config_resolves_to_our_config(vllm_plugins_loaded, k3_checkpoint):
    """ModelConfig rewrites K3's compressed-tensors mxfp4-pack-quantized block to "mxfp4";
    VllmConfig then instantiates whatever is registered under that name."""
    from vllm_k3 import make_vllm_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config

    config = make_vllm_config(k3_checkpoint)
    assert config.model_config.hf_config.model_type == "kimi_k3"
    assert config.model_config.quantization == "mxfp4"
    assert type(config.quant_config) is K3Mxfp4Config


def test_engine_args_resolve_to_our_config(vllm_plugins_loaded, k3_checkpoint):
    """The path `vllm serve` takes: EngineArgs -> create_engine_config."""
    from vllm.engine.arg_utils import EngineArgs

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config

    args = EngineArgs(model=str(k3_checkpoint), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512,
                      enforce_eager=True, limit_mm_per_prompt={"image": 0}, enable_prefix_caching=False)
    assert type(args.create_engine_config().quant_config) is K3Mxfp4Config
