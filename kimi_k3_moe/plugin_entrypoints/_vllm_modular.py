"""The plugin's vLLM MoE method as a modular kernel (vLLM 0.33's `FusedMoEKernel`).

vLLM's runner sends a MoE method without a modular kernel down its legacy
path when DP > 1 (`MoERunner.do_naive_dispatch_combine`), which asks the EP
group for `dispatch_router_logits`: only the default all-gather /
reduce-scatter manager has it, so every all-to-all backend died in the
profiling run. With a kernel, vLLM's own prepare/finalize for the parallel
config moves the tokens and `K3ModularExperts` runs the routed experts on
what arrives:

- no DP: `MoEPrepareAndFinalizeNoDPEPModular` (nothing moves);
- DP, default backend (`allgather_reducescatter`), with or without EP: the
  naive DP/EP prepare/finalize all-gathers the tokens with their top-k and
  reduce-scatters the outputs;
- DeepEP high-throughput: int64 global ids (vLLM rewrites DeepEP's -1 to an
  expert of another rank), `layer.expert_map` picks this rank's slots;
- MoRI (high-throughput and low-latency): a capacity buffer of received
  tokens with int32 global ids and the count of valid rows on the device
  (`expert_tokens_meta.expert_num_tokens`); rows at or past it are never
  read: their slots become -1 before the kernels see them, on the device,
  so nothing syncs with the host inside a CUDA graph.

The experts return the router-weighted top-k sum per token (the kernels'
stage 2 applies the weights), so the finalize step gets `TopKWeightAndReduceNoOP`.
The quantization config is weight-only (MXFP4 weights, no activation
quantization): tokens travel in bf16 through every backend.

Backends whose token layout the kernels do not take are refused when the
layer is built (`refuse_unserved_all2all`), in one line naming the backend
and what to use instead.
"""
from __future__ import annotations

from typing import Any

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig, mxfp4_w4a16_moe_quant_config
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from kimi_k3_moe.reference import local_slots
from kimi_k3_moe.routed_experts import RoutedExperts

# all2all backend -> why the plugin does not serve it and what to use instead
SERVED_ALL2ALL = ("allgather_reducescatter", "deepep_high_throughput", "mori_high_throughput", "mori_low_latency")
_INSTEAD = ("use --all2all-backend deepep_high_throughput (NVIDIA), mori_high_throughput (AMD) or "
            "allgather_reducescatter")
UNSERVED_ALL2ALL = {
    "deepep_low_latency": "its batched per-expert layout ([local experts, max tokens, hidden] with device-side "
                          "counts, unweighted output) is not a layout kimi-k3-moe's kernels take",
    "nixl_ep": "it uses the same batched per-expert layout as DeepEP low-latency, which kimi-k3-moe's kernels "
               "do not take",
    "moonep": "its experts read an [E+B] weight layout of MoonEP's own",
    "deepep_v2": "its decode mode hands the experts local ids with the global offset deferred to a fused "
                 "align kernel; not wired to kimi-k3-moe",
    "flashinfer_all2allv": "FlashInfer's NVLink dispatch is paired with FlashInfer's own expert kernels",
    "flashinfer_nvlink_two_sided": "FlashInfer's NVLink dispatch is paired with FlashInfer's own expert kernels",
    "flashinfer_nvlink_one_sided": "FlashInfer's NVLink dispatch is paired with FlashInfer's own expert kernels",
    "passthrough": "it expects experts that dispatch and combine tokens themselves",
}


def all2all_in_use(parallel: Any) -> str | None:
    """The all2all backend that moves this layer's tokens, or None when none does (no DP/EP all-to-all)."""
    if parallel.use_passthrough_all2all:
        return parallel.all2all_backend
    return parallel.all2all_backend if parallel.use_all2all_kernels else None


def refuse_unserved_all2all(moe: Any, where: str, error: type[Exception]) -> None:
    """One line when the layer's all-to-all backend hands the experts a layout the plugin does not take."""
    backend = all2all_in_use(moe.moe_parallel_config)
    if backend is None or backend in SERVED_ALL2ALL:
        return
    reason = UNSERVED_ALL2ALL.get(backend, "kimi-k3-moe has not been checked against it")
    raise error(f"{where}: --all2all-backend {backend} is not supported: {reason}; {_INSTEAD}, or disable "
                "the plugin (VLLM_PLUGINS without kimi_k3_moe)")


