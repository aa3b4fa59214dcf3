"""The two MoE GEMM kernels (stage 1 and stage 2) as one FlyDSL builder.

Workgroup (bid_m, bid_n, bid_k): BM sorted rows of one expert (BE[bid_m]) times
BN output columns; `waves` waves side by side along N, each with n_rep 16-column
sub-tiles (two each on stage 1: gate and up of the same columns) and BM/16 row
sub-tiles. The K loop is a runtime loop carrying the accumulators. Stage 1 gathers
its activation rows by token (SID[p] // top_k) and applies the activation to fp32
(gate, up) pairs held by the same lane; stage 2 reads stage 1's rows in sorted
order, scales by the router weight and stores one bf16 row per (token, slot), or
adds fp32 atomically per token. Indices and decode formulas are `layout.py`'s.

Compiled for gfx942 and gfx950 on a CPU; never run on AMD hardware here.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D
from kimi_k3_moe.kernels.flydsl.config import KernelConfig


# ------------------------------------------------------------------------- trace-time helpers
# Plain functions (not rewritten by FlyDSL's AST pass): Python `if`s here are
# compile-time choices, and their loops unroll.
def _activation_rsrc(cfg, A, num_tokens, num_rows):
    if cfg.stage == 1:
        return D.rsrc(fx.get_iter(A), fx.Int64(num_tokens) * (cfg.K * 2))   # token T (padding) reads 0
    return D.rsrc(fx.get_iter(A), fx.Int64(num_rows) * (cfg.K * 2))


def _activation_rows(cfg, slots, p_rows):
    """Stage 1 gathers hidden rows by token; stage 2 reads stage 1's rows in sorted order."""
    if cfg.stage == 1:
        return [L.slot_token(s, cfg.top_k) for s in slots]
    return list(p_rows)


def _weight_rows(cfg, bid_m, bid_n, wave, r):
    rows = []
    for ni in range(cfg.n_rep):
        n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.n_rep)[1]
        if cfg.stage == 1:
            rows.append([L.gate_up_row(n0 + r, gu, cfg.N) for gu in range(2)])
        else:
            rows.append([n0 + r])
    return [row for pair in rows for row in pair]      # index wi = ni * n_gu + gu


def _lds_plan(cfg, tile_type, tid, bid_m, rsid):
    """LDS pointer and, per copy round, (activation row, staged row, chunk column) of this thread."""
    if not cfg.a_lds:
        return None, []
    smem = fx.SharedAllocator().allocate(tile_type).peek()
    lds = fx.recast_iter(fx.Int32, smem.x.ptr)
    plan = []
    for c0 in range(0, cfg.BM * 16 * cfg.kb_unroll, cfg.threads):
        row, cc = L.lds_chunk_coords(tid + c0, cfg.kb_unroll)
        p = bid_m * cfg.BM + row
        a_row = L.slot_token(D.load_i32(rsid, L.sid_byte_offset(p)), cfg.top_k) if cfg.stage == 1 else p
        plan.append((a_row, row, cc))
    return lds, plan


def _stage_tile(cfg, ra, lds, plan, kb0):
    """Cooperative copy of the BM x 128*U activation tile of blocks kb0.. into LDS."""
    if not cfg.a_lds:
        return
    for a_row, row, cc in plan:
        v = D.load_v4i32(ra, L.staged_act_byte_offset(a_row, kb0, cc, cfg.K))
        fx.ptr_store(v, fx.add_offset(lds, L.lds_byte_offset(row, cc * 8, cfg.kb_unroll) >> 2))
    gpu.barrier()


def _end_tile(cfg):
    if cfg.a_lds:
        gpu.barrier()   # the next round's copy must not overwrite a tile still being read


def _load_weights(cfg, rw, rs, ro, w_rows, kb, g):
    words, scales, offsets = [], [], []
    for row in w_rows:
        gi = L.group_index(row, kb, g, cfg.K)
        words.append(D.load_v4i32(rw, L.w_byte_offset(row, kb, g, cfg.K)))
        scales.append(D.load_scale(cfg, rs, gi))
        offsets.append(D.load_offset(ro, gi) if cfg.has_offsets else None)
    return words, scales, offsets


