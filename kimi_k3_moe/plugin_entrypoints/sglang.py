"""SGLang entry point: Kimi-K3's routed experts through kimi-k3-moe's kernels.

SGLang calls `register()` once in every process it starts (launcher, scheduler
/ TP workers, detokenizer) through the entry-point group `sglang.srt.plugins`,
name `kimi_k3_moe`; `SGLANG_PLUGINS` (a comma list of entry-point names)
filters it. `register()` only records an AROUND hook by dotted path; SGLang's
`HookRegistry.apply_hooks()` patches `Mxfp4Config.get_quant_method` right after
all plugins ran, before any model is built.

K3's `KimiK3MoE` swaps its compressed-tensors config for
`Mxfp4Config(is_checkpoint_mxfp4_serialized=True)` itself, so that one method
is where its routed experts get their MoE method. The hook takes a `FusedMoE`
layer whose `moe_runner_config.activation` is SiTU and leaves every other
layer (SiLU MoE, linear layers) to SGLang. A SiTU layer is never handed back
to SGLang: it is served here or refused with the reason.
"""
from __future__ import annotations

import logging
from typing import Any

from kimi_k3_moe.plugin_entrypoints.common import is_situ, plugin_enabled

logger = logging.getLogger("kimi_k3_moe")

ENV_PLUGINS = "SGLANG_PLUGINS"
HOOK_TARGET = "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method"

_registered = False


def register() -> None:
    """The `sglang.srt.plugins` entry point; re-entrant and cheap (no sglang model code imported)."""
    global _registered
    if _registered:
        return  # HookRegistry does not dedupe: a second AROUND hook would wrap twice
    if not plugin_enabled(ENV_PLUGINS):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, around_get_quant_method, HookType.AROUND)
    _registered = True
    logger.debug("kimi-k3-moe: AROUND hook registered on %s", HOOK_TARGET)


def around_get_quant_method(original, quant_config, layer, prefix: str, *args: Any, **kwargs: Any):
    """`Mxfp4Config.get_quant_method` with SiTU MoE layers taken over."""
    if not _is_situ_moe(layer):
        return original(quant_config, layer, prefix, *args, **kwargs)
    from kimi_k3_moe.plugin_entrypoints._sglang_method import K3RoutedExpertsMethod

    return K3RoutedExpertsMethod.for_layer(quant_config, layer, prefix)


def _is_situ_moe(layer: Any) -> bool:
    # FusedMoE builds moe_runner_config before it asks the quant config for a
    # method, so the activation is known here. The import is free: a FusedMoE
    # instance exists, so its module is loaded.
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if not isinstance(layer, FusedMoE):
        return False
    config = getattr(layer, "moe_runner_config", None)
    return config is not None and is_situ(config.activation)
