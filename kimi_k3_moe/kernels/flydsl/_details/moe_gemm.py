"""The two MoE GEMM kernels (stage 1 and stage 2) as one FlyDSL builder with one kernel body.

Workgroup (bid_m, bid_n, bid_k): BM sorted rows of one expert (BE[bid_m]) times
BN output columns; `waves` waves side by side along N, each with n_rep 16-column
sub-tiles (two each on stage 1: gate and up of the same columns) and BM/16 row
sub-tiles. The K loop is a runtime loop carrying the accumulators. Stage 1 gathers
its activation rows by token (SID[p] // top_k); stage 2 reads stage 1's rows in sorted
order. The epilogues are `epilogues.py`'s; the loop's loads and MFMAs `workgroup.py`'s;
indices and decode formulas `layout.py`'s.

Quantized activations (gfx950, cfg.act_dtype "fp8"/"fp4"): both stages read e4m3
or e2m1 activation codes with an e8m0 byte per 32 and run one
v_mfma_scale_f32_16x16x128_f8f6f4 per K128 block and tile (weights as the e2m1 A
operand with their own e8m0 scales); stage 1 quantizes its result per 32 columns
for stage 2. `act_quant_kernel.py` quantizes the hidden rows before stage 1.

Compiled for gfx942 and gfx950 on a CPU; never run on AMD hardware here.
"""

import inspect

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, rocdl
from flydsl.expr.typing import T

from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D
from kimi_k3_moe.kernels.flydsl._details import workgroup as WG
from kimi_k3_moe.kernels.flydsl._details.epilogues import finish
from kimi_k3_moe.kernels.flydsl._details.top_k_sum import arrive, row_locals, sum_token
from kimi_k3_moe.kernels.flydsl._details.workgroup import KernelArgs, Operands, Place
from kimi_k3_moe.kernels.flydsl.config import FlyKernelConfig

TENSORS = ("A", "W", "S", "OFS", "SID", "BE", "TW", "Y")
SCALARS = (("num_tokens", fx.Int32), ("num_rows", fx.Int32), ("beta", fx.Float32), ("lin_beta", fx.Float32))


def kernel_params(cfg: FlyKernelConfig) -> list[inspect.Parameter]:
    """The kernel's arguments, in order. Quantized kernels take the activation scales AS and stage 1's
    output scales YS; a summing stage 2 the output OUT and BOOK (layout.py). The other bf16 kernels
    keep the shortest list: two more (unused) kernel arguments changed LLVM's scheduling of them
    (measured 46 -> 92 VGPRs on gfx950 stage 1)."""
    extra = ("AS", "YS") if cfg.quantized else ("OUT", "BOOK") if cfg.sums_tokens else ()
    tensors = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=fx.Tensor)
               for n in (*TENSORS, *extra)]
    return tensors + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in SCALARS]


def _with_params(fn, params):
    """`fn(**kwargs)` as FlyDSL sees it: a function of exactly `params` (both read inspect.signature)."""
    fn.__signature__ = inspect.Signature(params)
    return fn


