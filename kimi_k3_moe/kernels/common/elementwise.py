"""Flat elementwise launches around an fp32-atomic stage 2: zero its accumulator, then cast it."""
from __future__ import annotations

import torch

from kimi_k3_moe.kernels.common._details.elementwise_kernels import cast_kernel, zero_kernel
from kimi_k3_moe.kernels.common.launch import Launch, cdiv

ELEMENTWISE_BLOCK = 1024


def zero_fill(buf: torch.Tensor) -> Launch:
    """buf (contiguous) = 0: the fp32 accumulator an atomic stage 2 adds into."""
    n = buf.numel()
    return Launch(zero_kernel, (cdiv(n, ELEMENTWISE_BLOCK),), dict(ptr=buf, n=n, BLOCK=ELEMENTWISE_BLOCK),
                  4, 1, "stage2.zero")


def cast_copy(src: torch.Tensor, out: torch.Tensor) -> Launch:
    """out = src in out's dtype, element by element (both contiguous, same element count)."""
    if src.numel() != out.numel() or not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"cast_copy: {tuple(src.shape)} -> {tuple(out.shape)} needs two contiguous tensors "
                         "of one element count")
    n = src.numel()
    return Launch(cast_kernel, (cdiv(n, ELEMENTWISE_BLOCK),), dict(src_ptr=src, dst_ptr=out, n=n,
                                                                    BLOCK=ELEMENTWISE_BLOCK), 4, 1, "stage2.cast")