def weight_only_quant_config() -> FusedMoEQuantConfig:
    """MXFP4 weights, activations unquantized: prepare/finalize move bf16 tokens and no scales.

    The scales stay with the plugin's prepared experts; vLLM's prepare/finalize never read them.
    """
    return mxfp4_w4a16_moe_quant_config(w1_scale=None, w2_scale=None)


class K3ModularExperts(mk.FusedMoEExpertsModular):
    """kimi-k3-moe's routed experts in vLLM's modular-kernel interface (standard activation format)."""

    def __init__(self, moe_config: Any, quant_config: FusedMoEQuantConfig, routed: RoutedExperts,
                 guard=None):
        """`guard()` runs before every forward (the adapter's CUDA-graph capture check)."""
        super().__init__(moe_config, quant_config)
        self.routed = routed
        self.guard = guard
        # MoRI hands over a capacity buffer and the count of valid rows in it.
        self.counts_valid_rows = bool(moe_config.moe_parallel_config.use_mori_kernels)

    # ---- what the kernel declares --------------------------------------------------------
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # the backend plan picked a kernel for this device at load, or refused there

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return activation_key is None  # bf16 activations; the weights are MXFP4 or int4 in the plugin's form

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SITU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: Any) -> bool:
        backend = all2all_in_use(moe_parallel_config)
        return backend is None or backend in SERVED_ALL2ALL

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # stage 2 already weights and sums the top-k slots

    def moe_problem_size(self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
        # The plugin's prepared experts have their own layout; w1/w2 here are shape carriers.
        return (w1.shape[0], a1.size(0), w1.shape[1], a1.size(-1), topk_ids.size(1))

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: Any, activation: MoEActivation
                         ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (M, K)  # the backends allocate their own scratch

    # ---- forward -------------------------------------------------------------------------
    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation,
              global_num_experts: int, expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor, workspace2: torch.Tensor,
              expert_tokens_meta: mk.ExpertTokensMetadata | None, apply_router_weight_on_input: bool) -> None:
        if self.guard is not None:
            self.guard()
        if a1q_scale is not None:
            raise ValueError("kimi-k3-moe: the tokens arrived quantized (a1q_scale set); the kernels take bf16 "
                             "activations and the quantization config asks for none")
        if self.counts_valid_rows:
            topk_ids = self._drop_rows_past_count(topk_ids, expert_map, expert_tokens_meta)
            expert_map = None  # the ids are local now
        output.copy_(self.routed(hidden_states, topk_weights, topk_ids, expert_map))
        return None

    def _drop_rows_past_count(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                              meta: mk.ExpertTokensMetadata | None) -> torch.Tensor:
        """Local slot ids with every slot of a row at or past MoRI's received-token count set to -1.

        All on the device: the count never comes to the host, so this runs inside a CUDA graph.
        """
        count = None if meta is None else meta.expert_num_tokens
        if count is None or count.numel() != 1:
            raise ValueError("kimi-k3-moe: MoRI dispatch gave no received-token count "
                             f"(expert_num_tokens={None if count is None else tuple(count.shape)}); "
                             "rows of its capacity buffer cannot be told from valid ones")
        local = local_slots(topk_ids, expert_map, self.routed.prepared.num_experts)
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        valid = rows < count.reshape(1, 1).to(device=topk_ids.device, dtype=rows.dtype)
        return torch.where(valid, local, torch.full_like(local, -1))


def build_kernel(moe: Any, layer: Any, routed: RoutedExperts, guard=None) -> mk.FusedMoEKernel:
    """vLLM's prepare/finalize for this parallel config around `K3ModularExperts`."""
    quant_config = weight_only_quant_config()
    prepare_finalize = maybe_make_prepare_finalize(moe=moe, quant_config=quant_config,
                                                   routing_tables=layer._expert_routing_tables(),
                                                   allow_new_interface=True, use_monolithic=False)
    if prepare_finalize is None:
        raise RuntimeError(f"kimi-k3-moe: vLLM made no prepare/finalize for parallel config "
                           f"{moe.moe_parallel_config}")
    return mk.FusedMoEKernel(prepare_finalize, K3ModularExperts(moe, quant_config, routed, guard))


def shape_carriers(num_experts: int, intermediate: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (no storage) w1/w2 stand-ins for `FusedMoEKernel.apply`, which reads the local expert count
    and N from their shapes; the plugin's experts hold the real weights."""
    return (torch.empty((num_experts, 2 * intermediate, 0), dtype=torch.uint8, device=device),
            torch.empty((num_experts, 0, intermediate), dtype=torch.uint8, device=device))
