"""What the vLLM and SGLang adapters share: activation cross-checks and logging.

Engines hand the MoE method their own idea of the activation (vLLM: the
layer's moe config; SGLang: gemm1_alpha / gemm1_clamp_limit). Both have
defaulted betas in the past, so the adapters compare the engine's values
with the model's HF config and refuse a mismatch at load.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

from kimi_k3_moe import __version__
from kimi_k3_moe.activation import HF_ACTIVATION_NAMES, SITUV2, ActivationSpec, UnsupportedActivationError

logger = logging.getLogger("kimi_k3_moe")
PLUGIN_NAME = "kimi_k3_moe"
_logged: set[str] = set()
_lock = threading.Lock()


def plugin_enabled(env_var: str, env=None) -> bool:
    """False when `env_var` (VLLM_PLUGINS / SGLANG_PLUGINS) lists plugins and not ours."""
    value = (os.environ if env is None else env).get(env_var)
    if value is None or not value.strip():
        return True
    return PLUGIN_NAME in {name.strip() for name in value.split(",")}


def is_situ(name: Any) -> bool:
    """Whether an engine's activation name or enum member means SiTUv2."""
    raw = getattr(name, "value", name)
    return HF_ACTIVATION_NAMES.get(str(raw).lower().rsplit(".", 1)[-1]) == SITUV2


def engine_activation(name: Any, beta: float | None, linear_beta: float | None) -> ActivationSpec:
    """The engine's activation (an enum or string such as 'situ', 'silu') as a spec."""
    raw = getattr(name, "value", name)
    key = str(raw).lower().rsplit(".", 1)[-1]
    spec_name = HF_ACTIVATION_NAMES.get(key)
    if spec_name is None:
        raise UnsupportedActivationError(
            f"MoE activation {raw!r} is not served by kimi-k3-moe; accepted: {sorted(HF_ACTIVATION_NAMES)}")
    if spec_name == SITUV2:
        return ActivationSpec.situv2(beta, _unset_to_none(linear_beta))
    return ActivationSpec.silu()


def _unset_to_none(value: float | None) -> float | None:
    # Engines encode "no linear beta" as None or as a non-positive number.
    if value is None or (isinstance(value, (int, float)) and not math.isnan(value) and value <= 0):
        return None
    return value


def verify_against_hf(engine_spec: ActivationSpec, hf_config: Any, where: str) -> ActivationSpec:
    """Refuse to serve when the engine's activation differs from the model's config."""
    model_spec = ActivationSpec.from_hf_config(hf_config)
    if engine_spec != model_spec:
        raise ValueError(
            f"{where}: the engine configured the MoE activation as {engine_spec}, but the model's "
            f"config.json says {model_spec} (hidden_act, activation_situ_beta, "
            "activation_situ_linear_beta); refusing to serve a different function")
    return model_spec


def log_serving_once(engine: str, backend: str, activation: ActivationSpec) -> None:
    """One INFO line per process and engine naming version, backend and activation."""
    key = f"{engine}:{os.getpid()}"
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.info("kimi-k3-moe %s serving Kimi-K3 routed experts in %s: backend %s, activation %s",
                __version__, engine, backend, activation)
