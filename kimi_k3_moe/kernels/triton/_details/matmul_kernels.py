"""Tiled stage-1 / stage-2 matmuls over expert-aligned row blocks, and the
deterministic top-k reduction.

The intermediate is stored per (token, slot) pair, not per aligned row, so each stage can
take its own row blocks (MoEConfig.stage2_block_m) and padding rows take no memory.

Grids are max_blocks x N tiles, N tiles fastest; programs whose block lies past the real
number of rows (known only on the device) exit at once, so a launch never
needs the host to read a count and CUDA-graph capture works.

SWAP computes W @ X^T instead of X @ W^T: with few tokens per block the weight
tile is the larger operand and fills the MMA's M dimension.

A row block is BLOCK_ROWS rows: a power-of-two main tile of BLOCK_M rows and, when TAIL_M > 0, a
smaller power-of-two tail tile that takes a second dot on the same decoded weight tile. The kernels
split BLOCK_ROWS as kernels/triton/table.row_tiles does (its BLOCK_MS have one or two bits set: the
tail is the lower one), so the config's block_m is one constexpr.
Tiles must be powers of two, but an expert's rows need not be: at 4096 tokens TP8 an expert
holds ~73 rows, which a 64 + 32 block covers in one decode with 24 % padding where one
128-row tile pads 43 % and two 64-row tiles decode its weights twice.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.numerics import cast_to, dot_operand
from kimi_k3_moe.kernels.common._details.pdl import enter
from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import (
    WEIGHT_DECODE,
    WEIGHT_FMT,
    WEIGHT_OFFSETS,
    load_weight_pairs,
    load_weight_tile,
    load_weight_words,
    pair_order,
    to_pair_order,
    word_k_offsets,
)
from kimi_k3_moe.kernels.triton._details.groups import Expert, Routing, RowTile, TileConfig, WeightCode, WeightTile
from kimi_k3_moe.kernels.triton._details.permute_kernels import word_position
from kimi_k3_moe.kernels.triton._details.row_blocks import row_block

# ORDER / OUT_ORDER (kernels/triton/korder.py): the K step helpers below take words, interleave, or any
# other order as pairs (stacked and plain-inter are pair order with another tile or load)
ORDER_WORDS = tl.constexpr(C.ORDER_WORDS)
ORDER_INTERLEAVE = tl.constexpr(C.ORDER_INTERLEAVE)
ORDER_PAIRS = tl.constexpr(C.ORDER_PAIRS)
ORDER_STACKED = tl.constexpr(C.ORDER_STACKED)
ORDER_PLAIN_INTER = tl.constexpr(C.ORDER_PLAIN_INTER)


@triton.jit
def acc_zeros(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """A zero fp32 accumulator for ROWS rows x BLOCK_N columns: [BLOCK_N, ROWS] when SWAP."""
    if SWAP:
        return tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    else:
        return tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)


@triton.jit
def _acc_dot(acc, xa, xb, wa, wb, SWAP: tl.constexpr):
    xa = dot_operand(xa)
    xb = dot_operand(xb)
    wa = dot_operand(wa)
    wb = dot_operand(wb)
    if SWAP:
        acc = tl.dot(wa, tl.trans(xa), acc)
        acc = tl.dot(wb, tl.trans(xb), acc)
    else:
        acc = tl.dot(xa, tl.trans(wa), acc)
        acc = tl.dot(xb, tl.trans(wb), acc)
    return acc


@triton.jit
def _dot1(acc, x, v, SWAP: tl.constexpr):
    x = dot_operand(x)
    v = dot_operand(v)
    if SWAP:
        acc = tl.dot(v, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(v), acc)
    return acc


@triton.jit
def _block_and_tile(n, BLOCK_N: tl.constexpr):
    """(row block, N tile) of this program: consecutive programs take the N tiles of one row block,
    so the block's activations come from HBM once and its expert's weights stay in L2 for the next
    block (measured 1-6 % faster on the H200 than row blocks first at 16-16384 tokens, both stages)."""
    tiles = tl.cdiv(n, BLOCK_N)
    pid = tl.program_id(0)
    return pid // tiles, pid % tiles


@triton.jit
def _gate_up_stacked(main, tail, expert, stride_wn, stride_sn, pid_n, inter_size, hidden: tl.constexpr, cfg):
    """Stage 1's K loop on one [2 x BLOCK_N] tile (gate rows, then the up rows of the same columns):
    one dot per K step on the pair order (a second on the tail rows). Returns the gate and up sums of
    the main rows, each [BLOCK_M, BLOCK_N], and of the tail rows (the main ones again if TAIL_M is 0).
    main, tail: RowTile; expert: Expert; cfg: TileConfig (_details/groups.py)."""
    r = tl.arange(0, 2 * cfg.BLOCK_N)
    n = pid_n * cfg.BLOCK_N + r % cfg.BLOCK_N
    w_row = (n + (r // cfg.BLOCK_N) * inter_size)[:, None].to(tl.int64)
    mask = (n < inter_size)[:, None]
    rows = expert.w + expert.w_base + w_row * stride_wn
    so = expert.s_base + w_row * stride_sn
    acc = acc_zeros(cfg.BLOCK_M, 2 * cfg.BLOCK_N, cfg.SWAP)
    if cfg.TAIL_M > 0:
        acc_t = acc_zeros(cfg.TAIL_M, 2 * cfg.BLOCK_N, cfg.SWAP)
    for k0 in range(0, hidden, cfg.BLOCK_K):
        x = cast_to(tl.load(main.plain + k0, mask=main.ok[:, None], other=0.0), tl.bfloat16)
        v = load_weight_pairs(WeightTile(rows, expert.s + so, expert.o + so, mask), k0, cfg.CODE, 2 * cfg.BLOCK_N,
                              cfg.BLOCK_K)
        acc = _dot1(acc, x, v, cfg.SWAP)
        if cfg.TAIL_M > 0:
            xt = cast_to(tl.load(tail.plain + k0, mask=tail.ok[:, None], other=0.0), tl.bfloat16)
            acc_t = _dot1(acc_t, xt, v, cfg.SWAP)
    gate, up = _split_stacked(acc, cfg.SWAP, cfg.BLOCK_M, cfg.BLOCK_N)
    if cfg.TAIL_M > 0:
        gate_t, up_t = _split_stacked(acc_t, cfg.SWAP, cfg.TAIL_M, cfg.BLOCK_N)
    else:
        gate_t, up_t = gate, up
    return gate, up, gate_t, up_t


@triton.jit
def _split_stacked(acc, SWAP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A stacked gate/up accumulator -> (gate, up), each [ROWS, BLOCK_N]."""
    if SWAP:
        acc = tl.trans(acc)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, BLOCK_N)), (0, 2, 1)))
    return gate, up


