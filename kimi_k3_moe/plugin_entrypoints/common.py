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


def plugin_enabled(env_var: str, env=None, *, verbatim: bool = False) -> bool:
    """False when `env_var` (VLLM_PLUGINS / SGLANG_PLUGINS) lists plugins and not ours.

    `verbatim` reads the list as vLLM does: set at all (even empty) means a
    filter, and names are compared unstripped. SGLang treats an empty value
    as unset and strips names (the default here).
    """
    value = (os.environ if env is None else env).get(env_var)
    if verbatim:
        return value is None or PLUGIN_NAME in value.split(",")
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
    tiles = _table_line(backend)
    note = activation.defaults_note()
    logger.info("kimi-k3-moe %s serving Kimi-K3 routed experts in %s: backend %s, activation %s%s%s",
                __version__, engine, backend, activation, f" ({note})" if note else "",
                f", tiles from {tiles}" if tiles else "")


def _table_line(backend: str) -> str | None:
    """Which tile table serves `backend` ("triton[mxfp4]" -> the triton tables); None: it has none."""
    from kimi_k3_moe.configs import user_tables
    name = backend.split("[")[0]
    if name not in ("triton", "flydsl"):
        return None
    try:
        return user_tables.describe(name)
    except Exception as exc:  # the log line must never stop serving
        return f"packaged table (user table not checked: {type(exc).__name__})"


def converted_source(
    platform: Any,
    model_dir: Any,
    *,
    layer: int,
    tp_size: int,
    tp_rank: int,
    local_experts: Any,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    device: Any,
) -> tuple[Any, list, Any] | None:
    """(this rank's pre-converted int4 experts of `layer`, the plan serving them, the checkpoint).

    Only where the kernels read int4 (gfx942) and a `kimi-k3-moe convert`
    checkpoint is there ($KIMI_K3_MOE_CONVERTED, or <model>/kimi_k3_moe_int4/);
    None otherwise, and the engine's MXFP4 experts are converted at load.
    A converted folder that does not fit this model or server raises
    ConvertedCheckpointError saying why: it is never skipped silently.
    `local_experts` are the global ids this rank holds, in local order;
    `intermediate_size` is the model's full (unsharded, unpadded) size.
    """
    from kimi_k3_moe.dispatch import INT4_ARCHS, BackendChoice, plan_backends
    from kimi_k3_moe.weights.converted import find_converted

    if not platform.is_gpu or platform.arch not in INT4_ARCHS:
        return None
    found = find_converted(model_dir, tp_size=tp_size, tp_rank=tp_rank, target=platform.arch,
                           num_experts=num_experts, hidden_size=hidden_size,
                           intermediate_size=intermediate_size)
    if found is None:
        return None
    # Every backend of the plan must read the recorded method: methods are never mixed.
    plan = [BackendChoice(c.name, {**c.options, "int4_method": found.method}, c.reason)
            for c in plan_backends(platform) if c.options.get("weight_format") == "int4"]
    if not plan:
        return None  # KIMI_K3_MOE_BACKEND forced a backend that does not read int4
    experts = found.load_layer(layer, tp_rank, experts=[int(e) for e in local_experts], device=device)
    key = f"converted:{found.path}:{os.getpid()}"
    with _lock:
        first = key not in _logged
        _logged.add(key)
    (logger.info if first else logger.debug)(
        "kimi-k3-moe: layer %d, TP rank %d/%d: int4 experts (%s) read from the converted checkpoint %s",
        layer, tp_rank, tp_size, found.method, found.path)
    return experts, plan, found
