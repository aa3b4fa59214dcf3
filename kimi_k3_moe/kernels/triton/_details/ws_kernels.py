"""Stage 1 warp-specialised for sm_90 (path "ws"; Gluon, Triton 3.6+).

Two partitions share a ring of STAGES shared-memory slots, each one K step:
* the loader (LOADER_WARPS, LOADER_REGS registers each) fills a slot with cp.async: the step's
  packed weight words of a [2 x BLOCK_N, BLOCK_K] tile (gate rows, then the up rows of the same
  columns) and the block's activation rows (hidden in pair order, gathered by pair), and arrives
  on `loaded` as its copies land;
* the MMA warps (the kernel's num_warps, 16 weight rows each) decode the step's words straight into
  wgmma's register A operand (pair order: a word's four bf16 pairs are one thread's operand, so
  nothing moves between threads; `word_layout`), issue the gate and up wgmmas with the activations
  as the shared-memory B operand, and leave them in flight while the next step decodes; a slot is
  freed once the step after it has been issued.
Weights as the MMA's M side and rows as its N side (swap), as the aligned kernels' swapped tiles; a
row block of BLOCK_ROWS rows is a main and a tail tile (matmul_kernels.py), two wgmmas on the same
decoded registers. The activation of the full K sums and the store of inter happen after the ring,
in the MMA warps. The expert map is applied by the alignment (path "aligned"'s row blocks).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import (DECODE_PTX_WIDE, E2M1_WIDE_WORD_PTX, E2M1_WORD_PTX, FMT_MXFP4,
                                                        NEG_ZERO_PAIR, WEIGHT_DECODE, WEIGHT_FMT, WEIGHT_OFFSETS,
                                                        factor_pair, ptx_e2m1_word, ptx_int4_word,
                                                        to_pair_order, words_to_pair_order)
from kimi_k3_moe.kernels.triton._details.pdl import enter

# cp.async global -> shared: async_load from Triton 3.8 on (3.9 dropped the older name, 3.6 lacks the new one)
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(48)  # its pointers; the rest of the register file goes to the MMA warps


@gluon.constexpr_function
def word_layout(rows, block_k, num_warps):
    """The layout of a [rows, block_k / 8] tile of packed words whose decoded pairs, in pair order, are
    exactly the register A operand of a wgmma over [rows, block_k] (DotOperandLayout(0, mma, 2) with
    the MMA's warps [num_warps, 1]): lanes hold words q = 0..3 of a 32-group and rows 0..7, registers
    the row + 8 and the other groups, warps 16 rows each. A word's pairs and halves are the operand's
    own registers, so `_decode_operand`'s layout change moves no data (its assert_trivial)."""
    regs = [[8, 0]] + [[0, 4 << j] for j in range((block_k // 32).bit_length() - 1)]
    warps = [[16 << j, 0] for j in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warps, [], [rows, block_k // 8])


@gluon.jit
def _decode_operand(words, f, o, dot: gl.constexpr, FMT: gl.constexpr, DECODE: gl.constexpr, BLOCK_K: gl.constexpr):
    """Words in word_layout -> the bf16 wgmma A operand [rows, BLOCK_K] in pair order (decode.py's decoders)."""
    if FMT == FMT_MXFP4:
        if DECODE == DECODE_PTX_WIDE:
            v0, v1, v2, v3, v4, v5, v6, v7 = ptx_e2m1_word(words, f, E2M1_WIDE_WORD_PTX)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = ptx_e2m1_word(words, f, E2M1_WORD_PTX)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = ptx_int4_word(words, f, o)
    t = words_to_pair_order(v0, v1, v2, v3, v4, v5, v6, v7, words.shape[0], BLOCK_K)
    return gl.convert_layout(t, dot, assert_trivial=True)


@gluon.jit
def _loader(x_ptr, stride_xm, sorted_ptr, start, num_pairs, w_ptr, w_base, stride_wn, n0, inter_size,
            x_bufs, xt_bufs, raw_bufs, loaded, empty, hidden: gl.constexpr, TOPK: gl.constexpr, BLOCK_M: gl.constexpr,
            TAIL_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of each K step's packed weight words and activation rows into slot i % STAGES; padding
    rows and columns past inter_size are zero-filled."""
    W: gl.constexpr = gl.num_warps()
    TX: gl.constexpr = BLOCK_K // 8  # 16-byte pieces per activation row
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TX, TX], [W, 1], [1, 0])
    kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xl))
    pair = gl.load(sorted_ptr + start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl)))
    ok = (pair < num_pairs)[:, None]
    rows = x_ptr + ((pair // TOPK).to(gl.int64) * stride_xm)[:, None] + kk[None, :]
    if TAIL_M > 0:
        pair_t = gl.load(sorted_ptr + start + BLOCK_M + gl.arange(0, TAIL_M, layout=gl.SliceLayout(1, xl)))
        ok_t = (pair_t < num_pairs)[:, None]
        rows_t = x_ptr + ((pair_t // TOPK).to(gl.int64) * stride_xm)[:, None] + kk[None, :]
    WORDS: gl.constexpr = BLOCK_K // 8
    TW: gl.constexpr = WORDS // 4  # 16-byte pieces per weight row
    wl: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TW, TW], [W, 1], [1, 0])
    r = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(1, wl))
    n = n0 + r % BLOCK_N
    w_rows = (n + (r // BLOCK_N) * inter_size).to(gl.int64)
    w_ok = (n < inter_size)[:, None]
    words = ((w_ptr + w_base + w_rows[:, None] * stride_wn).to(gl.pointer_type(gl.int32))
             + gl.arange(0, WORDS, layout=gl.SliceLayout(0, wl))[None, :])
    for i in range(hidden // BLOCK_K):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier counts as freed
        k0 = i * BLOCK_K
        async_load(raw_bufs.index(s), words + k0 // 8, mask=w_ok)
        async_load(x_bufs.index(s), rows + k0, mask=ok)
        if TAIL_M > 0:
            async_load(xt_bufs.index(s), rows_t + k0, mask=ok_t)
        async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)


@gluon.jit
def _mma(s_ptr, o_ptr, s_base, stride_sn, n0, inter_size, raw_bufs, x_bufs, xt_bufs, loaded, empty,
         hidden: gl.constexpr, WEIGHTS: gl.constexpr, BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr,
         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The K loop of the MMA warps: the gate and up sums of the main rows [BLOCK_N, BLOCK_M] and of the
    tail rows [BLOCK_N, TAIL_M] (the main ones again without a tail). Scales come from global memory a
    step ahead (a few bytes per row and step)."""
    FMT: gl.constexpr = WEIGHT_FMT[WEIGHTS]
    DECODE: gl.constexpr = WEIGHT_DECODE[WEIGHTS]
    HAS_OFFSETS: gl.constexpr = WEIGHT_OFFSETS[WEIGHTS]
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BLOCK_M, 16])
    dot: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    wl: gl.constexpr = word_layout(BLOCK_N, BLOCK_K, W)
    acc_g = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    acc_u = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    if TAIL_M > 0:
        mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                        instr_shape=[16, TAIL_M, 16])
        dot_t: gl.constexpr = gl.DotOperandLayout(0, mma_t, 2)
        acc_gt = gl.zeros([BLOCK_N, TAIL_M], gl.float32, layout=mma_t)
        acc_ut = gl.zeros([BLOCK_N, TAIL_M], gl.float32, layout=mma_t)
    MMAS: gl.constexpr = 4 if TAIL_M > 0 else 2  # wgmma groups per step
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
    ok = (n < inter_size)[:, None]
    so_g = s_base + n.to(gl.int64)[:, None] * stride_sn + (gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, wl))
                                                          // 4)[None, :]
    so_u = so_g + inter_size * stride_sn
    GROUPS: gl.constexpr = BLOCK_K // 32
    STEPS: gl.constexpr = hidden // BLOCK_K
    sg = gl.load(s_ptr + so_g, mask=ok, other=0)
    su = gl.load(s_ptr + so_u, mask=ok, other=0)
    if HAS_OFFSETS:
        og = gl.load(o_ptr + so_g, mask=ok, other=0)
        ou = gl.load(o_ptr + so_u, mask=ok, other=0)
    # the A operands of the wgmmas in flight, kept alive until those complete (wgmma may read its
    # register operand after issue), so the next step decodes into other registers
    prev_g = gl.zeros([BLOCK_N, BLOCK_K], gl.bfloat16, layout=dot)
    prev_u = prev_g
    for i in range(STEPS):
        s = i % STAGES
        nxt = ok & (i + 1 < STEPS)
        sg_next = gl.load(s_ptr + so_g + (i + 1) * GROUPS, mask=nxt, other=0)
        su_next = gl.load(s_ptr + so_u + (i + 1) * GROUPS, mask=nxt, other=0)
        fg = factor_pair(sg, FMT, DECODE)
        fu = factor_pair(su, FMT, DECODE)
        if HAS_OFFSETS:
            og_next = gl.load(o_ptr + so_g + (i + 1) * GROUPS, mask=nxt, other=0)
            ou_next = gl.load(o_ptr + so_u + (i + 1) * GROUPS, mask=nxt, other=0)
            pg = factor_pair(og, FMT, DECODE)
            pu = factor_pair(ou, FMT, DECODE)
        else:
            pg = fg * 0 + NEG_ZERO_PAIR
            pu = pg
        mbarrier.wait(loaded.index(s), (i // STAGES) & 1)
        slot = raw_bufs.index(s)
        a_g = _decode_operand(slot.slice(0, BLOCK_N, dim=0).load(wl), fg, pg, dot, FMT, DECODE, BLOCK_K)
        a_u = _decode_operand(slot.slice(BLOCK_N, BLOCK_N, dim=0).load(wl), fu, pu, dot, FMT, DECODE, BLOCK_K)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        xs = x_bufs.index(s).permute((1, 0))
        acc_g = warpgroup_mma(a_g, xs, acc_g, is_async=True)
        acc_u = warpgroup_mma(a_u, xs, acc_u, is_async=True)
        if TAIL_M > 0:
            xts = xt_bufs.index(s).permute((1, 0))
            acc_gt = warpgroup_mma(gl.convert_layout(a_g, dot_t, assert_trivial=True), xts, acc_gt, is_async=True)
            acc_ut = warpgroup_mma(gl.convert_layout(a_u, dot_t, assert_trivial=True), xts, acc_ut, is_async=True)
            acc_g, acc_u, acc_gt, acc_ut, _, _ = warpgroup_mma_wait(
                num_outstanding=MMAS, deps=(acc_g, acc_u, acc_gt, acc_ut, prev_g, prev_u))
        else:
            acc_g, acc_u, _, _ = warpgroup_mma_wait(num_outstanding=MMAS, deps=(acc_g, acc_u, prev_g, prev_u))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)  # the step before is done
        prev_g = a_g
        prev_u = a_u
        sg = sg_next
        su = su_next
        if HAS_OFFSETS:
            og = og_next
            ou = ou_next
    if TAIL_M > 0:
        acc_g, acc_u, acc_gt, acc_ut, _, _ = warpgroup_mma_wait(
            num_outstanding=0, deps=(acc_g, acc_u, acc_gt, acc_ut, prev_g, prev_u))
    else:
        acc_g, acc_u, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u, prev_g, prev_u))
        acc_gt = acc_g
        acc_ut = acc_u
    return acc_g, acc_u, acc_gt, acc_ut


@gluon.jit
def _store_inter(acc_g, acc_u, sorted_ptr, start, num_pairs, inter_ptr, stride_im, n0, inter_size, beta, linear_beta,
                 ACT: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, OUT_PAIRS: gl.constexpr):
    """act(gate, up) of one tile ([BLOCK_N columns, ROWS rows]) stored at its real rows' pairs, plain or,
    OUT_PAIRS, in pair order (decode.to_pair_order)."""
    h = gl.permute(apply_activation(acc_g, acc_u, beta, linear_beta, ACT).to(gl.bfloat16), [1, 0])
    if OUT_PAIRS:
        h = to_pair_order(h)
    W: gl.constexpr = gl.num_warps()
    out: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_N, BLOCK_N // 8], [W, 1], [1, 0])
    h = gl.convert_layout(h, out)  # 16-byte stores along each row
    pair = gl.load(sorted_ptr + start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out)))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out))
    ptr = inter_ptr + pair.to(gl.int64)[:, None] * stride_im + n[None, :]
    gl.store(ptr, h, mask=(pair < num_pairs)[:, None] & (n < inter_size)[None, :])


