"""A decode-only kernel: checks the in-register decoders against the formats' own decoders."""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.numerics import cast_to
from kimi_k3_moe.kernels.triton._details.decode import (
    WEIGHT_DECODE,
    WEIGHT_FMT,
    WEIGHT_OFFSETS,
    load_weight_pairs,
    load_weight_tile,
    pair_order,
    word_k_offsets,
)
from kimi_k3_moe.kernels.triton._details.groups import WeightCode, WeightTile


@triton.jit
def decode_probe_kernel(w_ptr, s_ptr, o_ptr, out_ptr, rows, K,
                        WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr):
    """out[r, k] = decoded weight (bf16 -> fp32) of rows [pid*BLOCK_N, ...) of a [rows, K] matrix,
    through the pair-order tile (PAIRS) or the two regrouped halves. WEIGHTS: _details/constants.py."""
    code: tl.constexpr = WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS])
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (n < rows)[:, None]
    w_rows = w_ptr + n[:, None].to(tl.int64) * (K // 2)
    s_rows = s_ptr + n[:, None].to(tl.int64) * (K // 32)
    o_rows = o_ptr + n[:, None].to(tl.int64) * (K // 32)
    tile = WeightTile(w_rows, s_rows, o_rows, mask)
    ka = word_k_offsets(BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        out = out_ptr + n[:, None].to(tl.int64) * K + k0
        if PAIRS:
            t = load_weight_pairs(tile, k0, code, BLOCK_N, BLOCK_K)
            tl.store(out + pair_order(tl.arange(0, BLOCK_K))[None, :], cast_to(t, tl.float32), mask=mask)
        else:
            wa, wb = load_weight_tile(tile, k0, code, BLOCK_N, BLOCK_K)
            tl.store(out + ka[None, :], cast_to(wa, tl.float32), mask=mask)
            tl.store(out + 4 + ka[None, :], cast_to(wb, tl.float32), mask=mask)
