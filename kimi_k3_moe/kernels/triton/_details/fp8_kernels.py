"""Kernels of the fp8-activation path (Hopper): activation quantization, and both
stages on both paths with e4m3 x e4m3 products.

Activations are e4m3 with one float32 scale per row (per token for the hidden
rows, per (token, slot) row for the intermediate); weights are the e4m3 bytes
of fp8_layout.py. Scales are applied once, in the epilogue: dot * row_scale[n]
(a power of two: exact) * activation scale[m]. Stage 1 writes the activated
intermediate in float32, so the quantization kernel sees the same values the
CPU reference quantizes (never bf16-rounded first).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.fp8_decode import (decode_fp8_raw, join_words,
                                                            load_fp8_weight_raw)
from kimi_k3_moe.kernels.triton._details.fp8_numerics import (E4M3_MAX, div_rn, e4m3_encode, f8_operand,
                                                              f8_to_f32)
from kimi_k3_moe.kernels.triton._details.matmul_kernels import acc_zeros
from kimi_k3_moe.kernels.triton._details.numerics import cast_to
from kimi_k3_moe.kernels.triton._details.permute_kernels import word_position


# ------------------------------------------------------------------ quantization
@triton.jit
def quantize_rows_kernel(x_ptr, stride_xm, q_ptr, stride_qm, scale_ptr, num_rows_ptr, n_cols,
                         HAS_NUM_ROWS: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK_K: tl.constexpr):
    """q[row] = e4m3(x[row] / s), s = amax(|x[row]|) / 448 (1 for a zero row), as formats/fp8.quantize_per_token.

    Codes go out in word order of OUT_BLOCK_K tiles (0: plain). With HAS_NUM_ROWS, rows at or past
    *num_rows_ptr (device-side count of the aligned path) are skipped."""
    row = tl.program_id(0)
    if HAS_NUM_ROWS:
        if row >= tl.load(num_rows_ptr):
            return
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, div_rn(amax, E4M3_MAX), 1.0)
    code = e4m3_encode(div_rn(x, scale))
    if OUT_BLOCK_K > 0:
        dest = word_position(offs, OUT_BLOCK_K)
    else:
        dest = offs
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + dest, code.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + row, scale)


# ------------------------------------------------------------------ helpers
@triton.jit
def _dot8(acc, x, v, SWAP: tl.constexpr):
    x = f8_operand(x)
    v = f8_operand(v)
    # Hopper's fp8 MMAs accumulate in reduced precision; Triton's default on sm_90 lets
    # the whole K loop (3584) accumulate that way (1e-2 off on the H200). Promoting to
    # the fp32 accumulator after each BLOCK_K-wide dot keeps only short runs imprecise.
    K: tl.constexpr = x.shape[1]
    if SWAP:
        acc = tl.dot(v, tl.trans(x), acc, max_num_imprecise_acc=K)
    else:
        acc = tl.dot(x, tl.trans(v), acc, max_num_imprecise_acc=K)
    return acc


@triton.jit
def _tile_dots(acc, x_rows, k0, x_mask, v0, v1, v2, v3, v4, v5, v6, v7, SWAP: tl.constexpr,
               INTERLEAVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[:, k0:k0+BK] . W[:, k0:k0+BK]: one dot in K order (x plain), or eight word dots
    (x in word order of BLOCK_K tiles)."""
    W: tl.constexpr = BLOCK_K // 8
    if INTERLEAVE:
        x = tl.load(x_rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=x_mask, other=0)
        acc = _dot8(acc, x, join_words(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K), SWAP)
    else:
        tl.static_assert(W >= 32, "fp8 word dots need BLOCK_K >= 256 (eight dots of K >= 32)")
        xw = x_rows + k0 + tl.arange(0, W)[None, :]
        acc = _dot8(acc, tl.load(xw + 0 * W, mask=x_mask, other=0), v0, SWAP)
        acc = _dot8(acc, tl.load(xw + 1 * W, mask=x_mask, other=0), v1, SWAP)
        acc = _dot8(acc, tl.load(xw + 2 * W, mask=x_mask, other=0), v2, SWAP)
        acc = _dot8(acc, tl.load(xw + 3 * W, mask=x_mask, other=0), v3, SWAP)
        acc = _dot8(acc, tl.load(xw + 4 * W, mask=x_mask, other=0), v4, SWAP)
        acc = _dot8(acc, tl.load(xw + 5 * W, mask=x_mask, other=0), v5, SWAP)
        acc = _dot8(acc, tl.load(xw + 6 * W, mask=x_mask, other=0), v6, SWAP)
        acc = _dot8(acc, tl.load(xw + 7 * W, mask=x_mask, other=0), v7, SWAP)
    return acc


