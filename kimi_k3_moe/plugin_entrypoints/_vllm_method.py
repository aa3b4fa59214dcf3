"""The vLLM MoE method for Kimi-K3's routed experts (imported by `register()`).

vLLM's side of the contract (0.33.0):
- `Mxfp4Config.get_quant_method` asks `_make_moe_method(moe)` for each
  `RoutedExperts` layer while the model is built. `moe` (FusedMoEConfig)
  carries the activation and the SiTU betas that K3's `KimiMoE` read from the
  HF config; they are checked against the model's config.json right there,
  so a mismatch stops the load before any weight is read.
- `create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
  params_dtype, weight_loader=..., unpadded_hidden_size=..., global_num_experts=...)`:
  E is this rank's experts (EP), I this rank's slice (TP). The parameters are
  the ones vLLM's loader fills: `w13_weight` uint8 [E, 2I, H/2] (gate rows
  first), `w13_weight_scale` uint8 [E, 2I, H/32], `w2_weight` [E, H, I/2],
  `w2_weight_scale` [E, H, I/32]; scales carry `quant_method="block"`, which
  makes `RoutedExperts.weight_loader` narrow them like their weights.
- At TP > 1 K3 pads I per rank up to `min_moe_intermediate_per_partition`
  (256) and leaves the padding as the method created it: the parameters
  start as zeros, so padded rows and columns hold zero codes and decode to 0.
  The prepared layer drops the padding when it is a whole number of MXFP4
  blocks (the unpadded size comes from `moe.intermediate_size_per_partition_unpadded`).
- `process_weights_after_loading` hands the bytes to `RoutedExperts` (backend
  plan for the platform, self-check on a slice, prepare). On gfx942 a
  pre-converted int4 checkpoint, when there is one, supplies the experts
  instead. The engine's MXFP4 parameters are released when the prepared form
  no longer reads them.
- After loading, the method holds a modular kernel (`_vllm_modular.py`):
  vLLM's prepare/finalize for the parallel config (none, DP all-gather /
  reduce-scatter, DeepEP high-throughput, MoRI) around the plugin's experts,
  so DP > 1 never takes the runner's legacy dispatch. All-to-all backends
  whose layout the kernels do not take are refused when the layer is built.
- `apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)`
  (keywords) gets vLLM's top-k with global expert ids and `layer.expert_map`
  (global -> local, -1 elsewhere) under EP and runs the kernel; the result is
  this rank's partial sum in x's dtype (reduced across ranks by the combine
  where the prepare/finalize says so). The runner runs the shared experts and
  does the all-reduce.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config, Mxfp4MoEMethod
from vllm.model_executor.utils import set_weight_attrs

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs import engine_verdicts
from kimi_k3_moe.configs.hf_dict import load_config_dict, text_config
from kimi_k3_moe.dispatch import aiter_situ_path, engine_keeps_layer
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.loading import SelfCheckCache
from kimi_k3_moe.platform import detect_platform
from kimi_k3_moe.plugin_entrypoints import _vllm_modular as modular
from kimi_k3_moe.plugin_entrypoints import common
from kimi_k3_moe.plugin_entrypoints.common import engine_activation, is_situ, verify_against_hf
from kimi_k3_moe.routed_experts import RoutedExperts

logger = logging.getLogger("kimi_k3_moe")

ENGINE = "vllm"
BLOCK_SCALE = "block"  # RoutedExperts.weight_loader: scale sharded like its weight


class UnsupportedVllmSetup(RuntimeError):
    """A vLLM option, layer property or model config this plugin cannot serve; the message names it."""


class K3Mxfp4Config(Mxfp4Config):
    """vLLM's MXFP4 config with SiTU MoE layers served by kimi-k3-moe."""

    def _make_moe_method(self, moe: Any) -> FusedMoEMethodBase:
        if is_situ(moe.activation):
            reason = engine_keeps_layer(detect_platform(), aiter_situ_path, layer_key(moe))
            if reason is None:
                return K3RoutedExpertsMethod.for_moe(moe)
            common.log_engine_keeps_once(ENGINE, reason)
            return super()._make_moe_method(moe)
        refuse_activation_mismatch(moe)
        return super()._make_moe_method(moe)