@gluon.jit(do_not_specialize=["num_pairs"])
def ws_stage1_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    inter_ptr, stride_im,
    sorted_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, inter_size, hidden: gl.constexpr,
    beta, linear_beta,
    TOPK: gl.constexpr, WEIGHTS: gl.constexpr, ACT: gl.constexpr,
    BLOCK_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    OUT_PAIRS: gl.constexpr, PDL: gl.constexpr,
):
    """inter[pair, n] = act(x[tok] . W13_e[gate n], x[tok] . W13_e[up n]) for one row block and BLOCK_N
    columns, as matmul_kernels.stage1_aligned_kernel with ORDER pairs: x in pair order, inter plain or
    (OUT_PAIRS) in pair order. WEIGHTS: _details/constants.py. PDL: _details/pdl.py."""
    enter(PDL)
    TAIL_M: gl.constexpr = BLOCK_ROWS & -BLOCK_ROWS if BLOCK_ROWS & (BLOCK_ROWS - 1) else 0
    BLOCK_M: gl.constexpr = BLOCK_ROWS - TAIL_M
    tiles = gl.cdiv(inter_size, BLOCK_N)
    pid = gl.program_id(0)
    pid_m = pid // tiles  # N tiles of one row block run together, as the aligned kernels' (_block_and_tile)
    n0 = (pid % tiles) * BLOCK_N
    start = pid_m * BLOCK_ROWS
    if start >= gl.load(num_rows_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * BLOCK_N, BLOCK_K // 8], plain)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], x_layout)
    if TAIL_M > 0:
        xt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TAIL_M, BLOCK_K], gl.bfloat16)
        xt_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TAIL_M, BLOCK_K], xt_layout)
    else:
        xt_bufs = x_bufs
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(loaded.index(s), count=LOADER_WARPS * 32)  # each loader thread, as its copies land
        mbarrier.init(empty.index(s), count=1)
    acc_g, acc_u, acc_gt, acc_ut = gl.warp_specialize([
        (_mma, (s_ptr, o_ptr, e * stride_se, stride_sn, n0, inter_size, raw_bufs, x_bufs, xt_bufs, loaded, empty,
                hidden, WEIGHTS, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K, STAGES)),
        (_loader, (x_ptr, stride_xm, sorted_ptr, start, num_pairs, w_ptr, e * stride_we, stride_wn, n0, inter_size,
                   x_bufs, xt_bufs, raw_bufs, loaded, empty, hidden, TOPK, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K,
                   STAGES)),
    ], [LOADER_WARPS], [LOADER_REGS])
    _store_inter(acc_g, acc_u, sorted_ptr, start, num_pairs, inter_ptr, stride_im, n0, inter_size, beta, linear_beta,
                 ACT, BLOCK_N, BLOCK_M, OUT_PAIRS)
    if TAIL_M > 0:
        _store_inter(acc_gt, acc_ut, sorted_ptr, start + BLOCK_M, num_pairs, inter_ptr, stride_im, n0, inter_size,
                     beta, linear_beta, ACT, BLOCK_N, TAIL_M, OUT_PAIRS)
