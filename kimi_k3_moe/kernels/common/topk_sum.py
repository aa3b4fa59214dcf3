"""The deterministic top-k sum after stage 2: one token's slot rows summed in slot order."""
from __future__ import annotations

import torch

from kimi_k3_moe.kernels.common._details.topk_sum_kernels import topk_reduce_kernel
from kimi_k3_moe.kernels.common.alignment import AlignedPairs
from kimi_k3_moe.kernels.common.launch import Launch, cdiv, next_pow2

REDUCE_BLOCK = 512


def topk_reduce(y: torch.Tensor, pairs: AlignedPairs, out: torch.Tensor, topk: int) -> Launch:
    """out[t] = the sum of y over t's top-k slots, in slot order, fp32 (absent slots add nothing)."""
    hidden = y.shape[1]
    block = min(REDUCE_BLOCK, next_pow2(hidden))
    emap = pairs.expert_map if pairs.direct else None  # aligned pairs' `local` has it applied
    return Launch(topk_reduce_kernel, (out.shape[0], cdiv(hidden, block)), dict(
        y_ptr=y, stride_ym=y.stride(0), local_ptr=pairs.local, map_ptr=pairs.local if emap is None else emap,
        out_ptr=out, stride_om=out.stride(0), hidden=hidden, TOPK=topk, HAS_MAP=emap is not None,
        num_ids=pairs.num_ids if pairs.direct else pairs.num_experts, num_local=pairs.num_experts,
        BLOCK_N=block, PDL=False), 4, 1, "stage2.reduce")
