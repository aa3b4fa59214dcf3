"""The truth every kernel is compared with: the routed-expert MoE in float.

out[t] = sum over slots s of topk_weights[t, s] * W2_e(act(W13_e x_t)), with
e = topk_ids[t, s]. Expert weights are dequantised one expert at a time, so
memory stays at one expert's float weights, whatever the layer size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.act_quant import ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.formats import mxfp4

# expert index (local) -> float weights: w13 [2I, H] or w2 [H, I]
WeightFn = Callable[[int], torch.Tensor]


HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: the reference's own checks
ID_DTYPES = (torch.int32, torch.int64)


def local_slots(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int | None = None
) -> torch.Tensor:
    """Local expert id per (token, slot); -1 where the expert is not on this rank.

    Negative ids already mean "elsewhere" (SGLang's dispatcher hands over local
    ids with -1 for remote experts); they stay -1 with or without a map rather
    than wrapping around to the map's last entry. So does an id at or past the
    map's length (without a map: past `num_experts`, when given) and a map entry
    outside [0, num_experts): the rule the Triton kernels apply
    (kernels/common/_details/expert_ids.py), so that no id value can index
    outside the experts, here or there, and both compute the same sum.
    """
    ids = topk_ids.long()
    num_ids = num_experts if expert_map is None else expert_map.numel()
    inside = ids >= 0
    if num_ids is not None:
        inside &= ids < num_ids
    if expert_map is None:
        local = ids
    elif expert_map.numel() == 0:
        local = torch.full_like(ids, -1)
    else:
        local = expert_map.to(ids.device).long()[torch.where(inside, ids, 0)]
    inside &= local >= 0
    if num_experts is not None:
        inside &= local < num_experts
    return torch.where(inside, local, torch.full_like(local, -1))


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
    num_experts: int | None = None,
    hidden_size: int | None = None,
) -> torch.Tensor:
    """The MoE over experts given as float weight callables; output in hidden's dtype.

    `act_quant` rounds the activations where quantized-activation kernels do: the
    hidden rows once (stage-1 input) and each expert's activated intermediate
    (stage-2 input), through the formats' CPU quantizers; None or bf16 leaves them.
    `num_experts` (the local experts' count) and `hidden_size`, when given, bound
    the ids and the hidden width (check_routing; ids outside contribute nothing).
    """
    check_routing(hidden, topk_weights, topk_ids, hidden_size=hidden_size, num_experts=num_experts,
                  expert_map=expert_map)
    local = local_slots(topk_ids, expert_map, num_experts)
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
        compute_dtype=compute_dtype, act_quant=act_quant, num_experts=w13_packed.shape[0],
        hidden_size=w13_packed.shape[2] * 2,
    )


def check_routing(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  hidden_size: int | None = None, num_experts: int | None = None,
                  expert_map: torch.Tensor | None = None) -> None:
    """The checks every backend's forward makes before any kernel, each error naming the argument:
    shapes and dtypes of hidden, topk_weights, topk_ids and expert_map, hidden's width against
    `hidden_size`, and, with `num_experts` and KIMI_K3_MOE_CHECK_EXPERT_IDS=on, the range of the
    ids (check_expert_ids, which synchronises). Without that setting nothing here reads device
    memory: an id outside the range is "not on this rank" in every backend (local_slots)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in HIDDEN_DTYPES:
        raise TypeError(f"hidden must be bfloat16, float16, float32 or float64, got {hidden.dtype}")
    if hidden_size is not None and hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden has {hidden.shape[1]} columns; the experts take hidden size {hidden_size}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be [tokens, top_k] with {hidden.shape[0]} tokens (hidden's rows), "
                         f"got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != "
                         f"topk_ids shape {tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in ID_DTYPES):
        raise TypeError(f"expert_map must be a 1-D int32 or int64 tensor, got {expert_map.dtype} of shape "
                        f"{tuple(expert_map.shape)}")
    if num_experts is not None and settings.choice(settings.CHECK_EXPERT_IDS) == "on":
        check_expert_ids(topk_ids, num_experts, expert_map)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None) -> None:
    """ValueError naming topk_ids, the first bad id and its [token, slot], when an id is neither -1
    nor in [0, num_ids) (num_ids: the expert map's length, else `num_experts`, the experts on this
    rank), or when the map sends one outside [-1, num_experts).

    Reads the tensors on the host, so it synchronises a GPU stream; refused while a CUDA graph is
    being captured (a capture cannot read device memory). Backends call it through check_routing
    when KIMI_K3_MOE_CHECK_EXPERT_IDS=on; without it they treat such ids as not on this rank.
    """
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{settings.CHECK_EXPERT_IDS}=on reads topk_ids on the host, which a CUDA graph "
                           "capture cannot do; unset it, or run the engine eagerly (vLLM --enforce-eager)")
    ids = topk_ids.long()
    num_ids = num_experts if expert_map is None else expert_map.numel()
    where = "no expert map" if expert_map is None else f"an expert map of {num_ids} ids"
    bad = ((ids < 0) | (ids >= num_ids)) & (ids != -1)
    if bool(bad.any()):
        token, slot = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"topk_ids holds {int(ids[token, slot])} at [token {token}, slot {slot}]; an expert id "
                         f"must be in [0, {num_ids}) or -1 ({num_experts} experts on this rank, {where})")
    if expert_map is not None:
        emap = expert_map.long()
        wrong = (emap < -1) | (emap >= num_experts)
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0, 0])
            raise ValueError(f"expert_map holds {int(emap[i])} at [{i}]; a local expert id must be in "
                             f"[0, {num_experts}) or -1 (not on this rank)")


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))
