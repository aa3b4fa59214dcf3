"""What the vLLM and SGLang adapters share, so that each adapter is only its engine's conventions.

- Activation cross-checks: engines hand the MoE method their own idea of the
  activation (vLLM: the layer's moe config; SGLang: gemm1_alpha /
  gemm1_clamp_limit). Both have defaulted betas in the past, so the adapters
  compare the engine's values with the model's HF config and refuse a mismatch.
- The parameter table (`EXPERT_PARAMS`), reading the loaded parameters as
  `Mxfp4Experts`, releasing the checkpoint bytes, the CUDA-graph capture guard.
- `serve_layer`: the pre-converted int4 lookup (gfx942), then the core's load.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

from kimi_k3_moe import __version__
from kimi_k3_moe.activation import HF_ACTIVATION_NAMES, SITUV2, ActivationSpec, UnsupportedActivationError
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4

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
    from kimi_k3_moe.dispatch import serving_table
    try:
        return serving_table(backend)
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
    from kimi_k3_moe.dispatch import BackendChoice, plan_backends
    from kimi_k3_moe.experts import INT4
    from kimi_k3_moe.weights.converted import find_converted

    if platform.weight_format != INT4:
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


# (name, shape as a function of E, H, I, is a scale): the parameters both engines' loaders fill
EXPERT_PARAMS = (
    ("w13_weight", lambda e, h, i: (e, 2 * i, h // 2), False),
    ("w13_weight_scale", lambda e, h, i: (e, 2 * i, h // mxfp4.BLOCK_SIZE), True),
    ("w2_weight", lambda e, h, i: (e, h, i // 2), False),
    ("w2_weight_scale", lambda e, h, i: (e, h, i // mxfp4.BLOCK_SIZE), True),
)


def param_shapes(e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {name: shape(e, h, i) for name, shape, _ in EXPERT_PARAMS}


def register_params(layer: Any, shapes: dict[str, tuple[int, ...]], *, scale_fill: int, scale_method: str,
                    set_attrs, attrs: dict[str, Any], loaders: tuple[Any, Any] | None = None) -> None:
    """Register the four uint8 parameters (codes 0, scales `scale_fill`); scales carry
    `quant_method=scale_method`, which makes the engine's loader shard them like their weights.
    `loaders` (weight, scale) are set as each parameter's `weight_loader` when given."""
    import torch

    for name, _, is_scale in EXPERT_PARAMS:
        param = torch.nn.Parameter(torch.full(shapes[name], scale_fill if is_scale else 0, dtype=torch.uint8),
                                   requires_grad=False)
        layer.register_parameter(name, param)
        set_attrs(param, attrs)
        if loaders is not None:
            set_attrs(param, {"weight_loader": loaders[1] if is_scale else loaders[0]})
        if is_scale:
            param.quant_method = scale_method


def restore_params(layer: Any, shapes: dict[str, tuple[int, ...]], *, scale_fill: int) -> None:
    """The parameters back at their shapes (for a weight update after `release_params`)."""
    import torch

    device = layer.w13_weight.device
    for name, _, is_scale in EXPERT_PARAMS:
        getattr(layer, name).data = torch.full(shapes[name], scale_fill if is_scale else 0, dtype=torch.uint8,
                                               device=device)


def layer_experts(layer: Any) -> Mxfp4Experts:
    """The layer's loaded parameters as Mxfp4Experts (no copy)."""
    return Mxfp4Experts(layer.w13_weight.data, layer.w13_weight_scale.data,
                         layer.w2_weight.data, layer.w2_weight_scale.data)


def release_params(layer: Any) -> None:
    """Drop the checkpoint bytes: the backend serves its own copy (int4, a kernel layout, unpadded experts),
    so the layer holds one copy."""
    import torch

    device = layer.w13_weight.device
    for name, _, _ in EXPERT_PARAMS:
        getattr(layer, name).data = torch.empty(0, dtype=torch.uint8, device=device)


def refuse_under_capture(routed: Any, where: str, hint: str, error: type[Exception]) -> None:
    """Engines capture decode batches in CUDA graphs; a backend that cannot run in one is refused there."""
    import torch

    if not routed.graph_safe and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise error(f"{where}: the layer is served by backend {routed.backend.describe()}, which cannot run "
                    "inside a CUDA graph capture (it picks experts with host round trips); see the log for why "
                    f"the GPU backend was refused, or {hint}")


def local_model_dir(model: str | None, revision: str | None) -> str | None:
    """The model's folder: the path the engine was given, or its Hugging Face cache snapshot."""
    if model is None or os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["*.json"])
    except Exception as exc:  # not cached, or not a hub id: only $KIMI_K3_MOE_CONVERTED can name a folder
        logger.debug("kimi-k3-moe: no local folder for model %r (%s)", model, exc)
        return None


def log_engine_keeps_once(engine: str, reason: str) -> None:
    """One line per process (every worker says it once): which path serves the K3 layers, and why."""
    key = f"{engine}:engine:{os.getpid()}"
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.info("kimi-k3-moe %s on %s: Kimi-K3 MoE layers left to the engine's own path: %s",
                __version__, engine, reason)


def serve_layer(engine: str, activation: ActivationSpec, experts: Mxfp4Experts, *, platform: Any,
                checks: Any, layer_name: str, converted: dict[str, Any] | None) -> Any:
    """A loaded `RoutedExperts` for this layer: from the pre-converted int4 checkpoint when
    `converted_source(platform, **converted)` finds one, else from `experts`."""
    from kimi_k3_moe.routed_experts import RoutedExperts

    source, plan = experts, None
    found = converted_source(platform, **converted, device=experts.device) if converted is not None else None
    if found is not None:
        source, plan, _ = found
    routed = RoutedExperts(activation, platform=platform, plan=plan, checks=checks, layer_name=layer_name)
    routed.load(source)
    log_serving_once(engine, routed.backend.describe(), activation)
    return routed
