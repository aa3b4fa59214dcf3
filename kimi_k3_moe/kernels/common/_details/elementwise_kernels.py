"""Flat elementwise kernels for the FlyDSL forward's fp32-atomic reduction: zero the accumulator
before stage 2 adds into it, then convert it to the output's dtype (no PyTorch op between launches)."""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.numerics import cast_to


@triton.jit
def zero_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros((BLOCK,), dtype=ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def cast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, cast_to(tl.load(src_ptr + offs, mask=mask, other=0.0), dst_ptr.dtype.element_ty),
             mask=mask)
