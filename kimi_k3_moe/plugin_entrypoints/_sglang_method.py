"""The SGLang MoE method for Kimi-K3's routed experts (imported only by the hook).

SGLang's side of the contract (0.5.23, `FusedMoEMethodBase`):
- `create_weights` registers the parameters K3's `load_weights` and
  `FusedMoE.weight_loader` fill: `w13_weight` uint8 [E, 2I, H/2] (gate rows
  first, `gate_up_interleaved=False`), `w13_weight_scale` uint8 [E, 2I, H/32],
  `w2_weight` [E, H, I/2], `w2_weight_scale` [E, H, I/32]; each carries the
  layer's `weight_loader`, scales also `quant_method="group"`. E is this rank's
  experts and I this rank's slice: the loader narrows TP and maps EP.
- `process_weights_after_loading` hands the bytes to `RoutedExperts` (backend
  plan for the platform, self-check on a slice, prepare). On gfx942 a
  pre-converted int4 checkpoint, when there is one, supplies the experts
  instead (as in the vLLM adapter; `common.serve_layer`).
- `runner` stays None: `get_moe_runner_backend()` is then None, which SGLang
  reads as "a direct kernel consuming standard TopK with local ids". Its
  dispatcher then passes this rank's local expert ids with -1 for experts held
  elsewhere, which the core skips.
- `apply(layer, dispatch_output)` (called with keywords) returns
  `StandardCombineInput` holding this rank's partial sum; K3 reduces it across
  TP in latent space itself. Under `--moe-a2a-backend deepep` (normal mode) or
  `mori` it takes their dispatch outputs and returns their combine inputs
  (`_sglang_a2a.py`, which also says how the layer is made to call `apply`).

The betas come from `moe_runner_config.gemm1_alpha` (beta) and
`gemm1_clamp_limit` (linear beta) and are compared with the model's HF config
(`runtime_context.process_model_config().hf_config`, the config SGLang built
the model from) when the weights are created; a mismatch stops the load.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.loading import SelfCheckCache
from kimi_k3_moe.platform import detect_platform
from kimi_k3_moe.plugin_entrypoints import common
from kimi_k3_moe.plugin_entrypoints._sglang_a2a import (
    refuse_unserved_a2a,
    route_dispatch_through_apply,
    run_dispatched,
)
from kimi_k3_moe.plugin_entrypoints.common import engine_activation, verify_against_hf
from kimi_k3_moe.routed_experts import RoutedExperts

logger = logging.getLogger("kimi_k3_moe")

ENGINE = "sglang"
UE8M0_ONE = 127  # e8m0 byte of 2**0: unloaded scales decode to finite values, as in SGLang
GROUP_SCALE = "group"  # FusedMoeWeightScaleSupported.GROUP.value: the loader's scale path

# Runner backends whose choice reshapes the layer before or around our method:
# FlashInfer MXFP4 rounds the hidden size up to 256 and makes K3 defer the
# top-k finalize into its fused all-reduce (expecting FlashInfer's output);
# the TRT-LLM runners pad the intermediate size to 128 before create_weights.
CONFLICTING_RUNNER_BACKENDS = ("flashinfer_mxfp4", "flashinfer_trtllm", "flashinfer_trtllm_routed")


class UnsupportedSGLangSetup(RuntimeError):
    """An SGLang option or layer property this plugin cannot serve; the message names it."""


def refuse_unsupported_setup(quant_config: Any, layer: Any, prefix: str) -> None:
    """Raise for SGLang set-ups where our `apply` would be bypassed or fed another layout."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.runtime_context import get_exec

    where = f"kimi-k3-moe (SGLang MoE layer {prefix!r})"
    if not getattr(quant_config, "is_checkpoint_mxfp4_serialized", False):
        raise UnsupportedSGLangSetup(
            f"{where}: SiTU experts with an MXFP4 config that quantises online "
            "(is_checkpoint_mxfp4_serialized=False); kimi-k3-moe serves MXFP4 checkpoints only. "
            "Disable the plugin (SGLANG_PLUGINS without kimi_k3_moe) to use SGLang's own method.")
    refuse_unserved_a2a(where, UnsupportedSGLangSetup)
    runner = get_moe_runner_backend()
    if runner.value in CONFLICTING_RUNNER_BACKENDS:
        raise UnsupportedSGLangSetup(
            f"{where}: --moe-runner-backend {runner.value} pads or defers the experts' output for "
            "FlashInfer kernels (SGLang picks it by default for Kimi-K3 on SM100); pass "
            "--moe-runner-backend triton so that kimi-k3-moe's kernels serve the layer, or disable "
            "the plugin.")
    moe = get_exec().moe
    if moe.kt_weight_path is not None:
        raise UnsupportedSGLangSetup(f"{where}: --kt-weight-path (KTransformers CPU experts) wraps "
                                     "the MoE method; kimi-k3-moe does not run under it.")
    if moe.enable_paged_experts:
        raise UnsupportedSGLangSetup(f"{where}: --enable-paged-experts wraps the MoE method; "
                                     "kimi-k3-moe does not run under it.")
    config = layer.moe_runner_config
    if getattr(layer, "num_fused_shared_experts", 0):
        raise UnsupportedSGLangSetup(f"{where}: shared experts fused into the routed experts "
                                     f"(num_fused_shared_experts={layer.num_fused_shared_experts}) "
                                     "are not supported; Kimi-K3 keeps them separate.")
    if not config.is_gated or config.gate_up_interleaved:
        raise UnsupportedSGLangSetup(
            f"{where}: expects gate rows then up rows in w13 (is_gated=True, "
            f"gate_up_interleaved=False); got is_gated={config.is_gated}, "
            f"gate_up_interleaved={config.gate_up_interleaved}.")
    if config.apply_router_weight_on_input:
        raise UnsupportedSGLangSetup(f"{where}: apply_router_weight_on_input=True is not supported.")
    if config.no_combine:
        raise UnsupportedSGLangSetup(f"{where}: no_combine=True is not supported.")


