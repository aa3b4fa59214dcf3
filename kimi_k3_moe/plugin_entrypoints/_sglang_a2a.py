"""SGLang's all-to-all dispatch (DeepEP normal mode, MoRI) into the plugin's MoE method.

What SGLang 0.5.23 does with `--moe-a2a-backend deepep|mori` (read from its source):
- K3's routed experts become `DeepEPMoE` (MoRI EPv2: `FusedMoE`) with a dispatcher that moves
  tokens between EP ranks. `DeepEPMoE.run_moe_core` calls its own DeepGEMM/CUTLASS paths unless
  its `deprecate_flag` is set; with the flag it calls the quant method's `apply(layer,
  dispatch_output)` and the dispatcher's combine takes what `apply` returns. `DeepEPMoE` decides
  the flag after asking for the method, so the method sets it when the weights are processed
  (`route_dispatch_through_apply`), before any forward.
- DeepEP normal: `DeepEPNormalDispatchOutput` with the received tokens (one row per token that has
  at least one expert here), int64 local expert ids with -1 for experts on other ranks, fp32
  weights and per-expert counts on the host. The combine sums the rows' outputs across ranks, so
  the experts return each row's weighted sum over its local experts: what the kernels compute,
  skipping -1. DeepEP's low-latency mode (and `auto`, which uses it for decode) hands over a
  batched per-expert layout the kernels do not take: refused.
- MoRI (normal, low-latency, EPv2): a capacity buffer of received rows with int32 *global* ids,
  the count of valid rows as a device tensor and an optional row cap (`recv_cap`); rows at or
  past the count are never read by the combine. Here the ids become local ones with -1 for other
  ranks' experts and for rows past the count, on the device (no host sync inside a CUDA graph).
- Dispatch in bf16: DeepEP's dispatcher quantises to fp8 by default on NVIDIA; the method asks it
  for bf16 (`set_quant_config`), and a dispatch dtype forced to something else is refused.
"""
from __future__ import annotations

from typing import Any

import torch

BF16_OR_DEFAULT = ("", "auto", "bf16")
_OTHERWISE = ("use --moe-a2a-backend deepep with --deepep-mode normal (NVIDIA), mori (AMD) or none, or disable "
              "the plugin (SGLANG_PLUGINS without kimi_k3_moe)")


def refuse_unserved_a2a(where: str, error: type[Exception]) -> None:
    """One line when the all-to-all backend would bypass the method or hand it a layout it does not take."""
    from sglang.srt.layers.moe.utils import DeepEPMode, get_deepep_mode, get_moe_a2a_backend

    a2a = get_moe_a2a_backend()
    if a2a.is_none():
        return
    if a2a.is_deepep():
        mode = get_deepep_mode()
        if mode != DeepEPMode.NORMAL:
            raise error(f"{where}: --moe-a2a-backend deepep with --deepep-mode {mode.value}: DeepEP's low-latency "
                        "mode (used by auto for decode) hands the experts a batched per-expert layout "
                        "([local experts, max tokens, hidden] with masked counts) that kimi-k3-moe's kernels do "
                        f"not take; pass --deepep-mode normal, or {_OTHERWISE}.")
        if not _deepep_normal_combine_runs():
            raise error(f"{where}: --moe-a2a-backend deepep: SGLang's DeepEP normal-mode combine runs only with "
                        "DeepGEMM JIT enabled (NVIDIA SM90+, sgl-deep-gemm installed, SGLANG_ENABLE_JIT_DEEPGEMM "
                        f"not off) or SGLANG_USE_AITER=1 on ROCm; {_OTHERWISE}.")
        dtype = _deepep_dispatch_dtype_flag()
        if dtype not in BF16_OR_DEFAULT:
            raise error(f"{where}: --deepep-dispatcher-output-dtype {dtype}: kimi-k3-moe's kernels take bf16 "
                        "tokens; leave it at auto or pass bf16.")
        return
    if a2a.is_mori():
        from sglang.srt.environ import envs

        dtype = envs.SGLANG_MORI_DISPATCH_DTYPE.get().lower()
        if dtype not in BF16_OR_DEFAULT:
            raise error(f"{where}: SGLANG_MORI_DISPATCH_DTYPE={dtype}: kimi-k3-moe's kernels take bf16 tokens; "
                        "unset it or set bf16.")
        return
    raise error(f"{where}: --moe-a2a-backend {a2a.value} moves tokens with its own all-to-all and runs expert "
                f"kernels that bypass the MoE method's apply(); {_OTHERWISE}.")


