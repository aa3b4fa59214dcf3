"""Weight-tile loads that decode 4-bit codes in registers (never through HBM).

`load_weight_tile` returns two bf16 tiles [BLOCK_N, BLOCK_K/2]: `wa` holds the
K elements k0 + 8*(c//4) + c%4 and `wb` the same plus 4 (the first and second
half of each 32-bit word, see layout.py). Callers load activations with
`word_k_offsets` so both sides of every dot use the same K order; a dot's sum
does not care about the order of K.

Two decoders read the same bits:
* DECODE_PTX: inline PTX turning one 32-bit word into four bf16 pairs with
  shifts, masks and one bf16x2 FMA (NVIDIA sm_80+).
* DECODE_BITS: plain Triton integer and fp32 ops per element (any target, the
  interpreter included).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details.numerics import to_bf16


# globals read inside @jit functions must be constexpr
FMT_MXFP4 = tl.constexpr(C.FMT_MXFP4)
FMT_INT4 = tl.constexpr(C.FMT_INT4)
DECODE_BITS = tl.constexpr(C.DECODE_BITS)
DECODE_PTX = tl.constexpr(C.DECODE_PTX)

# One 32-bit word of the word layout (input $4) -> four bf16x2 registers $0..$3
# holding (v0,v1) (v2,v3) (v4,v5) (v6,v7). tests/triton/test_layout.py runs these
# strings through a small PTX emulator. All reads of $4 come before the first
# write of an output (an output may share $4's register).
E2M1_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 a, b, c, d, e, m0, m1, m2, m3, s0, s1, s2, s3, bias, nz;
        mov.b32 bias, 0x7E807E80;
        mov.b32 nz, 0x80008000;
        shl.b32 a, $4, 6;
        shl.b32 b, $4, 3;
        shl.b32 c, $4, 2;
        shl.b32 d, $4, 1;
        shr.u32 e, $4, 3;
        and.b32 m2, $4, 0x01C001C0;
        and.b32 s3, $4, 0x80008000;
        and.b32 m0, a, 0x01C001C0;
        and.b32 s0, b, 0x80008000;
        and.b32 m1, b, 0x01C001C0;
        and.b32 s1, c, 0x80008000;
        and.b32 s2, d, 0x80008000;
        and.b32 m3, e, 0x01C001C0;
        or.b32 m0, m0, s0;
        or.b32 m1, m1, s1;
        or.b32 m2, m2, s2;
        or.b32 m3, m3, s3;
        fma.rn.bf16x2 $0, m0, bias, nz;
        fma.rn.bf16x2 $1, m1, bias, nz;
        fma.rn.bf16x2 $2, m2, bias, nz;
        fma.rn.bf16x2 $3, m3, bias, nz;
        }
        """)