def layer_key(moe: Any) -> str:
    """The layer's per-rank shape as `kimi-k3-moe bench` records its verdicts (engine_verdicts)."""
    return engine_verdicts.shape_key(moe.hidden_dim, moe.intermediate_size_per_partition,
                                     moe.num_local_experts, moe.experts_per_token)


def model_config() -> Any:
    """vLLM's ModelConfig of the model being built in this process (None outside a model build)."""
    from vllm.config import get_current_vllm_config_or_none

    return getattr(get_current_vllm_config_or_none(), "model_config", None)


def refuse_activation_mismatch(moe: Any) -> None:
    """A non-SiTU layer goes to vLLM's own method, unless the model's config says SiTU.

    That would mean vLLM built the layer with another function than the model
    was trained with; handing it on would serve that function silently.
    """
    config = model_config()
    if config is None:
        return
    try:
        hidden_act = text_config(load_config_dict(config.hf_config)).get("hidden_act")
    except ValueError:
        return  # not a config we can read: not ours to judge
    if is_situ(hidden_act):
        raise UnsupportedVllmSetup(
            f"kimi-k3-moe: vLLM built a MoE layer with activation {moe.activation!r}, but the model's "
            f"config.json says hidden_act={hidden_act!r}; refusing to serve a different function")


def refuse_latent_tail_under_dp(moe: Any, config: Any, where: str) -> None:
    """DP > 1 without expert parallelism meets a vLLM 0.33 bug in K3's `LatentMoERunner` (CUDA and CPU).

    Without EP the MoE's TP size is flattened over DP (TP x DP), while
    `_shard_up_proj_tail` (the tail for batches above
    VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD tokens) cuts the up-projection
    into that many column shards and picks one by the attention TP rank
    (0..TP-1) before the TP all-reduce: the shards of ranks TP..TP x DP-1 are
    never computed, so (DP-1)/DP of the hidden columns get no routed output.
    The ROCm runner shards by the attention TP size and is not affected.
    Served when no batch can reach that tail (the threshold at or above
    max_num_batched_tokens, the shared-experts stream on).
    """
    import vllm.envs as envs
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    parallel = moe.moe_parallel_config
    if parallel.dp_size <= 1 or parallel.use_ep or current_platform.is_rocm():
        return
    try:
        latent = text_config(load_config_dict(config.hf_config)).get("routed_expert_hidden_size") is not None
    except ValueError:
        return
    scheduler = getattr(get_current_vllm_config_or_none(), "scheduler_config", None)
    max_tokens = getattr(scheduler, "max_num_batched_tokens", None)
    threshold = envs.VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD
    if not latent or (max_tokens is not None and threshold >= max_tokens
                      and not envs.VLLM_DISABLE_SHARED_EXPERTS_STREAM):
        return
    raise UnsupportedVllmSetup(
        f"{where}: data parallel size {parallel.dp_size} without --enable-expert-parallel hits a vLLM 0.33 bug in "
        "Kimi-K3's LatentMoERunner._shard_up_proj_tail (column shards by the DP-flattened MoE TP size "
        f"{parallel.tp_size}, indexed by the attention TP rank): batches above "
        f"VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD={threshold} tokens would lose the routed output of "
        f"{parallel.dp_size - 1}/{parallel.dp_size} of the hidden columns; add --enable-expert-parallel, or set "
        f"VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD >= max_num_batched_tokens ({max_tokens}) (docs/VLLM.md)")


