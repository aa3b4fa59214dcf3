"""Activations in the word order of the weights.

The word layout puts K = 8c + j of a BLOCK_K tile in word c, slot j. Kernels
that multiply the eight slots separately (word dots, the FMA path) want the
activations of one slot contiguous: within each BLOCK_K tile, column
k0 + 8c + j moves to k0 + j*(BLOCK_K/8) + c. `permute_words_kernel` does this
for the layer input; stage 1 writes its output in this order directly when
stage 2 reads it that way (`word_position`).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.numerics import cast_to
from kimi_k3_moe.kernels.common._details.pdl import enter
from kimi_k3_moe.kernels.triton._details.decode import to_pair_order


@triton.jit
def word_position(k, BLOCK_K: tl.constexpr):
    """Where column k lands in the word order of BLOCK_K tiles."""
    W: tl.constexpr = BLOCK_K // 8
    return (k // BLOCK_K) * BLOCK_K + (k % 8) * W + (k % BLOCK_K) // 8


@triton.jit
def permute_words_kernel(x_ptr, stride_xm, out_ptr, stride_om, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[t] = x[t] in word order (bf16); one program per (row, BLOCK_K tile)."""
    enter(PDL)
    W: tl.constexpr = BLOCK_K // 8
    t = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    c = tl.arange(0, W)
    j = tl.arange(0, 8)
    v = tl.load(x_ptr + t * stride_xm + k0 + 8 * c[:, None] + j[None, :])
    tl.store(out_ptr + t * stride_om + k0 + j[:, None] * W + c[None, :], cast_to(tl.trans(v), tl.bfloat16))


@triton.jit(do_not_specialize=["num_rows"])
def permute_pairs_kernel(x_ptr, stride_xm, out_ptr, stride_om, num_rows, K: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[t] = x[t] in pair order (bf16; decode.pair_order, its own inverse) for BLOCK_T rows x
    BLOCK_K columns per program. Inside each 32-group pair order swaps the 4 x 4 (word, pair)
    indices of K = 32g + 8q + 2p + b, so rows are read and written contiguously and the swap is
    a register permute (a gather by pair_order(k) reads 2 bytes per load: 0.8 TB/s on the H200)."""
    enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (t < num_rows)[:, None] & (k < K)[None, :]
    v = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xm + k[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_om + k[None, :], cast_to(to_pair_order(v), tl.bfloat16),
             mask=mask)