def build(cfg: FlyKernelConfig):
    """The @flyc.jit launcher of one configuration.

    launcher(A, W, S, OFS, SID, BE, TW, Y, num_tokens, num_rows, beta, lin_beta[, stream])
      stage 1: A = hidden [T*H] bf16, Y = INTER [P*I] bf16 (TW unused)
      stage 2: A = INTER [P*I] bf16, TW = topk_weights [T*k] f32,
               Y = SLOTS [T*k*H] bf16 (reduce="slots") or ACC [T*H] f32 (reduce="atomic")
    quantized (cfg.act_dtype fp8/fp4), two more tensors after Y:
    launcher(A, W, S, OFS, SID, BE, TW, Y, AS, YS, num_tokens, num_rows, beta, lin_beta[, stream])
      A holds codes (uint8) and AS their e8m0 bytes [rows * K/32]; stage 1 writes codes to Y
      (uint8) and e8m0 bytes to YS [P * I/32] (stage 2 leaves YS alone).
    summing stage 2 (reduce="fused"), OUT [T*H] bf16 and BOOK (layout.py) after Y.
      W/S/OFS: one layer's experts, flat; OFS is read only when cfg.has_offsets.
      num_rows = P (a multiple of BM); beta/lin_beta are read only for runtime-beta situv2.
    """
    tile, schedule = cfg.tile, cfg.tile.schedule
    BM, BN, R, K = cfg.BM, cfg.BN, cfg.weight_rows, cfg.shape.K
    m_rep = BM // L.MFMA_TILE
    n_acc = (2 if cfg.stage == 1 else 1) * tile.n_rep * m_rep
    iters, U, threads = cfg.k_iters, tile.kb_unroll, cfg.threads
    n_partials = tile.k_waves * tile.waves * n_acc * L.LANES * 4 if tile.k_waves > 1 else 0
    code_stride = L.expert_code_base(1, R, K)
    group_stride = L.expert_group_base(1, R, K)

    # LDS, one allocation (FlyDSL takes one per kernel): the staged activation tile, the K waves'
    # partial sums, or a summing stage 2's arrivals; each is done with before the next is written
    tile_words = BM * L.lds_row_bytes(U) // 4 if schedule.staged else 0
    lds_words = max(tile_words * schedule.lds_buffers, n_partials, 2 * BM if cfg.sums_tokens else 0)

    @fx.struct
    class Scratch:
        x: fx.Array[fx.Int32, max(lds_words, 4), 16]

    def prologue(tid, BE):
        lane = tid & 63
        wave = fx.Int32(rocdl.readfirstlane(T.i32, (tid >> 6).ir_value()))
        wave, wave_k = (wave, 0) if tile.k_waves == 1 else L.wave_split(wave, tile.waves)
        g, r = L.lane_split(lane)
        expert = rocdl.s_buffer_load(rocdl.make_buffer_ptr(fx.get_iter(BE)), fx.block_idx.x)
        return lane, wave, wave_k, g, r, expert

    def operands(args: KernelArgs, expert, tid, wave, wave_k, r):
        bid_m, bid_n = fx.block_idx.x, fx.block_idx.y
        e64 = fx.Int64(expert)
        rw = D.rsrc(D.expert_ptr(args.W, e64 * code_stride))
        rs = D.rsrc(D.expert_ptr(args.S, e64 * group_stride))
        ro = D.rsrc(D.expert_ptr(args.OFS, e64 * group_stride))
        rsid = D.rsrc(fx.get_iter(args.SID))
        ra = WG.activation_rsrc(cfg, args.A, args.num_tokens, args.num_rows)
        ras = WG.act_scale_rsrc(cfg, args.AS, args.num_tokens, args.num_rows)
        p_rows = [L.tile_origin(bid_m, bid_n, wave, 0, mi, BM, BN, tile.n_rep)[0] + r for mi in range(m_rep)]
        sentinel = args.num_tokens * cfg.shape.top_k
        slots = [WG.row_slot(cfg, rsid, p, sentinel) for p in p_rows]
        a_rows = WG.activation_rows(cfg, slots, p_rows)
        w_rows = WG.weight_rows(cfg, bid_m, bid_n, wave, r)
        lds = fx.recast_iter(fx.Int32, fx.SharedAllocator().allocate(Scratch).peek().x.ptr) if lds_words else None
        plan = WG.lds_plan(cfg, lds, tid, bid_m, rsid, sentinel)
        accs = [fx.Vector.filled(4, 0.0, fx.Float32) for _ in range(n_acc)]
        high = D.int4_word_high() if cfg.weight_format == INT4 else None
        return Operands(rw, rs, ro, ra, ras, lds, plan, w_rows, a_rows, high, slots, p_rows, rsid, wave_k), accs

    tile_len = len(range(0, BM * 16 * U, threads)) if schedule.staged else 0

    def first_block(ops, it):
        return L.k_block(fx.Int32(fx.block_idx.z), ops.wave_k, it, 0, tile.k_waves, iters, U)

    def load_iteration(ops, it, g):
        """Every global load of K iteration `it` (its U blocks and its staged tile share), flat."""
        kb0 = first_block(ops, it)
        loaded = WG.load_tile(cfg, ops.ra, ops.plan, kb0)
        for u in range(U):
            loaded += WG.load_block(cfg, ops, kb0 + u, g)
        return loaded

    def compute_iteration(ops, accs, loaded, g, r):
        WG.store_tile(cfg, ops.lds, ops.plan, loaded[:tile_len])
        per_block = (len(loaded) - tile_len) // U
        for u in range(U):
            block = loaded[tile_len + u * per_block:tile_len + (u + 1) * per_block]
            accs = WG.compute_block(cfg, accs, block, ops.lds, u, g, r, ops.high)
        WG.end_tile(cfg)
        return accs

    def load_and_compute_iteration(ops, accs, it, g, r):
        """The staged tile first (loaded, stored, barrier), then each block's loads right before its
        MFMAs, so no block's weights stay live across the barrier."""
        kb0 = first_block(ops, it)
        WG.stage_tile(cfg, ops.ra, ops.lds, ops.plan, kb0)
        for u in range(U):
            block = WG.load_block(cfg, ops, kb0 + u, g)
            accs = WG.compute_block(cfg, accs, block, ops.lds, u, g, r, ops.high)
        WG.end_tile(cfg)
        return accs

    def tile_buffer(ops, it):
        """The LDS buffer iteration `it` reads (double buffer: it's parity; `it` may be a runtime value)."""
        return ops.lds if not schedule.double_buffered else \
            fx.add_offset(ops.lds, L.lds_tile_byte_base(it, BM, U, schedule.lds_buffers) >> 2)

    def compute_blocks(ops, accs, loaded, lds, g, r):
        """The MFMAs of the iteration's U blocks on their carried loads (no staged tile among them)."""
        per_block = len(loaded) // U
        for u in range(U):
            accs = WG.compute_block(cfg, accs, loaded[u * per_block:(u + 1) * per_block], lds, u, g, r, ops.high)
        return accs

    def double_buffered_step(ops, accs, carried, it, g, r):
        """Iteration it+1's tile share, then its weights, are issued; iteration it's MFMAs read the
        tile in buffer it & 1 and the carried weights; the new share goes into the other buffer and
        one barrier makes it readable (every wave is past its reads of that buffer from iteration
        it-1, which ended with the previous barrier). The tile's loads are the oldest in flight, so
        the wait before its store leaves the weights' loads outstanding."""
        nxt = load_iteration(ops, it + 1, g)
        rocdl.sched_barrier(0)   # LLVM's scheduler keeps the loads above the MFMAs and the store below
        accs = compute_blocks(ops, accs, carried, tile_buffer(ops, it), g, r)
        rocdl.sched_barrier(0)
        WG.store_tile(cfg, tile_buffer(ops, it + 1), ops.plan, nxt[:tile_len])
        return accs, nxt[tile_len:]

    # A prefetching schedule software-pipelines the K loop: iteration it+1's loads are issued before
    # iteration it's MFMAs (carried in registers), so the MFMAs never wait for the block being
    # fetched; the last iteration is peeled. Otherwise each iteration loads, then computes: a
    # load_first schedule every load of the iteration first, else the staged tile first, then each block's.
    k_steps = iters - 1 if schedule.prefetch else iters
    k_unroll = 1 if schedule.prefetch else -1      # a second copy would make LLVM copy the carried registers

    def k_start(ops, g):
        if schedule.double_buffered:     # iteration 0's tile into buffer 0 before the loop
            first = load_iteration(ops, fx.Int32(0), g)
            WG.store_tile(cfg, ops.lds, ops.plan, first[:tile_len])
            return first[tile_len:]
        return load_iteration(ops, fx.Int32(0), g) if schedule.prefetch else []

    def k_step(ops, accs, carried, it, g, r):
        if schedule.double_buffered:
            return double_buffered_step(ops, accs, carried, it, g, r)
        if schedule.prefetch:
            nxt = load_iteration(ops, it + 1, g)
            return compute_iteration(ops, accs, carried, g, r), nxt
        if schedule.load_first:   # the weights' round trip overlaps the tile's store and barrier (more registers)
            return compute_iteration(ops, accs, load_iteration(ops, it, g), g, r), carried
        return load_and_compute_iteration(ops, accs, it, g, r), carried

    def k_finish(ops, accs, carried, g, r):
        if schedule.double_buffered:
            return compute_blocks(ops, accs, carried, tile_buffer(ops, iters - 1), g, r)
        return compute_iteration(ops, accs, carried, g, r) if schedule.prefetch else accs

    def join(ops, accs, wave, lane):
        return WG.reduce_k_waves(cfg, ops.lds, accs, wave, ops.wave_k, lane)

    def epilogue(ops, accs, args, wave, g, lane):
        finish(cfg, accs, args, ops, Place(fx.block_idx.x, fx.block_idx.y, wave, g, lane))

    # One body for every signature (kernel_params): FlyDSL rewrites its `if`s and `for`s into
    # control flow unless the condition is a Python value, so the variants' own steps are
    # compile-time branches here and add nothing to the others' code.
    def k3moe(**given):
        args = KernelArgs(**given)
        tid = fx.thread_idx.x
        lane, wave, wave_k, g, r, expert = prologue(tid, args.BE)
        if WG.live(cfg, expert):                     # unused alignment blocks exit at once
            ops, accs = operands(args, expert, tid, wave, wave_k, r)
            carried = k_start(ops, g)
            for it in range(k_steps, unroll=k_unroll):
                accs, carried = k_step(ops, accs, carried, fx.Int32(it), g, r)
            accs = join(ops, k_finish(ops, accs, carried, g, r), wave, lane)
            if WG.first_k_wave(cfg, wave_k):         # K split over waves: the first one stores
                epilogue(ops, accs, args, wave, g, lane)
            if fx.const_expr(cfg.sums_tokens):       # stage 2 sums the tokens it completes (top_k_sum.py)
                slot, local = row_locals(cfg, args.BOOK, ops.slots, tid)
                D.release_to_agent()
                gpu.barrier()
                if tid < BM:
                    arrive(cfg, args.BOOK, ops.lds, tid, slot, local, args.num_tokens)
                gpu.barrier()
                D.acquire_from_agent()
                if tid < BN // 4:
                    for i in range(BM):
                        token = fx.Int32(fx.ptr_load(fx.add_offset(ops.lds, fx.Int32(i)), T.i32))
                        if token >= 0:
                            sum_token(cfg, args.Y, args.OUT, ops.lds, fx.Int32(i), token, tid, args.num_tokens)

    params = kernel_params(cfg)
    kernel = flyc.kernel(name=cfg.name, known_block_size=[threads, 1, 1])(_with_params(k3moe, params))

    def launch(stream=fx.Stream(None), **given):
        kernel(**given).launch(grid=(given["num_rows"] // BM, cfg.shape.N // BN, cfg.reduction.split_k),
                               block=(threads, 1, 1), stream=stream)

    stream = inspect.Parameter("stream", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=fx.Stream(None),
                               annotation=fx.Stream)
    launch = flyc.jit(_with_params(launch, [*params, stream]))
    if tile.waves_per_eu:
        launch.compile_hints = {**launch.compile_hints, "waves_per_eu": tile.waves_per_eu}
    # FlyDSL names the host function and the disk-cache folder after this; the
    # config name carries the activation and the exact beta bits.
    launch.func.__name__ = cfg.name
    return launch