class K3RoutedExpertsMethod(FusedMoEMethodBase):
    """Kimi-K3's routed experts (MXFP4 weights, SiTUv2) on kimi-k3-moe's backends."""

    self_checks = SelfCheckCache()  # this process's: every layer of one shape is checked once

    def __init__(self, moe: Any, activation: ActivationSpec, model: str | None = None,
                 revision: str | None = None):
        super().__init__(moe)
        self.activation = activation
        self.model, self.revision = model, revision
        self.routed: RoutedExperts | None = None
        self.layer_name = ""
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._shape_carriers: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_moe(cls, moe: Any) -> K3RoutedExpertsMethod:
        where = "kimi-k3-moe (vLLM MoE layer)"
        try:
            activation = engine_activation(moe.activation, moe.activation_situ_beta,
                                           moe.activation_situ_linear_beta)
        except ValueError as exc:
            raise UnsupportedVllmSetup(
                f"{where}: activation {moe.activation!r} with activation_situ_beta="
                f"{moe.activation_situ_beta!r}, activation_situ_linear_beta="
                f"{moe.activation_situ_linear_beta!r}: {exc}") from exc
        config = model_config()
        if config is None:
            raise UnsupportedVllmSetup(
                f"{where}: no vLLM ModelConfig in this process to cross-check the SiTU betas "
                "against the model's config.json; build the model through vLLM's model loader")
        activation = verify_against_hf(activation, config.hf_config, where)
        if moe.has_bias:
            raise UnsupportedVllmSetup(f"{where}: expert biases (has_bias=True) are not supported; "
                                       "Kimi-K3's routed experts have none")
        modular.refuse_unserved_all2all(moe, where, UnsupportedVllmSetup)
        refuse_latent_tail_under_dp(moe, config, where)
        return cls(moe, activation, config.model, getattr(config, "revision", None))

    # ---- weights ---------------------------------------------------------------------------
    def maybe_roundup_sizes(self, hidden_size: int, intermediate_size_per_partition: int, act_dtype: torch.dtype,
                            moe_parallel_config: Any) -> tuple[int, int]:
        rounded, inter = super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                                     moe_parallel_config)
        if rounded != hidden_size:
            raise UnsupportedVllmSetup(
                f"kimi-k3-moe (vLLM MoE layer): --all2all-backend {moe_parallel_config.all2all_backend} pads the "
                f"experts' hidden size {hidden_size} to {rounded}; the checkpoint's unpadded experts are required "
                "(Kimi-K3's 3584 needs no padding)")
        return rounded, inter

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        weight_loader = extra_weight_attrs.pop("weight_loader")
        extra_weight_attrs.pop("unpadded_hidden_size", None)
        extra_weight_attrs.pop("global_num_experts", None)
        self.layer_name = getattr(layer, "layer_name", "")
        where = f"kimi-k3-moe (vLLM MoE layer {self.layer_name!r})"
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        if h % mxfp4.BLOCK_SIZE or i % mxfp4.BLOCK_SIZE:
            raise UnsupportedVllmSetup(
                f"{where}: hidden size {h} and per-rank intermediate size {i} must be multiples of the "
                f"MXFP4 block ({mxfp4.BLOCK_SIZE}); choose a tensor-parallel size that splits "
                "moe_intermediate_size into such slices")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise UnsupportedVllmSetup(f"{where}: apply_router_weight_on_input=True is not supported")
        self._shapes = common.param_shapes(e, h, i)
        # Zeros, not empty: K3's padding of I is left as created, and zero
        # codes decode to 0 under any scale.
        common.register_params(layer, self._shapes, scale_fill=0, scale_method=BLOCK_SCALE, set_attrs=set_weight_attrs,
                               attrs=extra_weight_attrs, loaders=(weight_loader, _scale_loader(weight_loader)))

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
        return modular.weight_only_quant_config()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if layer.w13_weight.numel() == 0:
            if self.routed is None:
                raise RuntimeError(f"kimi-k3-moe (vLLM MoE layer {self.layer_name!r}): parameters are "
                                   "empty but the layer was never prepared")
            return  # prepared before; the MXFP4 parameters were released then
        loaded = common.layer_experts(layer)
        experts = unpad_intermediate(loaded, self.moe.intermediate_size_per_partition_unpadded)
        moe = self.moe
        converted = dict(model_dir=common.local_model_dir(self.model, self.revision),
                         layer=layer_index(self.layer_name),
                         tp_size=moe.tp_size, tp_rank=moe.tp_rank, local_experts=local_expert_ids(layer),
                         num_experts=moe.num_experts, hidden_size=experts.hidden_size,
                         intermediate_size=experts.intermediate_size * moe.tp_size)
        self.routed = common.serve_layer(ENGINE, self.activation, experts, platform=detect_platform(),
                                         checks=self.self_checks, layer_name=self.layer_name, converted=converted)
        if not self.routed.holds_source(loaded):
            common.release_params(layer)
        self.moe_quant_config = modular.weight_only_quant_config()
        self.moe_kernel = modular.build_kernel(moe, layer, self.routed, self._refuse_under_capture)
        self._shape_carriers = modular.shape_carriers(self.routed.prepared.num_experts,
                                                      self.routed.prepared.intermediate_size, experts.device)

    # ---- forward ---------------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: Any, shared_experts_input: torch.Tensor | None
              ) -> torch.Tensor:
        if self.moe_kernel is None:
            raise RuntimeError(f"kimi-k3-moe (vLLM MoE layer {self.layer_name!r}): apply() before "
                               "process_weights_after_loading()")
        w1, w2 = self._shape_carriers
        return self.moe_kernel.apply(hidden_states=x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                                     activation=layer.activation, global_num_experts=layer.global_num_experts,
                                     expert_map=layer.expert_map, apply_router_weight_on_input=False,
                                     shared_experts=shared_experts, shared_experts_input=shared_experts_input)

    def _refuse_under_capture(self) -> None:
        common.refuse_under_capture(self.routed, f"kimi-k3-moe (vLLM MoE layer {self.layer_name!r})",
                                    "start vLLM with --enforce-eager", UnsupportedVllmSetup)