def _deepep_normal_combine_runs() -> bool:
    # _DeepEPDispatcherImplNormal.combine_a raises NotImplementedError outside these three cases.
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.utils import get_bool_env_var, is_hip, is_npu

    return bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM or (get_bool_env_var("SGLANG_USE_AITER") and is_hip())
                or is_npu())


def _deepep_dispatch_dtype_flag() -> str:
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec

    if envs.SGLANG_DEEPEP_BF16_DISPATCH.get():
        return "bf16"
    return str(getattr(get_exec().moe, "deepep_dispatcher_output_dtype", "auto") or "auto").lower()


def route_dispatch_through_apply(layer: Any) -> None:
    """Make the layer's forward reach the method's apply() and its dispatcher move bf16 tokens."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    a2a = get_moe_a2a_backend()
    if a2a.is_none():
        return
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE

    if isinstance(layer, DeepEPMoE):
        layer.deprecate_flag = True  # run_moe_core -> FusedMoE.run_moe_core -> quant_method.apply
    # DeepEP: the default would be fp8 dispatch. MoRI: no weight dtype keeps bf16 (EPv2 builds its op here).
    layer.dispatcher.set_quant_config({"dispatcher_output_dtype": "bf16"} if a2a.is_deepep() else {})


def is_mori_output(dispatch_output: Any) -> bool:
    # MoRI's outputs keep the sender's ids for its combine; DeepEP's do not.
    return hasattr(dispatch_output, "origin_topk_ids")


def mori_local_ids(dispatch_output: Any, rows: int, first_expert: int, num_local: int,
                   error: type[Exception] = ValueError) -> torch.Tensor:
    """Local expert ids of the first `rows` received rows: -1 for other ranks' experts and rows past the count."""
    ids = dispatch_output.topk_ids[:rows].long()
    count = dispatch_output.num_recv_tokens_per_expert
    if not torch.is_tensor(count) or count.numel() != 1:
        raise error("kimi-k3-moe: MoRI dispatch gave no received-row count (num_recv_tokens_per_expert="
                         f"{count!r}); valid rows of its capacity buffer cannot be told from stale ones")
    local = ids - first_expert
    row = torch.arange(rows, device=ids.device).unsqueeze(1)
    valid = (local >= 0) & (local < num_local) & (row < count.reshape(1, 1).to(device=ids.device, dtype=row.dtype))
    return torch.where(valid, local, torch.full_like(local, -1))


def run_dispatched(layer: Any, dispatch_output: Any, experts, error: type[Exception]) -> Any:
    """`experts(hidden, weights, local ids)` on a DeepEP-normal or MoRI dispatch output; the combine input back.

    `experts` returns each row's router-weighted sum over this rank's experts (rows whose ids are
    all -1 give zeros).
    """
    if dispatch_output.hidden_states_scale is not None:
        raise error("kimi-k3-moe: the all-to-all delivered quantised tokens (hidden_states_scale set); the "
                         "kernels take bf16 tokens: leave the dispatch dtype at bf16")
    hidden, weights = dispatch_output.hidden_states, dispatch_output.topk_weights
    if is_mori_output(dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher.moriep import MoriEPLLCombineInput, MoriEPNormalCombineInput

        cap = dispatch_output.recv_cap
        rows = cap if 0 < cap < hidden.shape[0] else hidden.shape[0]
        ids = mori_local_ids(dispatch_output, rows, layer.moe_ep_rank * layer.num_local_experts,
                             layer.num_local_experts, error)
        out = _rows_out(experts, hidden[:rows], weights[:rows], ids).to(dispatch_output.out_dtype)
        combine = MoriEPNormalCombineInput if dispatch_output.format.is_deepep_normal() else MoriEPLLCombineInput
        return combine(hidden_states=out, topk_ids=dispatch_output.origin_topk_ids,
                       topk_weights=dispatch_output.origin_topk_weights)
    if not dispatch_output.format.is_deepep_normal():
        raise error(f"kimi-k3-moe: dispatch format {dispatch_output.format!r} (DeepEP low-latency's batched "
                         "layout) is not supported; serve with --deepep-mode normal")
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPNormalCombineInput

    ids = dispatch_output.topk_ids  # local already, -1 for experts on other ranks
    out = _rows_out(experts, hidden, weights, ids)
    return DeepEPNormalCombineInput(hidden_states=out, topk_ids=ids, topk_weights=weights)


def _rows_out(experts, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # A rank can receive no rows at all; the kernels are not launched on an empty batch.
    return experts(hidden, weights, ids) if hidden.shape[0] else hidden.new_zeros(hidden.shape)
