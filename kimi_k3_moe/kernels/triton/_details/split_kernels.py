"""Stage 1 for a handful of tokens on the tensor cores, with K split across programs.

At 1-16 tokens stage 1 is a few experts' gate/up weights streamed once. The FMA GEMV decodes
each weight and multiplies it in fp32 lanes, so it runs out of issue slots before the
bytes arrive; a one-pair-per-block MMA tile (path "direct") decodes once per 16 MMA rows but,
one program per (pair, N tile), leaves most SMs idle at 1 token. Here each program takes one
(token, slot) pair, one stacked gate/up N tile (the weights as the MMA's M side, the token
padded to the 16 columns of its N side) and one of K_SPLIT equal K ranges, so every SM streams.

Each program stores its fp32 partial sums, then takes a ticket (an atomic add on the pair and
tile's counter). The program that draws the last ticket adds the K_SPLIT partials in split
order (always 0, 1, ..., so the result does not depend on which program finishes last: bitwise
repeatable), applies the activation, writes inter as stage 2 reads it, and sets the counter
back to zero, so the counters stay zero between forwards and no launch clears them
(kernels/triton/tickets.py).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.expert_ids import local_expert
from kimi_k3_moe.kernels.common._details.numerics import cast_to, dot_operand
from kimi_k3_moe.kernels.common._details.pdl import let_next_start, wait_for_previous
from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import (
    WEIGHT_DECODE,
    WEIGHT_FMT,
    WEIGHT_OFFSETS,
    load_weight_pairs,
    to_pair_order,
)
from kimi_k3_moe.kernels.triton._details.groups import WeightCode, WeightTile
from kimi_k3_moe.kernels.triton._details.matmul_kernels import inter_destination

MMA_N = tl.constexpr(16)  # the MMA's least N: the pair's token and 15 zero columns


@triton.jit
def _partial_sums(x_row, tile, k_first, code, ROWS: tl.constexpr, K_PART: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [ROWS]: the tile's rows dotted with x over K range [k_first, k_first + K_PART); x_row: the
    token's row in plain order. The weights are decoded in pair order and x swapped to it in registers."""
    cols = tl.arange(0, MMA_N)
    acc = tl.zeros((ROWS, MMA_N), dtype=tl.float32)
    for k0 in range(k_first, k_first + K_PART, BLOCK_K):
        x = cast_to(tl.load(x_row + k0 + tl.arange(0, BLOCK_K)), tl.bfloat16)
        x = to_pair_order(tl.where(cols[:, None] == 0, x[None, :], 0.0).to(tl.bfloat16))
        v = load_weight_pairs(tile, k0, code, ROWS, BLOCK_K)
        acc = tl.dot(dot_operand(v), tl.trans(dot_operand(x)), acc)
    # the padding columns hold exact zeros: the row sum is column 0
    return tl.sum(acc, axis=1)


@triton.jit
def stage1_split_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    part_ptr, ticket_ptr,
    inter_ptr, stride_im,
    ids_ptr, map_ptr,
    inter_size, hidden: tl.constexpr,
    beta, linear_beta, num_ids, num_local,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, WEIGHTS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, OUT_ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    """inter[pair, n] = act(gate . x, up . x) for one (token, slot) pair and BLOCK_N columns, its K in
    K_SPLIT parts (grid: pairs x N tiles x K_SPLIT). part_ptr: fp32 [pairs x N tiles, K_SPLIT, 2 BLOCK_N];
    ticket_ptr: int32 counters, one per (pair, N tile), zero on entry and on exit. OUT_ORDER: inter as
    stage 2 reads it (korder.stage1_args: pairs, interleaved, else the word order of
    OUT_ORDER-wide tiles). WEIGHTS: _details/constants.py. PDL: common/_details/pdl.py."""
    let_next_start(PDL)
    wait_for_previous(PDL)
    code: tl.constexpr = WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS])
    K_PART: tl.constexpr = hidden // K_SPLIT
    tl.static_assert(K_PART % BLOCK_K == 0, "K_SPLIT x BLOCK_K must divide hidden")
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    e = local_expert(tl.load(ids_ptr + pair), map_ptr, num_ids, num_local, HAS_MAP)
    if e < 0:
        return  # expert on another rank: stage 2 skips this slot too
    e64 = e.to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r % BLOCK_N      # gate rows, then the up rows of the same columns
    w_row = (n + (r // BLOCK_N) * inter_size)[:, None].to(tl.int64)
    so = e64 * stride_se + w_row * stride_sn
    tile = WeightTile(w_ptr + e64 * stride_we + w_row * stride_wn, s_ptr + so, o_ptr + so, (n < inter_size)[:, None])
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm
    sums = _partial_sums(x_row, tile, part * K_PART, code, 2 * BLOCK_N, K_PART, BLOCK_K)
    slot = pair.to(tl.int64) * tl.num_programs(1) + pid_n
    if K_SPLIT > 1:
        rows = part_ptr + slot * (K_SPLIT * 2 * BLOCK_N) + r
        tl.store(rows + part * (2 * BLOCK_N), sums)
        tl.debug_barrier()  # every thread's partials are written before the ticket releases them
        ticket = tl.atomic_add(ticket_ptr + slot, 1, sem="acq_rel")
        if ticket != K_SPLIT - 1:
            return
        sums = tl.zeros((2 * BLOCK_N,), dtype=tl.float32)
        for p in tl.static_range(K_SPLIT):  # split order, whoever finished last
            sums += tl.load(rows + p * (2 * BLOCK_N), cache_modifier=".cg")
        tl.store(ticket_ptr + slot, 0)
    gate, up = tl.split(tl.permute(tl.reshape(sums, (2, BLOCK_N)), (1, 0)))
    h = apply_activation(gate, up, beta, linear_beta, ACT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dest = inter_destination(offs_n, OUT_ORDER, False)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + dest, cast_to(h, inter_ptr.dtype.element_ty),
             mask=offs_n < inter_size)
