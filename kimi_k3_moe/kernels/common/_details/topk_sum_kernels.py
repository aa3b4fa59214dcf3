"""The deterministic top-k sum: each token's slot rows added in slot order, in fp32."""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.expert_ids import local_expert_at
from kimi_k3_moe.kernels.common._details.numerics import cast_to
from kimi_k3_moe.kernels.common._details.pdl import enter


@triton.jit
def topk_reduce_kernel(y_ptr, stride_ym, local_ptr, map_ptr, out_ptr, stride_om, hidden, num_ids, num_local,
                       TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over slots s (in slot order, fp32) of y[t*TOPK + s]; absent slots add nothing.
    local: each pair's local expert (-1: not on this rank), or its global one through map (HAS_MAP)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < hidden
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        e = local_expert_at(local_ptr, map_ptr, t * TOPK + s, num_ids, num_local, HAS_MAP)
        v = tl.load(y_ptr + (t * TOPK + s) * stride_ym + offs, mask=mask & ((offs * 0 + e) >= 0), other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, cast_to(acc, out_ptr.dtype.element_ty), mask=mask)
