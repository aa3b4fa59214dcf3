"""The small-batch path: no token alignment, fp32 FMA dot products.

Stage 1 runs one program per (token, slot) pair and N tile; stage 2 one
program per token and N tile, summing that token's slots in slot order in
fp32 (deterministic, no atomics, no per-slot buffer). With a handful of
tokens nearly every pair has its own expert, so grouping pairs buys nothing
and its launches cost more than they save.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details.activation import apply_activation
from kimi_k3_moe.kernels.triton._details.decode import load_weight_tile, word_k_offsets
from kimi_k3_moe.kernels.triton._details.numerics import cast_to


@triton.jit
def _local_expert(ids_ptr, map_ptr, pair, HAS_MAP: tl.constexpr):
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e).to(tl.int32)
    return e


@triton.jit
def stage1_gemv_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    inter_ptr, stride_im,
    ids_ptr, map_ptr,
    inter_size, hidden,
    beta, linear_beta,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, FMT: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ACT: tl.constexpr, DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """inter[pair, n] = act(gate . x, up . x) for one (token, slot) pair."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = _local_expert(ids_ptr, map_ptr, pair, HAS_MAP)
    if e < 0:
        return  # expert on another rank: stage 2 skips this slot too
    e64 = e.to(tl.int64)
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < inter_size)[:, None]
    ka = word_k_offsets(BLOCK_K)
    gate_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter_size * stride_wn
    gate_so = e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    up_so = gate_so + inter_size * stride_sn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    x_row = x_ptr + tok * stride_xm
    for k0 in range(0, hidden, BLOCK_K):
        xa = tl.load(x_row + k0 + ka).to(tl.float32)[None, :]
        xb = tl.load(x_row + k0 + 4 + ka).to(tl.float32)[None, :]
        ga, gb = load_weight_tile(gate_rows, s_ptr + gate_so, o_ptr + gate_so, k0, mask_n,
                                  FMT, HAS_OFFSETS, DECODE, BLOCK_N, BLOCK_K)
        ua, ub = load_weight_tile(up_rows, s_ptr + up_so, o_ptr + up_so, k0, mask_n,
                                  FMT, HAS_OFFSETS, DECODE, BLOCK_N, BLOCK_K)
        acc_g += ga.to(tl.float32) * xa + gb.to(tl.float32) * xb
        acc_u += ua.to(tl.float32) * xa + ub.to(tl.float32) * xb
    h = apply_activation(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), beta, linear_beta, ACT)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, cast_to(h, inter_ptr.dtype.element_ty),
             mask=offs_n < inter_size)


@triton.jit
def stage2_gemv_kernel(
    inter_ptr, stride_im,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    o_ptr,
    out_ptr, stride_om,
    ids_ptr, map_ptr, topk_w_ptr,
    hidden,
    INTER: tl.constexpr, TOPK: tl.constexpr, HAS_MAP: tl.constexpr, FMT: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum over slots of router_weight * (W2_e[n] . inter[pair]), fp32, slot order."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < hidden
    ka = word_k_offsets(BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(TOPK):
        pair = t * TOPK + s
        e = _local_expert(ids_ptr, map_ptr, pair, HAS_MAP)
        here = e >= 0
        e64 = tl.maximum(e, 0).to(tl.int64)
        # masks built from blocks (the interpreter rejects block & scalar-bool masks)
        mask_n = (in_n & ((offs_n * 0 + e) >= 0))[:, None]
        mask_k = (ka * 0 + e) >= 0
        w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        so = e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        a_row = inter_ptr + pair.to(tl.int64) * stride_im
        acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for kk in tl.static_range(INTER // BLOCK_K):
            k0 = kk * BLOCK_K
            xa = tl.load(a_row + k0 + ka, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            xb = tl.load(a_row + k0 + 4 + ka, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            wa, wb = load_weight_tile(w_rows, s_ptr + so, o_ptr + so, k0, mask_n,
                                      FMT, HAS_OFFSETS, DECODE, BLOCK_N, BLOCK_K)
            acc += wa.to(tl.float32) * xa + wb.to(tl.float32) * xb
        gate = tl.load(topk_w_ptr + pair).to(tl.float32)
        total += tl.where(here, gate * tl.sum(acc, axis=1), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, cast_to(total, out_ptr.dtype.element_ty),
             mask=offs_n < hidden)
