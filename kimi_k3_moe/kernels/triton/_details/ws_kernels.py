"""Stages 1 and 2 warp-specialised for sm_90 (KernelConfig.ws; Gluon, Triton 3.6+).

Two partitions share a ring of STAGES shared-memory slots, each one K step:
* the loader (LOADER_WARPS, LOADER_REGS registers each) fills a slot with cp.async: the step's
  packed weight words (stage 1: a [2 x BLOCK_N, BLOCK_K] tile, gate rows then the up rows of the same
  columns; stage 2: [BLOCK_N, BLOCK_K] of W2) and the block's activation rows of the step (stage 1:
  hidden in pair order, gathered by pair; stage 2: inter, already in pair order, once per program into
  a buffer of its own that holds all of K = I for every N tile), and arrives on `loaded` as its copies
  land;
* the MMA warps (the kernel's num_warps, 16 weight rows each) decode the step's words straight into
  wgmma's register A operand (pair order: a word's four bf16 pairs are one thread's operand, so
  nothing moves between threads; `word_layout`), issue the wgmmas with the activations as the
  shared-memory B operand, and leave them in flight while the next step decodes; a slot is freed once
  the step after it has been issued.
Weights as the MMA's M side and rows as its N side (swap), as the aligned kernels' swapped tiles; a
row block of BLOCK_ROWS rows is a main and a tail tile (matmul_kernels.py), two wgmmas on the same
decoded registers. Stage 1's activation of the full K sums and its store of inter happen after the
ring; stage 2 stores each N tile's y (router weight applied) in the MMA warps while the loader fills
the ring with the next tile's words. The expert map is applied by the alignment (the aligned path's
row blocks).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import (DECODE_BITS, DECODE_PTX_WIDE, E2M1_WIDE_WORD_PTX,
                                                        E2M1_WORD_PTX, FMT_MXFP4, NEG_ZERO_PAIR, WEIGHT_DECODE,
                                                        WEIGHT_FMT, WEIGHT_OFFSETS, factor_pair, ptx_e2m1_word,
                                                        ptx_int4_word, to_pair_order, words_to_pair_order)
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
    """Words in word_layout -> the bf16 wgmma A operand [rows, BLOCK_K] in pair order (decode.py's PTX
    decoders: the launchers pass a PTX decode code)."""
    gl.static_assert(DECODE != DECODE_BITS, "the warp-specialised kernels decode with PTX only")
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
def _activation_rows(x_ptr, stride_xm, sorted_ptr, start, num_pairs, TOPK: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_K: gl.constexpr):
    """Pointers to the first BLOCK_K elements of a row block's ROWS activation rows (x row = pair // TOPK),
    16 bytes per thread along each row, and which rows are real pairs (padding is zero-filled)."""
    TX: gl.constexpr = BLOCK_K // 8  # 16-byte pieces per activation row
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TX, TX], [gl.num_warps(), 1], [1, 0])
    pair = gl.load(sorted_ptr + start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, xl)))
    rows = (x_ptr + ((pair // TOPK).to(gl.int64) * stride_xm)[:, None]
            + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xl))[None, :])
    return rows, (pair < num_pairs)[:, None]


@gluon.jit
def _factors(sc, off, FMT: gl.constexpr, DECODE: gl.constexpr, HAS_OFFSETS: gl.constexpr):
    """A K step's scale and offset operands of the PTX decoders (decode.factor_pair); no offsets: -0."""
    f = factor_pair(sc, FMT, DECODE)
    if HAS_OFFSETS:
        p = factor_pair(off, FMT, DECODE)
    else:
        p = f * 0 + NEG_ZERO_PAIR
    return f, p