@triton.jit
def _fma_words8(acc, x_ptrs, x_mask, v0, v1, v2, v3, v4, v5, v6, v7, W: tl.constexpr):
    """acc += sum_j v_j * x_j in fp32; x (e4m3 codes) in word order: slot j at x_ptrs + j*W."""
    acc += f8_to_f32(v0) * f8_to_f32(tl.load(x_ptrs + 0 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v1) * f8_to_f32(tl.load(x_ptrs + 1 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v2) * f8_to_f32(tl.load(x_ptrs + 2 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v3) * f8_to_f32(tl.load(x_ptrs + 3 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v4) * f8_to_f32(tl.load(x_ptrs + 4 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v5) * f8_to_f32(tl.load(x_ptrs + 5 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v6) * f8_to_f32(tl.load(x_ptrs + 6 * W, mask=x_mask, other=0))
    acc += f8_to_f32(v7) * f8_to_f32(tl.load(x_ptrs + 7 * W, mask=x_mask, other=0))
    return acc


# ------------------------------------------------------------------ aligned path (matrix unit)
@triton.jit(do_not_specialize=["num_pairs"])
def stage1_fp8_aligned_kernel(
    x_ptr, stride_xm, xs_ptr,
    w_ptr, stride_we, stride_wn,
    d_ptr, stride_de, stride_dn,
    rs_ptr, stride_re,
    lut_ptr,
    inter_ptr, stride_im,
    sorted_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, inter_size, hidden,
    beta, linear_beta,
    TOPK: tl.constexpr, ACT: tl.constexpr, DECODE: tl.constexpr, SWAP: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """inter[row, n] = act(xs * rs_g[n] * (x8 . Wg8[n]), xs * rs_u[n] * (x8 . Wu8[n])), float32, plain order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < num_pairs
    tok = tl.where(row_ok, pair // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    mask_n = n_ok[:, None]
    x_rows = x_ptr + tok[:, None] * stride_xm
    gate_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter_size * stride_wn
    gate_d = d_ptr + e * stride_de + offs_n[:, None].to(tl.int64) * stride_dn
    up_d = gate_d + inter_size * stride_dn
    acc_g = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    acc_u = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, hidden, BLOCK_K):
        wg, dg = load_fp8_weight_raw(gate_rows, gate_d, k0, mask_n, BLOCK_K)
        g0, g1, g2, g3, g4, g5, g6, g7 = decode_fp8_raw(wg, dg, lut_ptr, DECODE, BLOCK_N, BLOCK_K)
        acc_g = _tile_dots(acc_g, x_rows, k0, row_ok[:, None], g0, g1, g2, g3, g4, g5, g6, g7, SWAP,
                           INTERLEAVE, BLOCK_N, BLOCK_K)
        wu, du = load_fp8_weight_raw(up_rows, up_d, k0, mask_n, BLOCK_K)
        u0, u1, u2, u3, u4, u5, u6, u7 = decode_fp8_raw(wu, du, lut_ptr, DECODE, BLOCK_N, BLOCK_K)
        acc_u = _tile_dots(acc_u, x_rows, k0, row_ok[:, None], u0, u1, u2, u3, u4, u5, u6, u7, SWAP,
                           INTERLEAVE, BLOCK_N, BLOCK_K)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    rs_g = tl.load(rs_ptr + e * stride_re + offs_n, mask=n_ok, other=0.0)
    rs_u = tl.load(rs_ptr + e * stride_re + inter_size + offs_n, mask=n_ok, other=0.0)
    xs = tl.load(xs_ptr + tok, mask=row_ok, other=0.0)
    gate = acc_g * rs_g[None, :] * xs[:, None]
    up = acc_u * rs_u[None, :] * xs[:, None]
    h = apply_activation(gate, up, beta, linear_beta, ACT)
    out = inter_ptr + rows[:, None].to(tl.int64) * stride_im + offs_n[None, :]
    tl.store(out, h, mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def stage2_fp8_aligned_kernel(
    a_ptr, stride_am, as_ptr,
    w_ptr, stride_we, stride_wn,
    d_ptr, stride_de, stride_dn,
    rs_ptr, stride_re,
    lut_ptr,
    y_ptr, stride_ym,
    topk_w_ptr,
    sorted_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, hidden, inter_size,
    DECODE: tl.constexpr, SWAP: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[pair, n] = router_weight * as[row] * rs[n] * (a8[row] . W2_8[n]), bf16, per (token, slot) pair."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    w_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    d_rows = d_ptr + e * stride_de + offs_n[:, None].to(tl.int64) * stride_dn
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, inter_size, BLOCK_K):
        w, d = load_fp8_weight_raw(w_rows, d_rows, k0, n_ok[:, None], BLOCK_K)
        v0, v1, v2, v3, v4, v5, v6, v7 = decode_fp8_raw(w, d, lut_ptr, DECODE, BLOCK_N, BLOCK_K)
        acc = _tile_dots(acc, a_rows, k0, rows[:, None] >= 0, v0, v1, v2, v3, v4, v5, v6, v7, SWAP,
                         INTERLEAVE, BLOCK_N, BLOCK_K)
    if SWAP:
        acc = tl.trans(acc)
    rs = tl.load(rs_ptr + e * stride_re + offs_n, mask=n_ok, other=0.0)
    a_scale = tl.load(as_ptr + rows)
    gate = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * rs[None, :] * (a_scale * gate)[:, None]
    out = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, cast_to(acc, y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------ small-batch path (fp32 FMA)
@triton.jit
def stage1_fp8_gemv_kernel(
    x_ptr, stride_xm, xs_ptr,
    w_ptr, stride_we, stride_wn,
    d_ptr, stride_de, stride_dn,
    rs_ptr, stride_re,
    lut_ptr,
    inter_ptr, stride_im,
    ids_ptr, map_ptr,
    inter_size, hidden,
    beta, linear_beta,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, ACT: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """inter[pair, n] (float32, plain order) for one (token, slot) pair and BLOCK_N columns; x codes in
    word order of BLOCK_K tiles. Gate and up rows alternate in one tile (as stage1_gemv_kernel)."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e).to(tl.int32)
    if e < 0:
        return  # expert on another rank: stage 2 skips this slot too
    e64 = e.to(tl.int64)
    tok = (pair // TOPK).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r // 2
    w_row = n + (r % 2) * inter_size
    row_ok = n < inter_size
    mask_r = row_ok[:, None]
    w_rows = w_ptr + e64 * stride_we + w_row[:, None].to(tl.int64) * stride_wn
    d_rows = d_ptr + e64 * stride_de + w_row[:, None].to(tl.int64) * stride_dn
    cw = tl.arange(0, BLOCK_K // 8)
    x_words = x_ptr + tok * stride_xm + cw[None, :]
    acc = tl.zeros((2 * BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    # loads one K step ahead of the arithmetic, as stage1_gemv_kernel
    w, d = load_fp8_weight_raw(w_rows, d_rows, 0, mask_r, BLOCK_K)
    for k0 in range(0, hidden, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, hidden - BLOCK_K)
        w_next, d_next = load_fp8_weight_raw(w_rows, d_rows, k_next, mask_r, BLOCK_K)
        v0, v1, v2, v3, v4, v5, v6, v7 = decode_fp8_raw(w, d, lut_ptr, DECODE, 2 * BLOCK_N, BLOCK_K)
        acc = _fma_words8(acc, x_words + k0, cw[None, :] >= 0, v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_K // 8)
        w, d = w_next, d_next
    rs = tl.load(rs_ptr + e64 * stride_re + w_row, mask=row_ok, other=0.0)
    xs = tl.load(xs_ptr + tok)
    sums = tl.sum(acc, axis=1) * rs * xs
    gate, up = tl.split(tl.reshape(sums, (BLOCK_N, 2)))
    h = apply_activation(gate, up, beta, linear_beta, ACT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, h, mask=offs_n < inter_size)


@triton.jit
def stage2_fp8_gemv_kernel(
    a_ptr, stride_am, as_ptr,
    w_ptr, stride_we, stride_wn,
    d_ptr, stride_de, stride_dn,
    rs_ptr, stride_re,
    lut_ptr,
    out_ptr, stride_om,
    ids_ptr, map_ptr, topk_w_ptr,
    hidden, inter_size,
    TOPK: tl.constexpr, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum over slots of router_weight * as[pair] * rs[n] * (W2_8[n] . a8[pair]), fp32,
    fixed slot order; a codes in word order of BLOCK_K tiles (as stage2_gemv_kernel)."""
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    r = tl.arange(0, SLOTS * BLOCK_N)
    slot = r // BLOCK_N
    n = pid_n * BLOCK_N + r % BLOCK_N
    pair = t * TOPK + slot
    e = tl.load(ids_ptr + pair, mask=slot < TOPK, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=e >= 0, other=-1).to(tl.int32)
    here = (e >= 0) & (n < hidden)
    e64 = tl.maximum(e, 0).to(tl.int64)
    w_rows = w_ptr + e64[:, None] * stride_we + n[:, None].to(tl.int64) * stride_wn
    d_rows = d_ptr + e64[:, None] * stride_de + n[:, None].to(tl.int64) * stride_dn
    cw = tl.arange(0, BLOCK_K // 8)
    a_words = a_ptr + pair[:, None] * stride_am + cw[None, :]
    a_mask = here[:, None] & (cw[None, :] >= 0)
    acc = tl.zeros((SLOTS * BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    w, d = load_fp8_weight_raw(w_rows, d_rows, 0, here[:, None], BLOCK_K)
    for k0 in range(0, inter_size, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, inter_size - BLOCK_K)
        w_next, d_next = load_fp8_weight_raw(w_rows, d_rows, k_next, here[:, None], BLOCK_K)
        v0, v1, v2, v3, v4, v5, v6, v7 = decode_fp8_raw(w, d, lut_ptr, DECODE, SLOTS * BLOCK_N, BLOCK_K)
        acc = _fma_words8(acc, a_words + k0, a_mask, v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_K // 8)
        w, d = w_next, d_next
    rs = tl.load(rs_ptr + e64 * stride_re + n, mask=here, other=0.0)
    a_scale = tl.load(as_ptr + pair, mask=here, other=0.0)
    gate = tl.load(topk_w_ptr + pair, mask=slot < TOPK, other=0.0).to(tl.float32)
    per_row = tl.where(here, tl.sum(acc, axis=1) * rs * (a_scale * gate), 0.0)
    total = tl.sum(tl.reshape(per_row, (SLOTS, BLOCK_N)), axis=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t * stride_om + offs_n, cast_to(total, out_ptr.dtype.element_ty), mask=offs_n < hidden)