def _load_activations(cfg, ra, lds, a_rows, kb, u, g, r):
    """v8bf16 fragments [mi * 4 + j]: rows a_rows[mi], k = 128*kb + 32g + 8j + [0, 8)."""
    xs = []
    for mi in range(cfg.BM // L.MFMA_TILE):
        for j in range(4):
            if cfg.a_lds:
                lofs = L.lds_byte_offset(mi * L.MFMA_TILE + r, u * L.K_BLOCK + g * L.GROUP + j * 8, cfg.kb_unroll)
                xv = fx.Vector(fx.ptr_load(fx.add_offset(lds, lofs >> 2), T.vec(4, T.i32)))
            else:
                xv = D.load_v4i32(ra, L.act_byte_offset(a_rows[mi], kb, g, j, cfg.K))
            xs.append(xv.bitcast(fx.BFloat16))
    return xs


def _mma_block(cfg, accs, words, scales, offsets, xs):
    """4 MFMA steps over one K128 block for every (weight sub-tile, row sub-tile) pair."""
    m_rep = cfg.BM // L.MFMA_TILE
    new = list(accs)
    for j in range(4):
        for wi in range(len(words)):
            w8 = D.dequant8(cfg, fx.Int32(words[wi][j]), scales[wi], offsets[wi])
            for mi in range(m_rep):
                a = wi * m_rep + mi
                new[a] = D.mma(cfg, new[a], w8, xs[mi * 4 + j])
    return new


def _epilogue(cfg, accs, Y, TW, slots, p_rows, num_tokens, num_rows, beta, lin_beta,
              bid_m, bid_n, wave, g):
    m_rep = cfg.BM // L.MFMA_TILE
    N = cfg.N
    if cfg.stage == 1:
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_rows) * (N * 2))
        params = D.activation_params(cfg, beta, lin_beta)
        for ni in range(cfg.n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.n_rep)[1]
            for mi in range(m_rep):
                gate = accs[(ni * 2 + 0) * m_rep + mi]
                up = accs[(ni * 2 + 1) * m_rep + mi]
                ys = [D.activate(cfg, params, fx.Float32(gate[e]), fx.Float32(up[e])) for e in range(4)]
                packed = fx.Vector.from_elements(ys, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)
                D.store(packed, ry, L.inter_byte_offset(p_rows[mi], n0 + g * 4, N))
        return
    rtw = D.rsrc(fx.get_iter(TW), fx.Int64(num_tokens) * (cfg.top_k * 4))      # padding slot reads 0
    weights = [D.load_f32(rtw, L.router_weight_byte_offset(s)) for s in slots]
    if cfg.reduce == "slots":
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * (cfg.top_k * N * 2))  # padding slot: dropped
    else:
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * (N * 4))              # token T: dropped
    for ni in range(cfg.n_rep):
        n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.n_rep)[1]
        for mi in range(m_rep):
            acc = accs[ni * m_rep + mi]
            ys = [fx.Float32(acc[e]) * weights[mi] for e in range(4)]
            if cfg.reduce == "slots":
                packed = fx.Vector.from_elements(ys, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)
                D.store(packed, ry, L.slot_out_byte_offset(slots[mi], n0 + g * 4, N))
            else:
                token = L.slot_token(slots[mi], cfg.top_k)
                for e in range(4):
                    D.atomic_add_f32(ys[e], ry, L.acc_byte_offset(token, n0 + g * 4 + e, N))