@triton.jit
def _load_x_words(x_ptrs, mask, W: tl.constexpr):
    """Activations in word order: slot j's [rows, W] run starts at x_ptrs + j*W (bf16)."""
    x0 = cast_to(tl.load(x_ptrs + 0 * W, mask=mask, other=0.0), tl.bfloat16)
    x1 = cast_to(tl.load(x_ptrs + 1 * W, mask=mask, other=0.0), tl.bfloat16)
    x2 = cast_to(tl.load(x_ptrs + 2 * W, mask=mask, other=0.0), tl.bfloat16)
    x3 = cast_to(tl.load(x_ptrs + 3 * W, mask=mask, other=0.0), tl.bfloat16)
    x4 = cast_to(tl.load(x_ptrs + 4 * W, mask=mask, other=0.0), tl.bfloat16)
    x5 = cast_to(tl.load(x_ptrs + 5 * W, mask=mask, other=0.0), tl.bfloat16)
    x6 = cast_to(tl.load(x_ptrs + 6 * W, mask=mask, other=0.0), tl.bfloat16)
    x7 = cast_to(tl.load(x_ptrs + 7 * W, mask=mask, other=0.0), tl.bfloat16)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_dots(acc, xs, ws, SWAP: tl.constexpr):
    """acc += sum_j xs[j] . ws[j]: eight dots over the word-strided K views (no weight shuffles)."""
    acc = _dot1(acc, xs[0], ws[0], SWAP)
    acc = _dot1(acc, xs[1], ws[1], SWAP)
    acc = _dot1(acc, xs[2], ws[2], SWAP)
    acc = _dot1(acc, xs[3], ws[3], SWAP)
    acc = _dot1(acc, xs[4], ws[4], SWAP)
    acc = _dot1(acc, xs[5], ws[5], SWAP)
    acc = _dot1(acc, xs[6], ws[6], SWAP)
    acc = _dot1(acc, xs[7], ws[7], SWAP)
    return acc