def _scale_loader(weight_loader):
    """vLLM's MXFP4 scale loader (e8m0 or float scales -> uint8 bytes), taking 4-D scales too.

    Some exports store a scale as [N, 1, K/32, 1]; vLLM's loader knows 2-D
    (one expert) and 3-D (all experts) only.
    """
    inner = Mxfp4MoEMethod.get_scale_weight_loader(weight_loader)

    def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        if loaded_weight.dim() == 4:  # the checkpoint reader's rule: [N, 1, K/32, 1] only
            loaded_weight = mxfp4.scale_as_2d(loaded_weight, weight_name)
        return inner(param, loaded_weight, weight_name, shard_id, expert_id,
                     return_success=return_success)

    return load


def unpad_intermediate(experts: Mxfp4Experts, unpadded: int | None) -> Mxfp4Experts:
    """The experts without K3's intermediate padding (copies), or `experts` itself when unpadded.

    Padding keeps whole MXFP4 blocks only when the real size is a multiple
    of 32; otherwise the zero padding stays (it contributes nothing: SiTUv2
    and SiLU are 0 at 0, and zero w2 columns add 0).
    """
    i = experts.intermediate_size
    if unpadded is None or unpadded >= i or unpadded % mxfp4.BLOCK_SIZE:
        return experts
    if unpadded <= 0:
        raise ValueError(f"intermediate_size_per_partition_unpadded={unpadded} must be > 0")

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :unpadded], t[:, i:i + unpadded]], dim=1)

    return Mxfp4Experts(rows(experts.w13_packed), rows(experts.w13_scale),
                         experts.w2_packed[:, :, :unpadded // 2].clone(),
                         experts.w2_scale[:, :, :unpadded // mxfp4.BLOCK_SIZE].clone())


def layer_index(layer_name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"cannot tell the layer number from the MoE layer name {layer_name!r}")
    return int(match.group(1))


def local_expert_ids(layer: torch.nn.Module) -> list[int]:
    """Global ids of this rank's experts, in local order."""
    expert_map = layer.expert_map
    if expert_map is None:
        return list(range(layer.local_num_experts))
    expert_map = expert_map.cpu()
    held = torch.nonzero(expert_map >= 0).flatten()
    return held[torch.argsort(expert_map[held])].tolist()