@gluon.jit
def _loader(x_ptr, stride_xm, sorted_ptr, start, num_pairs, w_ptr, w_base, stride_wn, n0, inter_size,
            x_bufs, xt_bufs, raw_bufs, loaded, empty, hidden: gl.constexpr, TOPK: gl.constexpr, BLOCK_M: gl.constexpr,
            TAIL_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of each K step's packed weight words and activation rows into slot i % STAGES; padding
    rows and columns past inter_size are zero-filled."""
    rows, ok = _activation_rows(x_ptr, stride_xm, sorted_ptr, start, num_pairs, TOPK, BLOCK_M, BLOCK_K)
    if TAIL_M > 0:
        rows_t, ok_t = _activation_rows(x_ptr, stride_xm, sorted_ptr, start + BLOCK_M, num_pairs, TOPK, TAIL_M,
                                        BLOCK_K)
    W: gl.constexpr = gl.num_warps()
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
    og = sg  # unused without offsets
    ou = su
    if HAS_OFFSETS:
        og = gl.load(o_ptr + so_g, mask=ok, other=0)
        ou = gl.load(o_ptr + so_u, mask=ok, other=0)
    # Two copies of the step, so the registers of one step's A operands are written again only after the
    # other step's wait has retired their wgmmas (wgmma reads them after issue; deps cannot keep them: see
    # docs/TRITON.md)
    gl.static_assert(STEPS % 2 == 0, "the K loop runs in pairs of steps")
    for j in range(STEPS // 2):
        for u in gl.static_range(2):
            i = 2 * j + u
            s = i % STAGES
            nxt = ok & (i + 1 < STEPS)
            sg_next = gl.load(s_ptr + so_g + (i + 1) * GROUPS, mask=nxt, other=0)
            su_next = gl.load(s_ptr + so_u + (i + 1) * GROUPS, mask=nxt, other=0)
            if HAS_OFFSETS:
                og_next = gl.load(o_ptr + so_g + (i + 1) * GROUPS, mask=nxt, other=0)
                ou_next = gl.load(o_ptr + so_u + (i + 1) * GROUPS, mask=nxt, other=0)
            fg, pg = _factors(sg, og, FMT, DECODE, HAS_OFFSETS)
            fu, pu = _factors(su, ou, FMT, DECODE, HAS_OFFSETS)
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
                acc_g, acc_u, acc_gt, acc_ut = warpgroup_mma_wait(
                    num_outstanding=MMAS, deps=(acc_g, acc_u, acc_gt, acc_ut))
            else:
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=MMAS, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)  # the step before is done
            sg = sg_next
            su = su_next
            if HAS_OFFSETS:
                og = og_next
                ou = ou_next
    if TAIL_M > 0:
        acc_g, acc_u, acc_gt, acc_ut = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u, acc_gt, acc_ut))
    else:
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
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
    _store_rows(h, sorted_ptr, start, num_pairs, inter_ptr, stride_im, n0, inter_size, BLOCK_N, ROWS)


@gluon.jit
def _store_rows(h, sorted_ptr, start, num_pairs, out_ptr, stride_om, n0, n_size, BLOCK_N: gl.constexpr,
                ROWS: gl.constexpr):
    """h ([ROWS, BLOCK_N] bf16) into out at its real rows' pairs, columns n0.. below n_size, 16 bytes
    per store along each row."""
    W: gl.constexpr = gl.num_warps()
    out: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_N, BLOCK_N // 8], [W, 1], [1, 0])
    h = gl.convert_layout(h, out)
    pair = gl.load(sorted_ptr + start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out)))
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out))
    ptr = out_ptr + pair.to(gl.int64)[:, None] * stride_om + n[None, :]
    gl.store(ptr, h, mask=(pair < num_pairs)[:, None] & (n < n_size)[None, :])


@gluon.jit
def _ring(WEIGHT_ROWS: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr,
          BLOCK_K: gl.constexpr, X_SLOTS: gl.constexpr):
    """The shared memory both kernels' partitions share: STAGES slots of packed weight words
    [WEIGHT_ROWS, BLOCK_K / 8], X_SLOTS of activation rows [BLOCK_M, BLOCK_K] (and of the tail's, in a
    buffer of their own: each is a wgmma B operand), and each slot's barriers: `loaded` (each loader
    thread arrives as its copies land) and `empty` (the MMA warps, once a slot's wgmmas are done)."""
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, WEIGHT_ROWS, BLOCK_K // 8], plain)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [X_SLOTS, BLOCK_M, BLOCK_K], x_layout)
    if TAIL_M > 0:
        xt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TAIL_M, BLOCK_K], gl.bfloat16)
        xt_bufs = gl.allocate_shared_memory(gl.bfloat16, [X_SLOTS, TAIL_M, BLOCK_K], xt_layout)
    else:
        xt_bufs = x_bufs
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(loaded.index(s), count=LOADER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    return raw_bufs, x_bufs, xt_bufs, loaded, empty


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
    raw_bufs, x_bufs, xt_bufs, loaded, empty = _ring(2 * BLOCK_N, STAGES, BLOCK_M, TAIL_M, BLOCK_K, STAGES)
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


@gluon.jit
def _loader2(inter_ptr, stride_im, sorted_ptr, start, num_pairs, w_ptr, w_base, stride_wn, g0, hidden,
             x_bufs, xt_bufs, raw_bufs, loaded, empty, inter_size: gl.constexpr, BLOCK_M: gl.constexpr,
             TAIL_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, N_TILES: gl.constexpr,
             STAGES: gl.constexpr):
    """Stage 2's loader: step i = (tile t, K step k) fills ring slot i % STAGES with the tile's packed
    W2 words and, on the first tile only, the block's inter columns of step k into their own buffer
    (x_bufs[k]: all of K stays for every tile)."""
    rows, ok = _activation_rows(inter_ptr, stride_im, sorted_ptr, start, num_pairs, 1, BLOCK_M, BLOCK_K)
    if TAIL_M > 0:
        rows_t, ok_t = _activation_rows(inter_ptr, stride_im, sorted_ptr, start + BLOCK_M, num_pairs, 1, TAIL_M,
                                        BLOCK_K)
    W: gl.constexpr = gl.num_warps()
    WORDS: gl.constexpr = BLOCK_K // 8
    TW: gl.constexpr = WORDS // 4  # 16-byte pieces per weight row
    wl: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TW, TW], [W, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
    cols = gl.arange(0, WORDS, layout=gl.SliceLayout(0, wl))[None, :]
    STEPS: gl.constexpr = inter_size // BLOCK_K
    for t in range(N_TILES):
        n = g0 + t * BLOCK_N + r
        words = (w_ptr + w_base + n.to(gl.int64)[:, None] * stride_wn).to(gl.pointer_type(gl.int32)) + cols
        w_ok = (n < hidden)[:, None]
        for k in range(STEPS):
            i = t * STEPS + k
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            async_load(raw_bufs.index(s), words + k * WORDS, mask=w_ok)
            if t == 0:
                async_load(x_bufs.index(k), rows + k * BLOCK_K, mask=ok)
                if TAIL_M > 0:
                    async_load(xt_bufs.index(k), rows_t + k * BLOCK_K, mask=ok_t)
            async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)