@triton.jit
def _load_x_step(tile, k0, cfg):
    """The activations of a RowTile's K step at k0 in the config's K order, as `_dot_step` takes them:
    the eight word views, (xa, xb) for the interleaved halves, else (x,) in pair order."""
    if cfg.ORDER == ORDER_WORDS:
        return _load_x_words(tile.words + k0, tile.ok[:, None], cfg.BLOCK_K // 8)
    elif cfg.ORDER == ORDER_INTERLEAVE:
        xa = cast_to(tl.load(tile.rows + (k0 + tile.ka)[None, :], mask=tile.ok[:, None], other=0.0), tl.bfloat16)
        xb = cast_to(tl.load(tile.rows + (k0 + 4 + tile.ka)[None, :], mask=tile.ok[:, None], other=0.0),
                     tl.bfloat16)
        return xa, xb
    else:
        return _load_x_pairs(tile, k0, False)


@triton.jit
def _load_x_pairs(tile, k0, PLAIN: tl.constexpr):
    """(x,): a RowTile's K step at k0 in pair order, from activations stored in pair order or, PLAIN, in
    plain order (swapped in registers)."""
    x = cast_to(tl.load(tile.plain + k0, mask=tile.ok[:, None], other=0.0), tl.bfloat16)
    if PLAIN:
        x = to_pair_order(x)
    return (x,)


@triton.jit
def _load_w_step(w, k0, cfg):
    """A WeightTile's K step at k0, decoded in the config's K order (as `_load_x_step`)."""
    if cfg.ORDER == ORDER_WORDS:
        return load_weight_words(w, k0, cfg.CODE, cfg.BLOCK_N, cfg.BLOCK_K)
    elif cfg.ORDER == ORDER_INTERLEAVE:
        return load_weight_tile(w, k0, cfg.CODE, cfg.BLOCK_N, cfg.BLOCK_K)
    else:
        return (load_weight_pairs(w, k0, cfg.CODE, cfg.BLOCK_N, cfg.BLOCK_K),)


@triton.jit
def _dot_step(acc, xs, ws, cfg):
    """acc += xs . ws, one K step of `_load_x_step` activations and `_load_w_step` weights."""
    if cfg.ORDER == ORDER_WORDS:
        acc = _word_dots(acc, xs, ws, cfg.SWAP)
    elif cfg.ORDER == ORDER_INTERLEAVE:
        acc = _acc_dot(acc, xs[0], xs[1], ws[0], ws[1], cfg.SWAP)
    else:
        acc = _dot1(acc, xs[0], ws[0], cfg.SWAP)
    return acc


@triton.jit
def _gate_up_pair(main, tail, gate, up, hidden: tl.constexpr, cfg):
    """Stage 1's K loop with separate gate and up tiles and accumulators: the gate and up sums of the
    main rows, each [BLOCK_M, BLOCK_N], and of the tail rows (the main ones again if TAIL_M is 0).
    main, tail: RowTile; gate, up: WeightTile; cfg: TileConfig (_details/groups.py)."""
    acc_g = acc_zeros(cfg.BLOCK_M, cfg.BLOCK_N, cfg.SWAP)
    acc_u = acc_zeros(cfg.BLOCK_M, cfg.BLOCK_N, cfg.SWAP)
    if cfg.TAIL_M > 0:
        acc_gt = acc_zeros(cfg.TAIL_M, cfg.BLOCK_N, cfg.SWAP)
        acc_ut = acc_zeros(cfg.TAIL_M, cfg.BLOCK_N, cfg.SWAP)
    for k0 in range(0, hidden, cfg.BLOCK_K):
        xs = _load_x_step(main, k0, cfg)
        if cfg.TAIL_M > 0:
            xts = _load_x_step(tail, k0, cfg)
        gs = _load_w_step(gate, k0, cfg)
        if cfg.ORDER == ORDER_WORDS:  # eight word dots each: gate's are issued before up's tile is decoded
            acc_g = _dot_step(acc_g, xs, gs, cfg)
            if cfg.TAIL_M > 0:
                acc_gt = _dot_step(acc_gt, xts, gs, cfg)
        us = _load_w_step(up, k0, cfg)
        if cfg.ORDER != ORDER_WORDS:
            acc_g = _dot_step(acc_g, xs, gs, cfg)
            if cfg.TAIL_M > 0:
                acc_gt = _dot_step(acc_gt, xts, gs, cfg)
        acc_u = _dot_step(acc_u, xs, us, cfg)
        if cfg.TAIL_M > 0:
            acc_ut = _dot_step(acc_ut, xts, us, cfg)
    if cfg.SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if cfg.TAIL_M > 0:
        if cfg.SWAP:
            acc_gt = tl.trans(acc_gt)
            acc_ut = tl.trans(acc_ut)
    else:
        acc_gt, acc_ut = acc_g, acc_u
    return acc_g, acc_u, acc_gt, acc_ut



@triton.jit
def inter_destination(offs_n, OUT_ORDER: tl.constexpr, SWAP_OUT: tl.constexpr):
    """Where stage 1's columns offs_n go in the order stage 2 reads (pairs swapped in registers: as they are)."""
    if OUT_ORDER == ORDER_PAIRS:
        if SWAP_OUT:
            dest = offs_n
        else:
            dest = pair_order(offs_n)
    elif OUT_ORDER == ORDER_INTERLEAVE:
        dest = offs_n
    else:
        dest = word_position(offs_n, OUT_ORDER)
    return dest

@triton.jit
def _store_inter(acc_g, acc_u, tile, beta, linear_beta, ACT: tl.constexpr, inter_ptr, stride_im, offs_n, dest,
                 inter_size, SWAP_OUT: tl.constexpr):
    """Stage 1's epilogue on one RowTile: the activation of the full K sums, stored at each real
    row's pair (columns `dest`). SWAP_OUT: the columns go out in pair order, swapped in registers
    (pair_order keeps each 32-group) so the stores stay contiguous and `dest` is offs_n; a scatter
    by pair_order stores 2 bytes at a time (on the H200 it made stage 1 25 % slower at 4096 tokens,
    36 % at 16384)."""
    h = apply_activation(acc_g, acc_u, beta, linear_beta, ACT)
    if SWAP_OUT:
        h = to_pair_order(h)
    out = inter_ptr + tile.pair[:, None].to(tl.int64) * stride_im + dest[None, :]
    tl.store(out, cast_to(h, inter_ptr.dtype.element_ty), mask=tile.ok[:, None] & (offs_n < inter_size)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def stage1_aligned_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    inter_ptr, stride_im,
    sorted_ptr, block_expert_ptr, num_rows_ptr, map_ptr,
    num_pairs, num_ids, num_local, inter_size, hidden: tl.constexpr,
    beta, linear_beta,
    TOPK: tl.constexpr, WEIGHTS: tl.constexpr, ACT: tl.constexpr, SWAP: tl.constexpr, ORDER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_ORDER: tl.constexpr,
    PATH: tl.constexpr, PDL: tl.constexpr,
):
    """inter[pair, n] = act(x[tok] . W13_e[gate n], x[tok] . W13_e[up n]) for one block of rows.

    ORDER_PAIRS: one dot per K step per accumulator, x (already in pair order) and the weights
    in pair order; ORDER_STACKED: the same on one stacked gate/up tile (_gate_up_stacked);
    ORDER_INTERLEAVE: x in plain order, weights regrouped in registers; ORDER_WORDS: x in word
    order of BLOCK_K tiles and eight dots per step. inter goes out as stage 2 reads it
    (korder.stage1_args): OUT_ORDER ORDER_PAIRS in pair order, ORDER_INTERLEAVE plain, else in word
    order of OUT_ORDER-wide tiles (what stage 2's word dots read). Padded rows are not stored.
    WEIGHTS: _details/constants.py. BLOCK_ROWS: the module docstring. PATH: _details/row_blocks.py.
    PDL: common/_details/pdl.py."""
    enter(PDL)
    TAIL_M: tl.constexpr = BLOCK_ROWS & -BLOCK_ROWS if BLOCK_ROWS & (BLOCK_ROWS - 1) else 0  # module docstring
    BLOCK_M: tl.constexpr = BLOCK_ROWS - TAIL_M
    cfg: tl.constexpr = TileConfig(WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS]),
                                   SWAP, ORDER, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K)
    pid_m, pid_n = _block_and_tile(inter_size, BLOCK_N)
    routing = Routing(sorted_ptr, block_expert_ptr, num_rows_ptr, map_ptr)
    live, e, pair, row_ok, pair_t, row_ok_t = row_block(pid_m, routing, num_pairs, num_ids, num_local, PATH, BLOCK_M,
                                                         TAIL_M)
    if not live:
        return
    x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_xm
    if TAIL_M > 0:
        xt_rows = x_ptr + (pair_t // TOPK).to(tl.int64)[:, None] * stride_xm
    else:
        xt_rows = x_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < inter_size)[:, None]
    ka = word_k_offsets(BLOCK_K)
    gate_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter_size * stride_wn
    gate_so = e * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    up_so = gate_so + inter_size * stride_sn
    gate_s = s_ptr + gate_so
    up_s = s_ptr + up_so
    gate = WeightTile(gate_rows, gate_s, o_ptr + gate_so, mask_n)
    up = WeightTile(up_rows, up_s, o_ptr + up_so, mask_n)
    main = RowTile(x_rows, x_rows + tl.arange(0, BLOCK_K // 8)[None, :], x_rows + tl.arange(0, BLOCK_K)[None, :],
                   ka, row_ok, pair)
    tail = RowTile(xt_rows, xt_rows + tl.arange(0, BLOCK_K // 8)[None, :], xt_rows + tl.arange(0, BLOCK_K)[None, :],
                   ka, row_ok_t, pair_t)
    tl.static_assert(ORDER != ORDER_PLAIN_INTER, "plain-inter is stage 2's")
    if ORDER == ORDER_STACKED:
        expert = Expert(w_ptr, s_ptr, o_ptr, e * stride_we, e * stride_se)
        acc_g, acc_u, acc_gt, acc_ut = _gate_up_stacked(main, tail, expert, stride_wn, stride_sn, pid_n, inter_size,
                                                        hidden, cfg)
    else:
        acc_g, acc_u, acc_gt, acc_ut = _gate_up_pair(main, tail, gate, up, hidden, cfg)
    # pair order swapped in registers needs whole 32-groups in the tile; a 16-wide one scatters
    SWAP_OUT: tl.constexpr = OUT_ORDER == ORDER_PAIRS and BLOCK_N % 32 == 0
    dest = inter_destination(offs_n, OUT_ORDER, SWAP_OUT)
    _store_inter(acc_g, acc_u, main, beta, linear_beta, ACT, inter_ptr, stride_im, offs_n, dest, inter_size, SWAP_OUT)
    if TAIL_M > 0:
        _store_inter(acc_gt, acc_ut, tail, beta, linear_beta, ACT, inter_ptr, stride_im, offs_n, dest, inter_size,
                     SWAP_OUT)


@triton.jit
def _stage2_tile(main, tail, xs, xts, gw, gw_t, expert, stride_wn, stride_sn: tl.constexpr, n0, y_ptr, stride_ym,
                 hidden, inter_size: tl.constexpr, cfg, UNROLL_K: tl.constexpr):
    """One tile of y starting at column n0 (BLOCK_M main rows, TAIL_M tail rows on the same decoded
    weights): the K loop and the store. main, tail: RowTile; xs, xts: their K steps when already
    loaded; gw, gw_t: their router weights; expert: Expert; cfg: TileConfig (_details/groups.py)."""
    offs_n = n0 + tl.arange(0, cfg.BLOCK_N)
    mask_n = (offs_n < hidden)[:, None]
    w_rows = expert.w + expert.w_base + offs_n[:, None].to(tl.int64) * stride_wn
    so = expert.s_base + offs_n[:, None].to(tl.int64) * stride_sn
    w = WeightTile(w_rows, expert.s + so, expert.o + so, mask_n)
    acc = acc_zeros(cfg.BLOCK_M, cfg.BLOCK_N, cfg.SWAP)
    if cfg.TAIL_M > 0:
        acc_t = acc_zeros(cfg.TAIL_M, cfg.BLOCK_N, cfg.SWAP)
    if UNROLL_K:  # the caller's tile loop is the pipelined one: all of K in one iteration
        for i in tl.static_range(inter_size // cfg.BLOCK_K):
            if cfg.ORDER == ORDER_PAIRS or cfg.ORDER == ORDER_PLAIN_INTER:  # loaded once for all tiles
                x = (xs[i],)
            else:
                x = _load_x_step(main, i * cfg.BLOCK_K, cfg)
            ws = _load_w_step(w, i * cfg.BLOCK_K, cfg)
            acc = _dot_step(acc, x, ws, cfg)
            if cfg.TAIL_M > 0:
                if cfg.ORDER == ORDER_PAIRS or cfg.ORDER == ORDER_PLAIN_INTER:
                    xt = (xts[i],)
                else:
                    xt = _load_x_step(tail, i * cfg.BLOCK_K, cfg)
                acc_t = _dot_step(acc_t, xt, ws, cfg)
    else:
        for k0 in range(0, inter_size, cfg.BLOCK_K):
            x = _load_x_step(main, k0, cfg)
            if cfg.TAIL_M > 0:
                xt = _load_x_step(tail, k0, cfg)
            ws = _load_w_step(w, k0, cfg)
            acc = _dot_step(acc, x, ws, cfg)
            if cfg.TAIL_M > 0:
                acc_t = _dot_step(acc_t, xt, ws, cfg)
    _store_y(acc, main, gw, y_ptr, stride_ym, offs_n, hidden, cfg.SWAP)
    if cfg.TAIL_M > 0:
        _store_y(acc_t, tail, gw_t, y_ptr, stride_ym, offs_n, hidden, cfg.SWAP)


@triton.jit
def _store_y(acc, tile, gw, y_ptr, stride_ym, offs_n, hidden, SWAP: tl.constexpr):
    """Stage 2's epilogue on one RowTile: scaled by its router weights `gw` (fp32, per row), stored per
    pair (real rows only)."""
    if SWAP:
        acc = tl.trans(acc)
    acc = acc * gw[:, None]
    out = y_ptr + tile.pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, cast_to(acc, y_ptr.dtype.element_ty), mask=tile.ok[:, None] & (offs_n < hidden)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def stage2_aligned_kernel(
    inter_ptr, stride_im,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn: tl.constexpr,
    o_ptr,
    y_ptr, stride_ym,
    topk_w_ptr,
    sorted_ptr, block_expert_ptr, num_rows_ptr, map_ptr,
    num_pairs, num_ids, num_local, hidden, inter_size: tl.constexpr,
    WEIGHTS: tl.constexpr, SWAP: tl.constexpr, ORDER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
    PATH: tl.constexpr, PDL: tl.constexpr,
):
    """y[pair, n] = router_weight[pair] * (inter[pair] . W2_e[n]), stored per (token, slot) pair.

    Each program takes N_TILES consecutive N tiles of one row block. With N_TILES > 1 a tile's
    K steps are unrolled and the tile loop is the pipelined one, so the next tiles' weights are in
    flight during a tile's decode and store (K = I is a few steps: a K loop per tile starts from an
    empty pipeline every time).
    ORDER as stage 1's (words, interleave, pairs: one dot per K step on inter in pair order), or
    ORDER_PLAIN_INTER (N_TILES > 1): pair order with inter read in plain order and swapped into pair
    order in registers as it is loaded. Padded rows (never stored by stage 1) are not loaded.
    WEIGHTS: _details/constants.py. BLOCK_ROWS: the module docstring. PATH: _details/row_blocks.py.
    PDL: common/_details/pdl.py."""
    enter(PDL)
    tl.static_assert(ORDER != ORDER_STACKED, "stacked is stage 1's")
    TAIL_M: tl.constexpr = BLOCK_ROWS & -BLOCK_ROWS if BLOCK_ROWS & (BLOCK_ROWS - 1) else 0  # module docstring
    BLOCK_M: tl.constexpr = BLOCK_ROWS - TAIL_M
    cfg: tl.constexpr = TileConfig(WeightCode(WEIGHT_FMT[WEIGHTS], WEIGHT_OFFSETS[WEIGHTS], WEIGHT_DECODE[WEIGHTS]),
                                   SWAP, ORDER, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K)
    pid_m, pid_g = _block_and_tile(hidden, BLOCK_N * N_TILES)
    routing = Routing(sorted_ptr, block_expert_ptr, num_rows_ptr, map_ptr)
    live, e, pair, row_ok, pair_t, row_ok_t = row_block(pid_m, routing, num_pairs, num_ids, num_local, PATH, BLOCK_M,
                                                         TAIL_M)
    if not live:
        return
    ka = word_k_offsets(BLOCK_K)
    a_rows = inter_ptr + pair[:, None].to(tl.int64) * stride_im
    if TAIL_M > 0:
        at_rows = inter_ptr + pair_t[:, None].to(tl.int64) * stride_im
    else:
        at_rows = a_rows
    main = RowTile(a_rows, a_rows + tl.arange(0, BLOCK_K // 8)[None, :], a_rows + tl.arange(0, BLOCK_K)[None, :],
                   ka, row_ok, pair)
    tail = RowTile(at_rows, at_rows + tl.arange(0, BLOCK_K // 8)[None, :], at_rows + tl.arange(0, BLOCK_K)[None, :],
                   ka, row_ok_t, pair_t)
    expert = Expert(w_ptr, s_ptr, o_ptr, e * stride_we, e * stride_se)
    # loaded once for all the program's tiles (each tile's epilogue had waited on loading them again)
    gw = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    if TAIL_M > 0:
        gw_t = tl.load(topk_w_ptr + pair_t, mask=row_ok_t, other=0.0).to(tl.float32)
    else:
        gw_t = gw
    xs = ()
    xts = ()
    if N_TILES == 1:
        _stage2_tile(main, tail, xs, xts, gw, gw_t, expert, stride_wn, stride_sn, pid_g * BLOCK_N, y_ptr, stride_ym,
                     hidden, inter_size, cfg, False)
    else:
        # the block's activations, all of K, loaded once for its N tiles
        if ORDER == ORDER_PAIRS or ORDER == ORDER_PLAIN_INTER:
            for k0 in tl.static_range(0, inter_size, BLOCK_K):
                xs = xs + _load_x_pairs(main, k0, ORDER == ORDER_PLAIN_INTER)
                if TAIL_M > 0:
                    xts = xts + _load_x_pairs(tail, k0, ORDER == ORDER_PLAIN_INTER)
        for t in range(0, N_TILES):
            _stage2_tile(main, tail, xs, xts, gw, gw_t, expert, stride_wn, stride_sn, (pid_g * N_TILES + t) * BLOCK_N,
                         y_ptr, stride_ym, hidden, inter_size, cfg, True)
