"""One workgroup of the MoE GEMM at trace time: its arguments, its place, what it reads, and the K
loop's pieces (activation staging through LDS, each K128 block's loads and MFMAs, the K waves' sum).

Plain functions (not rewritten by FlyDSL's AST pass): Python `if`s here are compile-time choices,
and their loops unroll. Indices and decode formulas are `layout.py`'s.
"""

from typing import Any, NamedTuple

import flydsl.expr as fx
from flydsl.expr import gpu
from flydsl.expr.typing import T

from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D


class KernelArgs(NamedTuple):
    """The kernel's arguments; AS/YS only on quantized kernels, OUT/BOOK only on a summing stage 2."""
    A: Any
    W: Any
    S: Any
    OFS: Any
    SID: Any
    BE: Any
    TW: Any
    Y: Any
    num_tokens: Any
    num_rows: Any
    beta: Any
    lin_beta: Any
    AS: Any = None
    YS: Any = None
    OUT: Any = None
    BOOK: Any = None


class Place(NamedTuple):
    """Where a lane's results go: the workgroup's row block and column tile, the wave, the lane."""
    bid_m: Any
    bid_n: Any
    wave: Any
    g: Any
    lane: Any


class Operands(NamedTuple):
    """What one workgroup's K loop and epilogue read, set up once before the loop: buffer resources
    (weights, scales, offsets, activations and their scales), the staged tile's LDS and plan, each
    lane's weight and activation rows, the int4 decode constant, the rows' slots, and the wave's K slice."""
    rw: Any
    rs: Any
    ro: Any
    ra: Any
    ras: Any
    lds: Any
    plan: Any
    w_rows: Any
    a_rows: Any
    high: Any
    slots: Any
    p_rows: Any
    rsid: Any
    wave_k: Any


def activation_rsrc(cfg, A, num_tokens, num_rows):
    rows = num_tokens if cfg.stage == 1 else num_rows                    # stage 1: token T (padding) reads 0
    row_bytes = L.qact_row_bytes(cfg.shape.K, cfg.act_dtype) if cfg.quantized else cfg.shape.K * 2
    return D.rsrc(fx.get_iter(A), fx.Int64(rows) * row_bytes)


