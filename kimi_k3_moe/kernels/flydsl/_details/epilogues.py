"""The MoE GEMM's epilogues: a workgroup's accumulators to its output rows.

Stage 1 applies the activation to fp32 (gate, up) pairs held by the same lane and stores bf16 rows
(or, with quantized activations, codes and an e8m0 byte per 32 columns); stage 2 scales by the
router weight and stores one bf16 row per (token, slot), or adds fp32 atomically per token.
Plain functions called at trace time: their Python `if`s are compile-time choices.
"""

import flydsl.expr as fx

from kimi_k3_moe.act_quant import FP8
from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D
from kimi_k3_moe.kernels.flydsl._details.workgroup import KernelArgs, Operands, Place, row_slot


def finish(cfg, accs, args: KernelArgs, ops: Operands, at: Place):
    """The workgroup's results (accs) stored: the activation on stage 1, the router weight on stage 2."""
    if cfg.weight_format == INT4:
        _epilogue_int4(cfg, accs, args, ops.rsid, at, L.lane_split(at.lane)[1])
    elif cfg.quantized and cfg.stage == 1:
        _epilogue_quantized(cfg, accs, args, ops.p_rows, at)
    else:
        _epilogue(cfg, accs, args, ops.slots, ops.p_rows, at)


def _inter_rows(cfg, args: KernelArgs):
    """Stage 1's bf16 output rows [P * I] and the activation's parameters."""
    ry = D.rsrc(fx.get_iter(args.Y), fx.Int64(args.num_rows) * (cfg.shape.N * 2))
    return ry, D.activation_params(cfg, args.beta, args.lin_beta)


