"""vLLM entry point: Kimi-K3's routed experts through kimi-k3-moe's kernels.

vLLM calls `register()` in every process it starts (API server, engine core,
each worker, the model-registry subprocess), sometimes twice in one process,
through the entry-point group `vllm.general_plugins`, name `kimi_k3_moe`;
`VLLM_PLUGINS` (a comma list of entry-point names) filters it.

vLLM rewrites Kimi-K3's compressed-tensors `mxfp4-pack-quantized` config to
quantization method "mxfp4" before resolving it, so `register()` registers a
subclass of vLLM's `Mxfp4Config` under that name (the last registration
wins over the built-in). The subclass hands a MoE layer whose activation is
SiTU to kimi-k3-moe's method and every other layer to vLLM's own code.
"""
from __future__ import annotations

import logging

from kimi_k3_moe.plugin_entrypoints.common import plugin_enabled

logger = logging.getLogger("kimi_k3_moe")

ENV_PLUGINS = "VLLM_PLUGINS"
QUANTIZATION_NAME = "mxfp4"
VLLM_LOGGER = "vllm.kimi_k3_moe"

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point; re-entrant, and a no-op when VLLM_PLUGINS leaves us out."""
    global _registered
    if _registered:
        return
    if not plugin_enabled(ENV_PLUGINS, verbatim=True):
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config

    register_quantization_config(QUANTIZATION_NAME)(K3Mxfp4Config)
    _log_through_vllm()
    _registered = True
    logger.debug("kimi-k3-moe: %s registered as vLLM quantization %r", K3Mxfp4Config.__name__,
                 QUANTIZATION_NAME)


class _ForwardToVllm(logging.Handler):
    """Hands our records to vLLM's logger tree, so they get vLLM's handlers and format.

    vLLM configures only its own `vllm` logger; without this our INFO line
    would reach Python's last-resort handler, which drops INFO.
    """

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_LOGGER).handle(record)


def _log_through_vllm() -> None:
    import vllm.envs as envs

    ours = logging.getLogger("kimi_k3_moe")
    if not envs.VLLM_CONFIGURE_LOGGING or ours.handlers:
        return  # the user configures logging (theirs, or ours explicitly)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.DEBUG)  # vLLM's handlers apply its level (VLLM_LOGGING_LEVEL, --log-level)
    ours.addHandler(_ForwardToVllm())
    ours.propagate = False  # as vLLM's own logger: one line, not one per configured handler
