"""The truth every kernel is compared with: the routed-expert MoE in float.

out[t] = sum over slots s of topk_weights[t, s] * W2_e(act(W13_e x_t)), with
e = topk_ids[t, s]. Expert weights are dequantised one expert at a time, so
memory stays at one expert's float weights, whatever the layer size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kimi_k3_moe.act_quant import ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.formats import mxfp4

# expert index (local) -> float weights: w13 [2I, H] or w2 [H, I]
WeightFn = Callable[[int], torch.Tensor]


def local_slots(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """Local expert id per (token, slot); -1 where the expert is not on this rank.

    Negative ids already mean "elsewhere" (SGLang's dispatcher hands over local
    ids with -1 for remote experts); they stay -1 with or without a map rather
    than wrapping around to the map's last entry.
    """
    ids = topk_ids.long()
    if expert_map is None:
        return ids.clamp_min(-1)
    mapped = expert_map.to(ids.device).long()[ids.clamp_min(0)]
    return torch.where(ids < 0, torch.full_like(mapped, -1), mapped)


def dense_moe(
    hidden: torch.Tensor,
    w13_of: WeightFn,
    w2_of: WeightFn,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: ActivationSpec,
    expert_map: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    act_quant: ActQuant | None = None,
) -> torch.Tensor:
    """The MoE over experts given as float weight callables; output in hidden's dtype.

    `act_quant` rounds the activations where quantized-activation kernels do: the
    hidden rows once (stage-1 input) and each expert's activated intermediate
    (stage-2 input), through the formats' CPU quantizers; None or bf16 leaves them.
    """
    check_routing(hidden, topk_weights, topk_ids)
    local = local_slots(topk_ids, expert_map)
    act_quant = act_quant or ActQuant()
    x = act_quant.fake_quant(hidden.to(compute_dtype), "hidden")
    out = torch.zeros_like(x)
    for expert in torch.unique(local[local >= 0]).tolist():
        token_idx, slot_idx = torch.nonzero(local == expert, as_tuple=True)
        w13 = w13_of(expert).to(compute_dtype)
        w2 = w2_of(expert).to(compute_dtype)
        inter = act_quant.fake_quant(activation.apply(x[token_idx] @ w13.T), "inter")
        y = (inter @ w2.T) * topk_weights[token_idx, slot_idx].to(compute_dtype).unsqueeze(1)
        out.index_add_(0, token_idx, y)
    return out.to(hidden.dtype)


def moe_forward(
    hidden: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: ActivationSpec,
    expert_map: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    act_quant: ActQuant | None = None,
) -> torch.Tensor:
    """The MoE on MXFP4 experts ([E, 2I, H/2], [E, 2I, H/32], [E, H, I/2], [E, H, I/32]).

    `expert_map` (global id -> local id, -1 = elsewhere) makes this the
    rank's partial sum over the experts it holds. `act_quant` as in `dense_moe`.
    """
    return dense_moe(
        hidden,
        lambda e: mxfp4.dequantize(w13_packed[e], w13_scale[e], name=f"w13[{e}]"),
        lambda e: mxfp4.dequantize(w2_packed[e], w2_scale[e], name=f"w2[{e}]"),
        topk_weights, topk_ids, activation, expert_map,
        compute_dtype=compute_dtype, act_quant=act_quant,
    )


def check_routing(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} does not match "
                         f"{hidden.shape[0]} tokens")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != "
                         f"topk_ids shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))