@gluon.jit
def _store_y(acc, sorted_ptr, start, num_pairs, topk_w_ptr, y_ptr, stride_ym, n0, hidden, BLOCK_N: gl.constexpr,
             ROWS: gl.constexpr):
    """y[pair, n0 + n] = router weight x acc[n, row] for one tile's real rows (as the aligned kernels'
    _store_y: scaled in fp32, then rounded to bf16)."""
    pair_c = gl.load(sorted_ptr + start + gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc.type.layout)))
    gate = gl.load(topk_w_ptr + pair_c, mask=pair_c < num_pairs, other=0.0).to(gl.float32)
    h = gl.permute((acc * gate[None, :]).to(gl.bfloat16), [1, 0])
    _store_rows(h, sorted_ptr, start, num_pairs, y_ptr, stride_ym, n0, hidden, BLOCK_N, ROWS)


@gluon.jit
def _mma2(s_ptr, o_ptr, s_base, stride_sn, g0, hidden, topk_w_ptr, sorted_ptr, start, num_pairs, y_ptr, stride_ym,
          raw_bufs, x_bufs, xt_bufs, loaded, empty, inter_size: gl.constexpr, WEIGHTS: gl.constexpr,
          BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          N_TILES: gl.constexpr, STAGES: gl.constexpr):
    """Stage 2's MMA warps: per tile, the K loop on the ring (decoded W2 words as the register A operand,
    the block's inter columns from shared memory as B; a step's wgmmas in flight while the next decodes),
    then the tile's y stored while the loader fills the ring with the next tile's words."""
    FMT: gl.constexpr = WEIGHT_FMT[WEIGHTS]
    DECODE: gl.constexpr = WEIGHT_DECODE[WEIGHTS]
    HAS_OFFSETS: gl.constexpr = WEIGHT_OFFSETS[WEIGHTS]
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BLOCK_M, 16])
    dot: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    if TAIL_M > 0:
        mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                        instr_shape=[16, TAIL_M, 16])
        dot_t: gl.constexpr = gl.DotOperandLayout(0, mma_t, 2)
    wl: gl.constexpr = word_layout(BLOCK_N, BLOCK_K, W)
    MMAS: gl.constexpr = 2 if TAIL_M > 0 else 1  # wgmma groups per step
    GROUPS: gl.constexpr = BLOCK_K // 32
    STEPS: gl.constexpr = inter_size // BLOCK_K
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
    so = (s_base + (g0 + r).to(gl.int64)[:, None] * stride_sn
          + (gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, wl)) // 4)[None, :])
    ok = (g0 + r < hidden)[:, None]
    sc = gl.load(s_ptr + so, mask=ok, other=0)
    off = sc  # unused without offsets
    if HAS_OFFSETS:
        off = gl.load(o_ptr + so, mask=ok, other=0)
    gl.static_assert(STEPS % 2 == 0, "the K loop runs in pairs of steps (see _mma)")
    for t in range(N_TILES):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
        if TAIL_M > 0:
            acc_t = gl.zeros([BLOCK_N, TAIL_M], gl.float32, layout=mma_t)
        for kk in range(STEPS // 2):
            for u in gl.static_range(2):
                k = 2 * kk + u
                i = t * STEPS + k
                s = i % STAGES
                # the next step's scales: this tile's next K step, or the next tile's first
                t1 = (i + 1) // STEPS
                nxt = (g0 + t1 * BLOCK_N + r < hidden)[:, None] & (i + 1 < N_TILES * STEPS)
                so_next = so + t1 * BLOCK_N * stride_sn + ((i + 1) % STEPS) * GROUPS
                sc_next = gl.load(s_ptr + so_next, mask=nxt, other=0)
                if HAS_OFFSETS:
                    off_next = gl.load(o_ptr + so_next, mask=nxt, other=0)
                f, p = _factors(sc, off, FMT, DECODE, HAS_OFFSETS)
                mbarrier.wait(loaded.index(s), (i // STAGES) & 1)
                a = _decode_operand(raw_bufs.index(s).load(wl), f, p, dot, FMT, DECODE, BLOCK_K)
                fence_async_shared()
                acc = warpgroup_mma(a, x_bufs.index(k).permute((1, 0)), acc, is_async=True)
                if TAIL_M > 0:
                    acc_t = warpgroup_mma(gl.convert_layout(a, dot_t, assert_trivial=True),
                                          xt_bufs.index(k).permute((1, 0)), acc_t, is_async=True)
                    acc, acc_t = warpgroup_mma_wait(num_outstanding=MMAS, deps=(acc, acc_t))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=MMAS, deps=[acc])
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)  # the step before is done
                sc = sc_next
                if HAS_OFFSETS:
                    off = off_next
        n0 = g0 + t * BLOCK_N
        if TAIL_M > 0:
            acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        _store_y(acc, sorted_ptr, start, num_pairs, topk_w_ptr, y_ptr, stride_ym, n0, hidden, BLOCK_N, BLOCK_M)
        if TAIL_M > 0:
            _store_y(acc_t, sorted_ptr, start + BLOCK_M, num_pairs, topk_w_ptr, y_ptr, stride_ym, n0, hidden,
                     BLOCK_N, TAIL_M)


@gluon.jit(do_not_specialize=["num_pairs"])
def ws_stage2_kernel(
    inter_ptr, stride_im,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    y_ptr, stride_ym,
    topk_w_ptr,
    sorted_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, hidden, inter_size: gl.constexpr,
    WEIGHTS: gl.constexpr, BLOCK_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    N_TILES: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
):
    """y[pair, n] = router_weight[pair] * (inter[pair] . W2_e[n]) for one row block and N_TILES tiles of
    BLOCK_N columns, as matmul_kernels.stage2_aligned_kernel with ORDER pairs (inter in pair order). The
    block's inter rows (all of K = I: block rows x I bf16 in shared memory) are loaded once, with the first
    tile's steps; the W2 words stream through the ring for every tile."""
    enter(PDL)
    TAIL_M: gl.constexpr = BLOCK_ROWS & -BLOCK_ROWS if BLOCK_ROWS & (BLOCK_ROWS - 1) else 0
    BLOCK_M: gl.constexpr = BLOCK_ROWS - TAIL_M
    groups = gl.cdiv(hidden, BLOCK_N * N_TILES)
    pid = gl.program_id(0)
    pid_m = pid // groups
    g0 = (pid % groups) * (BLOCK_N * N_TILES)
    start = pid_m * BLOCK_ROWS
    if start >= gl.load(num_rows_ptr):
        return
    e = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    # all of K's inter columns stay for every tile: one activation buffer per K step
    raw_bufs, x_bufs, xt_bufs, loaded, empty = _ring(BLOCK_N, STAGES, BLOCK_M, TAIL_M, BLOCK_K,
                                                     inter_size // BLOCK_K)
    gl.warp_specialize([
        (_mma2, (s_ptr, o_ptr, e * stride_se, stride_sn, g0, hidden, topk_w_ptr, sorted_ptr, start, num_pairs,
                 y_ptr, stride_ym, raw_bufs, x_bufs, xt_bufs, loaded, empty, inter_size, WEIGHTS, BLOCK_M, TAIL_M,
                 BLOCK_N, BLOCK_K, N_TILES, STAGES)),
        (_loader2, (inter_ptr, stride_im, sorted_ptr, start, num_pairs, w_ptr, e * stride_we, stride_wn, g0, hidden,
                    x_bufs, xt_bufs, raw_bufs, loaded, empty, inter_size, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K,
                    N_TILES, STAGES)),
    ], [LOADER_WARPS], [LOADER_REGS])