def _epilogue_quantized(cfg, accs, args: KernelArgs, p_rows, at: Place):
    """Stage 1, quantized output: activation in fp32, then per 32 columns (sub-tiles 2c, 2c+1 of a
    wave, lanes r + 16g') an e8m0 byte and 4 codes per lane and sub-tile."""
    Y, YS, num_rows, bid_m, bid_n, wave, g, lane = args.Y, args.YS, args.num_rows, *at
    m_rep = cfg.BM // L.MFMA_TILE
    N, act = cfg.shape.N, cfg.act_dtype
    ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_rows) * L.qact_row_bytes(N, act))
    rys = D.rsrc(fx.get_iter(YS), fx.Int64(num_rows) * (N // L.GROUP))
    params = D.activation_params(cfg, args.beta, args.lin_beta)
    for c in range(cfg.tile.n_rep // 2):
        pair = (2 * c, 2 * c + 1)
        n0s = [L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1] for ni in pair]
        for mi in range(m_rep):
            ys = []
            for ni in pair:
                gate = accs[(ni * 2 + 0) * m_rep + mi]
                up = accs[(ni * 2 + 1) * m_rep + mi]
                ys += [D.activate(cfg, params, fx.Float32(gate[e]), fx.Float32(up[e])) for e in range(4)]
            codes, b = D.quantize_group(ys, act, lane)
            for j, n0 in enumerate(n0s):
                word = D.pack_codes(codes[4 * j:4 * j + 4], act)[0]
                off = L.qinter_byte_offset(p_rows[mi], n0 + g * 4, N, act)
                if act == FP8:
                    D.store(word, ry, off)
                else:
                    D.store_u16(word, ry, off)
            # the four lanes of a row hold the same byte; each stores it (same value, same address)
            D.store_u8(b, rys, L.qinter_scale_offset(p_rows[mi], n0s[0], N))


def _epilogue_int4(cfg, accs, args: KernelArgs, rsid, at: Place, r):
    """int4 tiles hold OUT[m0 + 4g + e][n0 + r] in register e (layout.int4_out_coords): one bf16
    store per element; stage 2 looks up the slot (and router weight) of each of its 4 rows."""
    Y, TW, num_tokens, bid_m, bid_n, wave, g = args.Y, args.TW, args.num_tokens, *at[:4]
    m_rep = cfg.BM // L.MFMA_TILE
    N = cfg.shape.N
    if cfg.stage == 1:
        ry, params = _inter_rows(cfg, args)
    else:
        rtw = D.rsrc(fx.get_iter(TW), fx.Int64(num_tokens) * (cfg.shape.top_k * 4))  # padding slot reads 0
        per_token = cfg.shape.top_k * N * 2 if cfg.slot_rows else N * 4
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * per_token)          # padding slot: dropped
    coords = [L.int4_out_coords(g, r, e) for e in range(4)]
    for mi in range(m_rep):
        p0 = L.tile_origin(bid_m, bid_n, wave, 0, mi, cfg.BM, cfg.BN, cfg.tile.n_rep)[0]
        rows = [p0 + dm for dm, _ in coords]
        if cfg.stage == 2:
            slots = [row_slot(cfg, rsid, p, num_tokens * cfg.shape.top_k) for p in rows]
            weights = [D.load_f32(rtw, L.router_weight_byte_offset(s)) for s in slots]
        for ni in range(cfg.tile.n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
            if cfg.stage == 1:
                gate = accs[(ni * 2 + 0) * m_rep + mi]
                up = accs[(ni * 2 + 1) * m_rep + mi]
                for e in range(4):
                    y = D.activate(cfg, params, fx.Float32(gate[e]), fx.Float32(up[e]))
                    D.store_bf16(y, ry, L.inter_byte_offset(rows[e], n0 + coords[e][1], N))
                continue
            acc = accs[ni * m_rep + mi]
            for e in range(4):
                y = fx.Float32(acc[e]) * weights[e]
                n_col = n0 + coords[e][1]
                if cfg.slot_rows:
                    D.store_bf16(y, ry, L.slot_out_byte_offset(slots[e], n_col, N))
                else:
                    D.atomic_add_f32(y, ry, L.acc_byte_offset(L.slot_token(slots[e], cfg.shape.top_k), n_col, N))


def _epilogue(cfg, accs, args: KernelArgs, slots, p_rows, at: Place):
    """Lane (g, r) holds OUT[m0 + r][n0 + 4g + e] in register e: stage 1 stores 4 bf16 of a row at once;
    stage 2 weights each row by its router weight, then stores (slots) or adds (atomic)."""
    Y, TW, num_tokens, bid_m, bid_n, wave, g = args.Y, args.TW, args.num_tokens, *at[:4]
    m_rep = cfg.BM // L.MFMA_TILE
    N = cfg.shape.N
    if cfg.stage == 1:
        ry, params = _inter_rows(cfg, args)
        for ni in range(cfg.tile.n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
            for mi in range(m_rep):
                gate = accs[(ni * 2 + 0) * m_rep + mi]
                up = accs[(ni * 2 + 1) * m_rep + mi]
                ys = [D.activate(cfg, params, fx.Float32(gate[e]), fx.Float32(up[e])) for e in range(4)]
                packed = fx.Vector.from_elements(ys, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)
                D.store(packed, ry, L.inter_byte_offset(p_rows[mi], n0 + g * 4, N))
        return
    rtw = D.rsrc(fx.get_iter(TW), fx.Int64(num_tokens) * (cfg.shape.top_k * 4))      # padding slot reads 0
    weights = [D.load_f32(rtw, L.router_weight_byte_offset(s)) for s in slots]
    if cfg.slot_rows:
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * (cfg.shape.top_k * N * 2))  # padding slot: dropped
    else:
        ry = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * (N * 4))              # token T: dropped
    for ni in range(cfg.tile.n_rep):
        n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
        for mi in range(m_rep):
            acc = accs[ni * m_rep + mi]
            ys = [fx.Float32(acc[e]) * weights[mi] for e in range(4)]
            if cfg.slot_rows:
                packed = fx.Vector.from_elements(ys, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)
                D.store(packed, ry, L.slot_out_byte_offset(slots[mi], n0 + g * 4, N))
            else:
                token = L.slot_token(slots[mi], cfg.shape.top_k)
                for e in range(4):
                    D.atomic_add_f32(ys[e], ry, L.acc_byte_offset(token, n0 + g * 4 + e, N))