def act_scale_rsrc(cfg, AS, num_tokens, num_rows):
    if not cfg.quantized:
        return None
    rows = num_tokens if cfg.stage == 1 else num_rows
    return D.rsrc(fx.get_iter(AS), fx.Int64(rows) * (cfg.shape.K // L.GROUP))


def activation_rows(cfg, slots, p_rows):
    """Stage 1 gathers hidden rows by token; stage 2 reads stage 1's rows in sorted order."""
    if cfg.stage == 1:
        return [L.slot_token(s, cfg.shape.top_k) for s in slots]
    return list(p_rows)


def weight_rows(cfg, bid_m, bid_n, wave, r):
    rows = []
    for ni in range(cfg.tile.n_rep):
        n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
        if cfg.stage == 1:
            rows.append([L.gate_up_row(n0 + r, gu, cfg.shape.N) for gu in range(2)])
        else:
            rows.append([n0 + r])
    return [row for pair in rows for row in pair]      # index wi = ni * n_gu + gu


def row_slot(cfg, rsid, p, sentinel):
    """The (token, slot) pair of sorted row p: read from SID, or implied by the direct layout."""
    if cfg.rows.direct:
        return L.direct_row_slot(p, sentinel)
    return D.load_i32(rsid, L.sid_byte_offset(p))


def live(cfg, expert):
    """Whether a block computes: aligned blocks carry -1 when unused; direct blocks carry the routed id
    as given, so any id outside [0, num_experts) (one unsigned compare) reads and computes nothing."""
    if cfg.rows.direct:
        return expert.bitcast(fx.Uint32) < fx.Uint32(cfg.rows.direct_experts)
    return expert >= 0


def lds_plan(cfg, lds, tid, bid_m, rsid, sentinel):
    """Per copy round, (activation row, staged row, chunk column) of this thread."""
    if not cfg.tile.schedule.staged:
        return []
    plan = []
    for c0 in range(0, cfg.BM * 16 * cfg.tile.kb_unroll, cfg.threads):
        row, cc = L.lds_chunk_coords(tid + c0, cfg.tile.kb_unroll)
        p = bid_m * cfg.BM + row
        a_row = L.slot_token(row_slot(cfg, rsid, p, sentinel), cfg.shape.top_k) if cfg.stage == 1 else p
        plan.append((a_row, row, cc))
    return plan


def load_tile(cfg, ra, plan, kb0):
    """This thread's share of the BM x 128*U activation tile of blocks kb0.., into registers."""
    return [D.load_v4i32(ra, L.staged_act_byte_offset(a_row, kb0, cc, cfg.shape.K)) for a_row, _, cc in plan]


def store_tile(cfg, lds, plan, chunks):
    """The loaded share into LDS, then the barrier that makes the whole tile readable."""
    if not cfg.tile.schedule.staged:
        return
    for (_, row, cc), v in zip(plan, chunks):
        fx.ptr_store(v, fx.add_offset(lds, L.lds_byte_offset(row, cc * 8, cfg.tile.kb_unroll) >> 2))
    gpu.barrier()


def stage_tile(cfg, ra, lds, plan, kb0):
    """Without prefetch: each chunk stored as it arrives (one live at a time; loading the whole share
    first spilled gfx942's int4 BM32 kernels), then the barrier."""
    if not cfg.tile.schedule.staged:
        return
    for entry in plan:
        fx.ptr_store(load_tile(cfg, ra, [entry], kb0)[0],
                     fx.add_offset(lds, L.lds_byte_offset(entry[1], entry[2] * 8, cfg.tile.kb_unroll) >> 2))
    gpu.barrier()


def end_tile(cfg):
    if cfg.tile.schedule.staged:
        gpu.barrier()   # the next round's copy must not overwrite a tile still being read


def _load_weights(cfg, ops: "Operands", kb, g):
    """Per weight row: its 16-byte code chunk; MXFP4: the chunk's scale byte (group 4kb + g);
    int4: the row's 4 scales (f32) and offsets (bf16) of the block, one 8-byte load each. MXFP4 scales
    stay raw (the conversion waits for the load, so it runs where the scale is used: prefetch)."""
    rw, rs, ro = ops.rw, ops.rs, ops.ro
    words, scales, offsets = [], [], []
    for row in ops.w_rows:
        if cfg.weight_format == INT4:
            words.append(D.load_v4i32(rw, L.w_byte_offset(row, kb, g, cfg.shape.K)))
            qi = L.int4_group_quad_index(row, kb, cfg.shape.K)
            scales.append(D.bf16x4_f32(D.load_bf16x4(rs, qi)))
            offsets.append(D.load_bf16x4(ro, qi) if cfg.has_offsets else None)
            continue
        gi = L.group_index(row, kb, g, cfg.shape.K)
        words.append(D.load_v4i32(rw, L.w_byte_offset(row, kb, g, cfg.shape.K)))
        # raw: the scaled MFMA takes the e8m0 byte zero-extended; bf16 kernels convert at use
        scales.append(D.load_u8(rs, gi) if cfg.quantized else D.load_scale_raw(rs, gi))
        offsets.append(None)
    return words, scales, offsets


def _load_qactivations(cfg, ops: "Operands", kb, g):
    """Per row sub-tile mi: the scaled MFMA's B operand and its e8m0 byte (group 4kb + g)."""
    xs, scales = [], []
    for mi in range(cfg.BM // L.MFMA_TILE):
        xs.append(D.load_qact(cfg, ops.ra, ops.a_rows[mi], kb, g))
        scales.append(D.load_u8(ops.ras, L.act_scale_index(ops.a_rows[mi], kb, g, cfg.shape.K)))
    return xs, scales


def _mma_block_scaled(cfg, accs, words, w_scales, xs, x_scales):
    """One scaled MFMA per (weight sub-tile, row sub-tile) covers the whole K128 block."""
    m_rep = cfg.BM // L.MFMA_TILE
    new = list(accs)
    for wi in range(len(words)):
        for mi in range(m_rep):
            a = wi * m_rep + mi
            new[a] = D.mma_scaled(cfg, new[a], words[wi], w_scales[wi], xs[mi], x_scales[mi])
    return new


def _lds_fragment(cfg, lds, mi, j, u, g, r):
    """v8bf16 of the staged tile: rows mi*16 + r, k = 128*u + 32g + 8j + [0, 8)."""
    lofs = L.lds_byte_offset(mi * L.MFMA_TILE + r, u * L.K_BLOCK + g * L.GROUP + j * 8, cfg.tile.kb_unroll)
    return fx.Vector(fx.ptr_load(fx.add_offset(lds, lofs >> 2), T.vec(4, T.i32))).bitcast(fx.BFloat16)


def _lds_activations(cfg, lds, u, g, r):
    """Fragments [mi * 4 + j] of the staged tile (_lds_fragment), all read before the block's MFMAs."""
    return [_lds_fragment(cfg, lds, mi, j, u, g, r) for mi in range(cfg.BM // L.MFMA_TILE) for j in range(4)]


def _mma_block(cfg, accs, words, scales, offsets, x_at):
    """MXFP4: 4 MFMA steps over one K128 block for every (weight sub-tile, row sub-tile) pair;
    x_at(mi, j) is the activation fragment of row sub-tile mi and step j."""
    m_rep = cfg.BM // L.MFMA_TILE
    new = list(accs)
    for j in range(4):
        xs = [x_at(mi, j) for mi in range(m_rep)]
        for wi in range(len(words)):
            w8 = D.dequant8(cfg, fx.Int32(words[wi][j]), scales[wi])
            for mi in range(m_rep):
                a = wi * m_rep + mi
                new[a] = D.mma(cfg, new[a], w8, xs[mi])
    return new


def _int4_lds_activation(cfg, lds, mi, u, g, r, G):
    """v8bf16 of the staged tile: row sub-tile mi, elements j = 0..7 paired with group dword G."""
    lofs = L.lds_byte_offset(mi * L.MFMA_TILE + r, u * L.K_BLOCK + G * L.GROUP + g * 8, cfg.tile.kb_unroll)
    return fx.Vector(fx.ptr_load(fx.add_offset(lds, lofs >> 2), T.vec(4, T.i32))).bitcast(fx.BFloat16)


def _int4_block(cfg, accs, words, scales, offsets, load_x, high):
    """int4, one K128 block: per scale group G an MFMA chain per tile on the raw q + 136 values,
    scaled in fp32 (layout.py's int4 notes). Activations are A, weights B. With offsets, an MFMA
    of the activations with the group's offset broadcast adds sum(x) * offset into the same
    accumulator after the scaled sum (separate offset accumulators took 4 VGPRs per tile: gfx942
    BM32 spilled 45-47 of them, BM64 stage 1 used 238). Row sub-tiles outermost inside a group:
    one activation fragment and one -136 sum(x) live at a time."""
    m_rep = cfg.BM // L.MFMA_TILE
    zero = fx.Vector.filled(4, 0.0, fx.Float32)
    neg_bias = D.int4_constant8(L.INT4_NEG_BIAS_WORDS)
    new = list(accs)
    for G in range(4):
        w8s = [D.int4_decode8(words[wi][G], high) for wi in range(len(words))]
        o8s = [D.int4_offset8(offsets[wi], G) for wi in range(len(words))] if cfg.has_offsets else None
        for mi in range(m_rep):
            x = load_x(mi, G)
            base = D.mma(cfg, zero, x, neg_bias)                       # -136 sum x
            for wi in range(len(words)):
                a = wi * m_rep + mi
                new[a] = D.fma4(D.mma(cfg, base, x, w8s[wi]), scales[wi][G], new[a])
                if cfg.has_offsets:
                    new[a] = D.mma(cfg, new[a], x, o8s[wi])
    return new


def load_block(cfg, ops: "Operands", kb, g):
    """Everything one K128 block reads from global memory, flat: weight words, scales, offsets,
    then (unless staged through LDS) the activation fragments and their scales."""
    words, scales, offsets = _load_weights(cfg, ops, kb, g)
    loaded = list(words) + list(scales) + (list(offsets) if cfg.has_offsets else [])
    m_rep = cfg.BM // L.MFMA_TILE
    if cfg.quantized:
        xs, x_scales = _load_qactivations(cfg, ops, kb, g)
        return loaded + xs + x_scales
    if cfg.tile.schedule.staged:
        return loaded
    if cfg.weight_format == INT4:   # fragment [mi * 4 + G]: row sub-tile mi, scale group G
        return loaded + [D.load_v4i32(ops.ra, L.int4_act_byte_offset(ops.a_rows[mi], kb, G, g, cfg.shape.K))
                         for mi in range(m_rep) for G in range(4)]
    return loaded + [D.load_v4i32(ops.ra, L.act_byte_offset(ops.a_rows[mi], kb, g, j, cfg.shape.K))
                     for mi in range(m_rep) for j in range(4)]


def compute_block(cfg, accs, loaded, lds, u, g, r, high):
    """The MFMAs of one K128 block on what `load_block` loaded (a plain function: its Python `if`s
    are compile-time)."""
    n = cfg.tile.n_rep * (2 if cfg.stage == 1 else 1)
    m_rep = cfg.BM // L.MFMA_TILE
    words, scales, rest = loaded[:n], loaded[n:2 * n], loaded[2 * n:]
    offsets = rest[:n] if cfg.has_offsets else [None] * n
    rest = rest[n:] if cfg.has_offsets else rest
    if cfg.quantized:
        return _mma_block_scaled(cfg, accs, words, scales, rest[:m_rep], rest[m_rep:])
    if cfg.weight_format == INT4:
        if cfg.tile.schedule.staged:
            load_x = lambda mi, G: _int4_lds_activation(cfg, lds, mi, u, g, r, G)  # noqa: E731
        else:
            load_x = lambda mi, G: fx.Vector(rest[mi * 4 + G]).bitcast(fx.BFloat16)  # noqa: E731
        return _int4_block(cfg, accs, words, scales, offsets, load_x, high)
    if cfg.tile.schedule.double_buffered:   # one step's fragments live at a time (BM 128: 32 VGPRs, not 128)
        scales = [D.scale_value(sc) for sc in scales]
        return _mma_block(cfg, accs, words, scales, offsets, lambda mi, j: _lds_fragment(cfg, lds, mi, j, u, g, r))
    if cfg.tile.schedule.staged:
        xs = _lds_activations(cfg, lds, u, g, r)
    else:
        xs = [fx.Vector(v).bitcast(fx.BFloat16) for v in rest]
    scales = [D.scale_value(sc) for sc in scales]
    return _mma_block(cfg, accs, words, scales, offsets, lambda mi, j: xs[mi * 4 + j])


def reduce_k_waves(cfg, lds, accs, wave_n, wave_k, lane):
    """K split over waves: every wave stores its partial sums in LDS, then each adds the others'
    in wave order, so the first K wave holds ((p0 + p1) + p2) + ... (deterministic); only it
    stores (the kernel body's branch)."""
    if cfg.tile.k_waves == 1:
        return accs
    n = len(accs)

    def at(wk, a):
        return fx.add_offset(lds, L.reduce_lds_byte_offset(wk, wave_n, a, lane, cfg.tile.waves, n) >> 2)

    for a in range(n):
        fx.ptr_store(accs[a].bitcast(fx.Int32), at(wave_k, a))
    gpu.barrier()
    return [_sum_partials(accs[a], [fx.Vector(fx.ptr_load(at(wk, a), T.vec(4, T.i32))).bitcast(fx.Float32)
                                    for wk in range(1, cfg.tile.k_waves)]) for a in range(n)]


def _sum_partials(own, others):
    total = own
    for part in others:
        total = total + part
    return total


def first_k_wave(cfg, wave_k):
    """Whether this wave stores the results: every wave unless K is split over waves."""
    return True if cfg.tile.k_waves == 1 else wave_k == 0