def model_hf_config() -> Any:
    """The HF config SGLang built this process's model from (after any overrides)."""
    return _model_config().hf_config


def _model_config() -> Any:
    from sglang.srt.runtime_context import process_model_config

    try:
        return process_model_config()
    except Exception as exc:
        raise RuntimeError(
            "kimi-k3-moe: cannot read the model's config through SGLang "
            f"(runtime_context.process_model_config) to cross-check the SiTU betas: {exc}") from exc


class K3RoutedExpertsMethod(FusedMoEMethodBase):
    """Kimi-K3's routed experts (MXFP4 weights, SiTUv2) on kimi-k3-moe's backends."""

    self_checks = SelfCheckCache()  # this process's: every layer of one shape is checked once

    def __init__(self, prefix: str, activation: ActivationSpec):
        super().__init__()
        self.prefix = prefix
        self.activation = activation
        self.runner = None  # FusedMoE copies it to layer.runner
        self.moe_runner_config = None
        self.routed: RoutedExperts | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._released = False

    @classmethod
    def for_layer(cls, quant_config: Any, layer: Any, prefix: str) -> K3RoutedExpertsMethod:
        refuse_unsupported_setup(quant_config, layer, prefix)
        config = layer.moe_runner_config
        try:
            activation = engine_activation(config.activation, config.gemm1_alpha, config.gemm1_clamp_limit)
        except ValueError as exc:
            raise UnsupportedSGLangSetup(
                f"kimi-k3-moe (SGLang MoE layer {prefix!r}): activation {config.activation!r} with "
                f"gemm1_alpha={config.gemm1_alpha!r} (activation_situ_beta), gemm1_clamp_limit="
                f"{config.gemm1_clamp_limit!r} (activation_situ_linear_beta): {exc}") from exc
        return cls(prefix, activation)

    # ---- weights ---------------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       with_bias: bool = False, **extra_weight_attrs: Any) -> None:
        full_intermediate = extra_weight_attrs.pop("moe_intermediate_size", None)
        where = f"kimi-k3-moe (SGLang MoE layer {self.prefix!r})"
        if with_bias:
            raise UnsupportedSGLangSetup(f"{where}: expert biases (with_bias=True) are not supported; "
                                         "Kimi-K3's routed experts have none.")
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        unpadded_h = getattr(layer, "hidden_size_unpadded", h)
        tp = getattr(layer, "moe_tp_size", 1)
        if h != unpadded_h or (full_intermediate is not None and i * tp != full_intermediate):
            raise UnsupportedSGLangSetup(
                f"{where}: SGLang padded the layer (hidden {unpadded_h} -> {h}, intermediate "
                f"{full_intermediate}/{tp} -> {i}) for another runner backend; the checkpoint's "
                "unpadded layout is required.")
        if h % mxfp4.BLOCK_SIZE or i % mxfp4.BLOCK_SIZE:
            raise UnsupportedSGLangSetup(
                f"{where}: hidden size {h} and per-rank intermediate size {i} must be multiples of "
                f"the MXFP4 group ({mxfp4.BLOCK_SIZE}); choose a TP size that divides "
                f"moe_intermediate_size={full_intermediate} into such slices.")
        # The load-time cross-check: SGLang's betas against the model's config.json.
        self.activation = verify_against_hf(self.activation, model_hf_config(), where)
        self._shapes = common.param_shapes(e, h, i)
        common.register_params(layer, self._shapes, scale_fill=UE8M0_ONE, scale_method=GROUP_SCALE,
                               set_attrs=set_weight_attrs, attrs=extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        route_dispatch_through_apply(layer)
        if self._released:
            return  # already converted; the checkpoint bytes were released (see restore_...)
        experts = common.layer_experts(layer)
        model = _model_config()
        tp_size, tp_rank = getattr(layer, "moe_tp_size", 1), getattr(layer, "moe_tp_rank", 0)
        first = getattr(layer, "moe_ep_rank", 0) * experts.num_experts  # EP holds a contiguous range
        converted = dict(model_dir=common.local_model_dir(model.model_path, getattr(model, "revision", None)),
                         layer=layer.layer_id, tp_size=tp_size, tp_rank=tp_rank,
                         local_experts=range(first, first + experts.num_experts), num_experts=layer.num_experts,
                         hidden_size=experts.hidden_size, intermediate_size=experts.intermediate_size * tp_size)
        self.routed = common.serve_layer(ENGINE, self.activation, experts, platform=detect_platform(),
                                         checks=self.self_checks, layer_name=self.prefix, converted=converted)
        if not self.routed.holds_source(experts):
            self._release(layer)

    def _release(self, layer: torch.nn.Module) -> None:
        # The backend converted the experts into its own form: drop the checkpoint
        # bytes so the layer holds one copy; restore_weights_before_loading brings
        # the parameters back for a weight update.
        from sglang.srt.runtime_context import get_exec

        if get_exec().moe.enable_eplb:
            raise UnsupportedSGLangSetup(
                f"kimi-k3-moe (SGLang MoE layer {self.prefix!r}): --enable-eplb moves experts by "
                f"rewriting w13_weight/w2_weight at run time, but backend {self.routed.backend.describe()} "
                "serves a converted copy that those moves would not reach.")
        common.release_params(layer)
        self._released = True

    def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
        if not self._released:
            return
        common.restore_params(layer, self._shapes, scale_fill=UE8M0_ONE)
        self.routed, self._released = None, False

    # ---- runner ----------------------------------------------------------------------------
    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: Any) -> None:
        self.moe_runner_config = moe_runner_config
        self.runner = None

    # ---- forward ---------------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, dispatch_output: Any) -> Any:
        from sglang.srt.layers.moe.token_dispatcher import DispatchOutputChecker, StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        if self.routed is None:
            raise RuntimeError(f"kimi-k3-moe (SGLang MoE layer {self.prefix!r}): apply() before "
                               "process_weights_after_loading()")
        common.refuse_under_capture(self.routed, f"kimi-k3-moe (SGLang MoE layer {self.prefix!r})",
                                    "launch with --disable-cuda-graph.", UnsupportedSGLangSetup)
        if not DispatchOutputChecker.format_is_standard(dispatch_output):
            return run_dispatched(layer, dispatch_output, lambda x, w, ids: self._scaled(layer, self.routed(x, w, ids)),
                                  UnsupportedSGLangSetup)
        if dispatch_output.hidden_states_scale is not None:
            raise UnsupportedSGLangSetup("kimi-k3-moe: pre-quantised MoE input (hidden_states_scale) "
                                         "is not supported; the kernels take bf16 activations")
        topk_output = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise UnsupportedSGLangSetup(f"kimi-k3-moe: top-k output format {topk_output.format!r} is "
                                         "not supported (standard top-k ids and weights only)")
        out = self.routed(dispatch_output.hidden_states, topk_output.topk_weights, topk_output.topk_ids)
        return StandardCombineInput(hidden_states=self._scaled(layer, out))

    def _scaled(self, layer: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
        scale = self.moe_runner_config.routed_scaling_factor
        if scale is not None and scale != 1.0 and not layer.should_fuse_routed_scaling_factor_in_topk:
            return out * scale
        return out