# ------------------------------------------------------------------------- builder
def build(cfg: KernelConfig):
    """The @flyc.jit launcher of one configuration.

    launcher(A, W, S, OFS, SID, BE, TW, Y, num_tokens, num_rows, beta, lin_beta[, stream])
      stage 1: A = hidden [T*H] bf16, Y = INTER [P*I] bf16 (TW unused)
      stage 2: A = INTER [P*I] bf16, TW = topk_weights [T*k] f32,
               Y = SLOTS [T*k*H] bf16 (reduce="slots") or ACC [T*H] f32 (reduce="atomic")
      W/S/OFS: one layer's experts, flat; OFS is read only when cfg.has_offsets.
      num_rows = P (a multiple of BM); beta/lin_beta are read only for runtime-beta situv2.
    """
    BM, BN, R, K = cfg.BM, cfg.BN, cfg.weight_rows, cfg.K
    m_rep = BM // L.MFMA_TILE
    n_acc = (2 if cfg.stage == 1 else 1) * cfg.n_rep * m_rep
    iters, U, threads = cfg.k_iters, cfg.kb_unroll, cfg.threads
    code_stride = L.expert_code_base(1, R, K)
    group_stride = L.expert_group_base(1, R, K)

    @fx.struct
    class ActTile:
        x: fx.Array[fx.Int32, max(BM * L.lds_row_bytes(U) // 4, 4), 16]

    @flyc.kernel(name=cfg.name, known_block_size=[threads, 1, 1])
    def k3moe(A: fx.Tensor, W: fx.Tensor, S: fx.Tensor, OFS: fx.Tensor, SID: fx.Tensor, BE: fx.Tensor,
              TW: fx.Tensor, Y: fx.Tensor, num_tokens: fx.Int32, num_rows: fx.Int32,
              beta: fx.Float32, lin_beta: fx.Float32):
        tid = fx.thread_idx.x
        lane = tid & 63
        wave = fx.Int32(rocdl.readfirstlane(T.i32, (tid >> 6).ir_value()))
        g, r = L.lane_split(lane)
        bid_m = fx.block_idx.x
        bid_n = fx.block_idx.y
        bid_k = fx.block_idx.z
        expert = rocdl.s_buffer_load(rocdl.make_buffer_ptr(fx.get_iter(BE)), bid_m)
        if expert >= 0:                                   # unused alignment blocks exit at once
            e64 = fx.Int64(expert)
            rw = D.rsrc(D.expert_ptr(W, e64 * code_stride))
            rs = D.rsrc(D.expert_ptr(S, e64 * group_stride))
            ro = D.rsrc(D.expert_ptr(OFS, e64 * group_stride))
            rsid = D.rsrc(fx.get_iter(SID))
            ra = _activation_rsrc(cfg, A, num_tokens, num_rows)
            p_rows = [L.tile_origin(bid_m, bid_n, wave, 0, mi, BM, BN, cfg.n_rep)[0] + r
                      for mi in range_constexpr(m_rep)]
            slots = [D.load_i32(rsid, L.sid_byte_offset(p)) for p in p_rows]
            a_rows = _activation_rows(cfg, slots, p_rows)
            w_rows = _weight_rows(cfg, bid_m, bid_n, wave, r)
            lds, plan = _lds_plan(cfg, ActTile, tid, bid_m, rsid)

            accs = [fx.Vector.filled(4, 0.0, fx.Float32) for _ in range_constexpr(n_acc)]
            for it in range(iters):
                kb0 = (fx.Int32(bid_k) * iters + fx.Int32(it)) * U
                _stage_tile(cfg, ra, lds, plan, kb0)
                for u in range_constexpr(U):
                    kb = kb0 + u
                    words, scales, offsets = _load_weights(cfg, rw, rs, ro, w_rows, kb, g)
                    xs = _load_activations(cfg, ra, lds, a_rows, kb, u, g, r)
                    accs = _mma_block(cfg, accs, words, scales, offsets, xs)
                _end_tile(cfg)

            _epilogue(cfg, accs, Y, TW, slots, p_rows, num_tokens, num_rows, beta, lin_beta,
                      bid_m, bid_n, wave, g)

    @flyc.jit
    def launch(A: fx.Tensor, W: fx.Tensor, S: fx.Tensor, OFS: fx.Tensor, SID: fx.Tensor, BE: fx.Tensor,
               TW: fx.Tensor, Y: fx.Tensor, num_tokens: fx.Int32, num_rows: fx.Int32,
               beta: fx.Float32, lin_beta: fx.Float32, stream: fx.Stream = fx.Stream(None)):
        k3moe(A, W, S, OFS, SID, BE, TW, Y, num_tokens, num_rows, beta, lin_beta).launch(
            grid=(num_rows // BM, cfg.N // BN, cfg.split_k), block=(threads, 1, 1), stream=stream)

    if cfg.waves_per_eu:
        launch.compile_hints = {**launch.compile_hints, "waves_per_eu": cfg.waves_per_eu}
    # FlyDSL names the host function and the disk-cache folder after this; the
    # config name carries the activation and the exact beta bits.
    launch.func.__name__ = cfg.name
    return launch
