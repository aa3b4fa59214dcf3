"""The small-batch path: no token alignment, fp32 FMA dot products.

Stage 1 runs one program per (token, slot) pair and N tile, its gate and up
rows interleaved in one tile; stage 2 one program per token and N tile with
all of the token's slots in one tile (rows = slot x N), or, under an expert
map, its local slots one at a time; summed in a fixed order in fp32
(deterministic, no atomics, no per-slot buffer). With a handful
of tokens nearly every pair has its own expert, so grouping pairs buys
nothing and its launches cost more than they save.

Weights are decoded word by word: v_j holds K = 8c + j. Stage 1 reads the
layer input as it is: each K step loads a [BLOCK_K/8, 8] tile (one 16-byte
row per word c) and splits it in registers into the eight slots j, so no
launch copies the input into word order first. Stage 2 reads the
intermediate in word order (stage 1 writes it so), where the eight slots j
are contiguous runs.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.expert_ids import local_expert
from kimi_k3_moe.kernels.common._details.numerics import cast_to
from kimi_k3_moe.kernels.common._details.pdl import let_next_start, wait_for_previous
from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import (
    WEIGHT_DECODE,
    WEIGHT_FMT,
    WEIGHT_OFFSETS,
    decode_weight_raw,
    load_weight_raw,
)
from kimi_k3_moe.kernels.triton._details.groups import ExpertWeights, SlotRouting, WeightCode, WeightTile
from kimi_k3_moe.kernels.triton._details.permute_kernels import word_position


@triton.jit
def _fma_words(acc, x_ptrs, x_mask, vs, W: tl.constexpr):
    """acc += sum_j vs[j] * x_j, x in word order: slot j's activations start at x_ptrs + j*W."""
    acc += vs[0].to(tl.float32) * tl.load(x_ptrs + 0 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[1].to(tl.float32) * tl.load(x_ptrs + 1 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[2].to(tl.float32) * tl.load(x_ptrs + 2 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[3].to(tl.float32) * tl.load(x_ptrs + 3 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[4].to(tl.float32) * tl.load(x_ptrs + 4 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[5].to(tl.float32) * tl.load(x_ptrs + 5 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[6].to(tl.float32) * tl.load(x_ptrs + 6 * W, mask=x_mask, other=0.0).to(tl.float32)
    acc += vs[7].to(tl.float32) * tl.load(x_ptrs + 7 * W, mask=x_mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _fma_plain(acc, x_row, vs, W: tl.constexpr):
    """acc += sum_j vs[j] * x_j, x in plain order from x_row (one row, K = 8c + j at x_row + 8c + j): one
    [W, 8] load, split into the eight slots j (bf16-rounded, as the word-order copy stored them)."""
    c = tl.arange(0, W)
    j = tl.arange(0, 8)
    x = tl.load(x_row + 8 * c[:, None] + j[None, :])
    x = cast_to(x, tl.bfloat16).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (W, 2, 2, 2)))   # j = 4a + 2b + (0 | 1)
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    acc += vs[0].to(tl.float32) * x0[None, :]
    acc += vs[1].to(tl.float32) * x1[None, :]
    acc += vs[2].to(tl.float32) * x2[None, :]
    acc += vs[3].to(tl.float32) * x3[None, :]
    acc += vs[4].to(tl.float32) * x4[None, :]
    acc += vs[5].to(tl.float32) * x5[None, :]
    acc += vs[6].to(tl.float32) * x6[None, :]
    acc += vs[7].to(tl.float32) * x7[None, :]
    return acc


@triton.jit
def _fma_k_loop(acc, tile, x_words, x_mask, K: tl.constexpr, code, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr, X_PLAIN: tl.constexpr = False, AHEAD: tl.constexpr = 1):
    """acc [ROWS, BLOCK_K/8] += the words of W[:, 0:K] times x (word order), decoded step by step.
    tile: the WeightTile of W's rows, code: its WeightCode (_details/groups.py). X_PLAIN: x_words is
    instead one row's pointer with x in plain order (_fma_plain; x_mask unused).

    The weight loads run AHEAD (1-4) K steps ahead of the arithmetic (they feed no dot, so the
    compiler's pipeliner leaves them alone): at 1-16 tokens a program's time is its K steps' round
    trips to memory, so what the GPU streams is about the bytes in flight over the latency (H100, Triton
    3.8, one step ahead: 1.1-1.5 TB/s for stage 1 at 1 token, 0.7 under EP16's single expert). Steps past
    the last re-read the last tile (an L2 hit) instead of masking. PDL: x is the output of the launch
    before this one, which may still be running: the first steps' weights are requested before waiting
    for it (they never depend on it)."""
    tl.static_assert(AHEAD >= 1 and AHEAD <= 4, "AHEAD: 1 to 4 K steps in flight")
    last: tl.constexpr = K - BLOCK_K
    w0, s0, o0 = load_weight_raw(tile, 0, code, BLOCK_K)
    w1, s1, o1 = w0, s0, o0
    w2, s2, o2 = w0, s0, o0
    w3, s3, o3 = w0, s0, o0
    if AHEAD >= 2:
        w1, s1, o1 = load_weight_raw(tile, min(BLOCK_K, last), code, BLOCK_K)
    if AHEAD >= 3:
        w2, s2, o2 = load_weight_raw(tile, min(2 * BLOCK_K, last), code, BLOCK_K)
    if AHEAD >= 4:
        w3, s3, o3 = load_weight_raw(tile, min(3 * BLOCK_K, last), code, BLOCK_K)
    wait_for_previous(PDL)
    for k0 in range(0, K, BLOCK_K):
        k_next = tl.minimum(k0 + AHEAD * BLOCK_K, last)
        wn, sn, on = load_weight_raw(tile, k_next, code, BLOCK_K)
        vs = decode_weight_raw(w0, s0, o0, code, ROWS, BLOCK_K)
        if X_PLAIN:
            acc = _fma_plain(acc, x_words + k0, vs, BLOCK_K // 8)
        else:
            acc = _fma_words(acc, x_words + k0, x_mask, vs, BLOCK_K // 8)
        if AHEAD == 1:
            w0, s0, o0 = wn, sn, on
        elif AHEAD == 2:
            w0, s0, o0 = w1, s1, o1
            w1, s1, o1 = wn, sn, on
        elif AHEAD == 3:
            w0, s0, o0 = w1, s1, o1
            w1, s1, o1 = w2, s2, o2
            w2, s2, o2 = wn, sn, on
        else:
            w0, s0, o0 = w1, s1, o1
            w1, s1, o1 = w2, s2, o2
            w2, s2, o2 = w3, s3, o3
            w3, s3, o3 = wn, sn, on
    return acc


@triton.jit
def stage1_gemv_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    inter_ptr, stride_im,
    ids_ptr, map_ptr,
    inter_size, hidden: tl.constexpr,
    beta, linear_beta, num_ids, num_local,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, WEIGHTS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """inter[pair, n] = act(gate . x, up . x) for one (token, slot) pair and BLOCK_N columns.

    x is the layer input in plain order (any float dtype, rounded to bf16 as it is read; hidden a
    multiple of BLOCK_K); inter is written in word order of OUT_BLOCK_K
    tiles (stage 2's), or in plain order when OUT_BLOCK_K is 0. WEIGHTS: _details/constants.py. AHEAD: K
    steps of weights in flight (_fma_k_loop). PDL: see common/_details/pdl.py; the first weights are requested
    before the wait."""
    let_next_start(PDL)
    code: tl.constexpr = WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS])
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = local_expert(tl.load(ids_ptr + pair), map_ptr, num_ids, num_local, HAS_MAP)
    if e < 0:
        return  # expert on another rank: stage 2 skips this slot too
    e64 = e.to(tl.int64)
    tok = (pair // TOPK).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r // 2          # rows alternate gate n, up n
    w_row = n + (r % 2) * inter_size
    mask_r = (n < inter_size)[:, None]
    w_rows = w_ptr + e64 * stride_we + w_row[:, None].to(tl.int64) * stride_wn
    so = e64 * stride_se + w_row[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((2 * BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    acc = _fma_k_loop(acc, WeightTile(w_rows, s_ptr + so, o_ptr + so, mask_r), x_ptr + tok * stride_xm, None, hidden,
                      code, 2 * BLOCK_N, BLOCK_K, PDL, True, AHEAD)
    gate, up = tl.split(tl.reshape(tl.sum(acc, axis=1), (BLOCK_N, 2)))
    h = apply_activation(gate, up, beta, linear_beta, ACT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if OUT_BLOCK_K > 0:
        dest = word_position(offs_n, OUT_BLOCK_K)
    else:
        dest = offs_n
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + dest, cast_to(h, inter_ptr.dtype.element_ty),
             mask=offs_n < inter_size)


@triton.jit
def stage2_gemv_kernel(
    inter_ptr, stride_im,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    out_ptr, stride_om,
    ids_ptr, map_ptr, topk_w_ptr,
    hidden, inter_size: tl.constexpr, num_ids, num_local,
    TOPK: tl.constexpr, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, n] = sum over slots of router_weight * (W2_e[n] . inter[pair]), fp32, fixed order.

    inter is in word order of BLOCK_K tiles. Without an expert map one tile holds every slot of the
    token (rows = SLOTS x BLOCK_N, SLOTS = TOPK rounded up to a power of two), so all of the token's
    experts stream at once; with one (HAS_MAP), the local slots are taken one at a time.
    WEIGHTS: _details/constants.py. AHEAD: K steps of weights in flight (_fma_k_loop). PDL: see
    _details/pdl.py; without a map the first weights are requested before the wait.
    """
    let_next_start(PDL)
    code: tl.constexpr = WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS])
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if HAS_MAP:
        # under expert parallelism most of a token's slots live on other ranks: one slot at a time,
        # skipping those, instead of decoding (masked) tiles for all of them
        wait_for_previous(PDL)
        _stage2_gemv_local_slots(t, pid_n,
                                 ExpertWeights(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, o_ptr),
                                 SlotRouting(ids_ptr, map_ptr, topk_w_ptr, num_ids, num_local), inter_ptr, stride_im,
                                 out_ptr, stride_om, hidden, inter_size, TOPK, code, BLOCK_N, BLOCK_K, AHEAD)
        return
    r = tl.arange(0, SLOTS * BLOCK_N)
    slot = r // BLOCK_N
    n = pid_n * BLOCK_N + r % BLOCK_N
    pair = t * TOPK + slot
    e = local_expert(tl.load(ids_ptr + pair, mask=slot < TOPK, other=-1), map_ptr, num_ids, num_local, False)
    here = (e >= 0) & (n < hidden)
    e64 = tl.maximum(e, 0).to(tl.int64)
    w_rows = w_ptr + e64[:, None] * stride_we + n[:, None].to(tl.int64) * stride_wn
    so = e64[:, None] * stride_se + n[:, None].to(tl.int64) * stride_sn
    cw = tl.arange(0, BLOCK_K // 8)
    x_words = inter_ptr + pair[:, None] * stride_im + cw[None, :]
    x_mask = here[:, None] & (cw[None, :] >= 0)
    acc = tl.zeros((SLOTS * BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    acc = _fma_k_loop(acc, WeightTile(w_rows, s_ptr + so, o_ptr + so, here[:, None]), x_words, x_mask, inter_size,
                      code, SLOTS * BLOCK_N, BLOCK_K, PDL, False, AHEAD)
    gate = tl.load(topk_w_ptr + pair, mask=slot < TOPK, other=0.0).to(tl.float32)
    per_row = tl.where(here, tl.sum(acc, axis=1) * gate, 0.0)
    total = tl.sum(tl.reshape(per_row, (SLOTS, BLOCK_N)), axis=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t * stride_om + offs_n, cast_to(total, out_ptr.dtype.element_ty), mask=offs_n < hidden)


@triton.jit
def _stage2_gemv_local_slots(t, pid_n, weights, routing, inter_ptr, stride_im, out_ptr, stride_om, hidden,
                             inter_size: tl.constexpr, TOPK: tl.constexpr, code, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    """stage2_gemv_kernel with an expert map: the token's slots in order, fp32, those of other ranks skipped.
    weights: ExpertWeights, routing: SlotRouting, code: WeightCode (_details/groups.py)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (n < hidden)[:, None]
    cw = tl.arange(0, BLOCK_K // 8)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(TOPK):
        pair = t * TOPK + slot
        e = local_expert(tl.load(routing.ids + pair), routing.map, routing.num_ids, routing.num_local, True)
        if e >= 0:
            e64 = e.to(tl.int64)
            w_rows = weights.w + e64 * weights.stride_we + n[:, None].to(tl.int64) * weights.stride_wn
            so = e64 * weights.stride_se + n[:, None].to(tl.int64) * weights.stride_sn
            acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            acc = _fma_k_loop(acc, WeightTile(w_rows, weights.s + so, weights.o + so, mask_n),
                              inter_ptr + pair * stride_im + cw[None, :], cw[None, :] >= 0, inter_size, code,
                              BLOCK_N, BLOCK_K, False, False, AHEAD)
            total += tl.sum(acc, axis=1) * tl.load(routing.topk_w + pair).to(tl.float32)
    tl.store(out_ptr + t * stride_om + n, cast_to(total, out_ptr.dtype.element_ty), mask=n < hidden)