INT4_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 a, b, c, d, one, off;
        mov.b32 one, 0x3F803F80;
        mov.b32 off, 0xC308C308;
        and.b32 a, $4, 0x000F000F;
        shr.u32 b, $4, 4;
        shr.u32 c, $4, 8;
        shr.u32 d, $4, 12;
        and.b32 b, b, 0x000F000F;
        and.b32 c, c, 0x000F000F;
        and.b32 d, d, 0x000F000F;
        xor.b32 a, a, 0x43084308;
        xor.b32 b, b, 0x43084308;
        xor.b32 c, c, 0x43084308;
        xor.b32 d, d, 0x43084308;
        fma.rn.bf16x2 $0, a, one, off;
        fma.rn.bf16x2 $1, b, one, off;
        fma.rn.bf16x2 $2, c, one, off;
        fma.rn.bf16x2 $3, d, one, off;
        }
        """)


@triton.jit
def word_k_offsets(BLOCK_K: tl.constexpr):
    """K offset (inside a BLOCK_K tile) of column c of `wa`; add 4 for `wb`."""
    c = tl.arange(0, BLOCK_K // 2)
    return 8 * (c // 4) + c % 4


@triton.jit
def _e8m0_to_f32(s):
    # 2^(b-127) built from bits; b = 0 is the subnormal 2^-127.
    b = s.to(tl.int32)
    bits = tl.where(b == 0, 1 << 22, b << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_at(w, MAG_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    mag = (w >> MAG_SHIFT) & 7
    sign = (w >> SIGN_SHIFT) & 1
    # magnitudes 2..7 are the normal fp32 numbers with exponent/mantissa bits
    # (mag + 252) << 22; 0 and 1 are 0.0 and 0.5.
    normal = ((mag + 252) << 22).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where(sign != 0, -v, v)


@triton.jit
def _int4_at(w, SHIFT: tl.constexpr):
    n = (w >> SHIFT) & 15
    return ((n ^ 8) - 8).to(tl.float32)


@triton.jit
def _interleave4(v0, v1, v2, v3, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    # [BN, W] x 4 -> [BN, 4W] with column 4w+i = v_i[:, w]
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_N, HALF))


@triton.jit
def _ptx_e2m1_pairs(raw):
    # One word -> bf16 pairs (v0,v1) (v2,v3) (v4,v5) (v6,v7). Each pair's bits are
    # masked into place as bf16 numbers 2^-126 times too small (exact, subnormal for
    # codes 0/1) and one bf16x2 FMA by 2^126 (with -0 addend) fixes the exponent.
    # All reads of $4 happen before the first write of an output register.
    return tl.inline_asm_elementwise(
        asm=E2M1_PAIRS_PTX,
        constraints="=r,=r,=r,=r,r",
        args=[raw],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _ptx_int4_pairs(raw):
    # Nibble n of a pair -> bf16 0x4300 | (n ^ 8) = 136 + q exactly, then an FMA
    # subtracts 136: q in [-8, 7] as bf16 pairs (v0,v1) (v2,v3) (v4,v5) (v6,v7).
    return tl.inline_asm_elementwise(
        asm=INT4_PAIRS_PTX,
        constraints="=r,=r,=r,=r,r",
        args=[raw],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _group_broadcast(s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, REPEAT: tl.constexpr):
    # [BN, GROUPS] -> [BN, GROUPS * REPEAT], each group value repeated REPEAT times
    s3 = tl.broadcast_to(tl.expand_dims(s, 2), (BLOCK_N, GROUPS, REPEAT))
    return tl.reshape(s3, (BLOCK_N, GROUPS * REPEAT))


@triton.jit
def load_weight_tile(row_ptr, s_row_ptr, o_row_ptr, k0, mask_n,
                     FMT: tl.constexpr, HAS_OFFSETS: tl.constexpr, DECODE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode the weights of K range [k0, k0 + BLOCK_K) for BLOCK_N rows.

    row_ptr: [BLOCK_N, 1] uint8 pointers to each row's packed codes;
    s_row_ptr / o_row_ptr: [BLOCK_N, 1] pointers to each row's scales / offsets;
    mask_n: [BLOCK_N, 1] rows that exist. Returns (wa, wb), bf16 [BLOCK_N, BLOCK_K // 2].
    """
    HALF: tl.constexpr = BLOCK_K // 2
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the 32-element scale group")
    tl.static_assert(FMT == FMT_MXFP4 or FMT == FMT_INT4, "unknown weight format")
    tl.static_assert(DECODE == DECODE_BITS or DECODE == DECODE_PTX, "unknown decoder")
    g = tl.arange(0, GROUPS)
    s = tl.load(s_row_ptr + (k0 // 32 + g)[None, :], mask=mask_n, other=0)
    if FMT == FMT_MXFP4:
        scale = _e8m0_to_f32(s)
    else:
        scale = s.to(tl.float32)
    if HAS_OFFSETS:
        offset = tl.load(o_row_ptr + (k0 // 32 + g)[None, :], mask=mask_n, other=0).to(tl.float32)
    if DECODE == DECODE_PTX:
        c = tl.arange(0, HALF)
        raw = tl.load(row_ptr + (k0 // 2 + c)[None, :], mask=mask_n, other=0)
        scale_h = _group_broadcast(scale, BLOCK_N, GROUPS, 16)
        if FMT == FMT_MXFP4:
            qa, qb = _ptx_e2m1_pairs(raw)
            # e2m1 times a power of two is exact in bf16
            sb = scale_h.to(tl.bfloat16)
            wa = qa * sb
            wb = qb * sb
        else:
            qa, qb = _ptx_int4_pairs(raw)
            if HAS_OFFSETS:
                off_h = _group_broadcast(offset, BLOCK_N, GROUPS, 16)
                wa = to_bf16(qa.to(tl.float32) * scale_h + off_h)
                wb = to_bf16(qb.to(tl.float32) * scale_h + off_h)
            else:
                wa = to_bf16(qa.to(tl.float32) * scale_h)
                wb = to_bf16(qb.to(tl.float32) * scale_h)
    else:
        cw = tl.arange(0, WORDS)
        wptr = (row_ptr + k0 // 2).to(tl.pointer_type(tl.int32)) + cw[None, :]
        w = tl.load(wptr, mask=mask_n, other=0)
        sw = _group_broadcast(scale, BLOCK_N, GROUPS, 4)
        if FMT == FMT_MXFP4:
            v0 = _e2m1_at(w, 0, 12) * sw
            v1 = _e2m1_at(w, 16, 28) * sw
            v2 = _e2m1_at(w, 3, 13) * sw
            v3 = _e2m1_at(w, 19, 29) * sw
            v4 = _e2m1_at(w, 6, 14) * sw
            v5 = _e2m1_at(w, 22, 30) * sw
            v6 = _e2m1_at(w, 9, 15) * sw
            v7 = _e2m1_at(w, 25, 31) * sw
        else:
            v0 = _int4_at(w, 0) * sw
            v1 = _int4_at(w, 16) * sw
            v2 = _int4_at(w, 4) * sw
            v3 = _int4_at(w, 20) * sw
            v4 = _int4_at(w, 8) * sw
            v5 = _int4_at(w, 24) * sw
            v6 = _int4_at(w, 12) * sw
            v7 = _int4_at(w, 28) * sw
            if HAS_OFFSETS:
                ow = _group_broadcast(offset, BLOCK_N, GROUPS, 4)
                v0 += ow
                v1 += ow
                v2 += ow
                v3 += ow
                v4 += ow
                v5 += ow
                v6 += ow
                v7 += ow
        wa = _interleave4(to_bf16(v0), to_bf16(v1), to_bf16(v2), to_bf16(v3),
                          BLOCK_N, HALF)
        wb = _interleave4(to_bf16(v4), to_bf16(v5), to_bf16(v6), to_bf16(v7),
                          BLOCK_N, HALF)
    return wa, wb
