"""Rounding helpers that behave the same compiled and interpreted.

Triton 3.9's interpreter truncates fp32 -> bf16 (even when asked for rtne) and
multiplies bf16 dot operands as raw bits; compiled kernels round to nearest
even and multiply values. Under the interpreter these helpers take the exact
route instead, so CPU tests see the numerics the GPU has.
"""
import os

import triton
import triton.language as tl

INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def to_bf16(x):
    """fp32 -> bf16, round to nearest even."""
    if INTERPRETER:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    if DTYPE == tl.bfloat16:
        return to_bf16(x.to(tl.float32))
    else:
        return x.to(DTYPE)


@triton.jit
def dot_operand(x):
    """bf16 operand for tl.dot (fp32 under the interpreter; exact, values are bf16)."""
    if INTERPRETER:
        return x.to(tl.float32)
    else:
        return x
