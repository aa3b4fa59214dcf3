"""out[t] = sum_k w[t, k] * y[t, k, :] in fp32, one Triton launch (the engines' top-k reduction);
with `local`, slots whose id is below 0 (another rank's expert) add nothing and their rows of y,
never written, are not read."""
from __future__ import annotations

import torch

BLOCK = 1024


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def weighted_sum_kernel(y_ptr, w_ptr, local_ptr, out_ptr, H, K: tl.constexpr, HAS_LOCAL: tl.constexpr,
                            BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(K):
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            keep = mask
            if HAS_LOCAL:
                keep = keep & ((offs * 0 + tl.load(local_ptr + t * K + k)) >= 0)
            y = tl.load(y_ptr + (t.to(tl.int64) * K + k) * H + offs, mask=keep, other=0.0)
            acc += w * y.to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    return weighted_sum_kernel


_KERNEL = None


def weighted_topk_sum(y: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                      local: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, K, H] (contiguous), weights [T, K] -> out [T, H]; local [T, K]: each slot's local expert."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    t, k, h = y.shape
    if t:
        w = weights.contiguous()
        _KERNEL[(t, -(-h // BLOCK))](y, w, w if local is None else local.contiguous(), out, h, K=k,
                                     HAS_LOCAL=local is not None, BLOCK=BLOCK)
    return out
