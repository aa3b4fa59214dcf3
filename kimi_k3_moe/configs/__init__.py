"""HF-config parsing and tuned kernel tables."""
from kimi_k3_moe.configs.hf_dict import ConfigError, load_config_dict, text_config

__all__ = ["ConfigError", "K3MoEConfig", "QuantizationInfo", "RouterConfig",
           "load_config_dict", "text_config"]


def __getattr__(name):
    # configs.model imports activation, which imports configs.hf_dict: load lazily.
    if name in ("K3MoEConfig", "QuantizationInfo", "RouterConfig"):
        from kimi_k3_moe.configs import model
        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
