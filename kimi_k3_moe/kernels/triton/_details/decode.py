"""Weight-tile loads that decode 4-bit codes in registers (never through HBM).

A tile is loaded as whole 32-bit words (`load_weight_raw`: int32 [BN, BK/8]
plus its scales) and decoded word by word (`decode_weight_raw`) into eight
bf16 tiles v0..v7 [BN, BK/8], v_j holding K = k0 + 8c + j (layout.py). Since
every element is a whole word, the result is right whatever register layout
the compiler gives the tile; kernels that multiply the eight slots separately
("word dots", the FMA path) read the activations in the same word order.
`load_weight_tile` instead regroups the slots into K order for two dots:
`wa` holds k0 + 8*(c//4) + c%4 and `wb` the same plus 4 (`word_k_offsets`).

Two decoders read the same bits:
* DECODE_PTX: inline PTX, one word -> four bf16 pairs with shifts, masks and
  one bf16x2 multiply per pair (MXFP4: by 2^126 times the e8m0 scale, for scales up
  to 2; DECODE_PTX_WIDE multiplies by 2^126 and by the scale apart); NVIDIA sm_80+.
* DECODE_BITS: plain Triton integer and fp32 ops per element (any target, the
  interpreter included).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.numerics import to_bf16
from kimi_k3_moe.kernels.triton._details import constants as C

# globals read inside @jit functions must be constexpr
FMT_MXFP4 = tl.constexpr(C.FMT_MXFP4)
FMT_INT4 = tl.constexpr(C.FMT_INT4)
DECODE_BITS = tl.constexpr(C.DECODE_BITS)
DECODE_PTX = tl.constexpr(C.DECODE_PTX)
DECODE_PTX_WIDE = tl.constexpr(C.DECODE_PTX_WIDE)
# a kernel's WEIGHTS code -> the format, decoder and offsets of the WeightCode the helpers below take
# (_details/groups.py; index by the code)
WEIGHT_FMT = tl.constexpr(tuple(fmt_code for fmt_code, _, _ in C.WEIGHTS))
WEIGHT_DECODE = tl.constexpr(tuple(decode for _, decode, _ in C.WEIGHTS))
WEIGHT_OFFSETS = tl.constexpr(tuple(offsets for _, _, offsets in C.WEIGHTS))
MAG0, MAG1, MAG2, MAG3, MAG4, MAG5, MAG6, MAG7 = (tl.constexpr(b) for b in C.MXFP4_MAG_BIT)
SIGN0, SIGN1, SIGN2, SIGN3, SIGN4, SIGN5, SIGN6, SIGN7 = (tl.constexpr(b) for b in C.MXFP4_SIGN_BIT)
# bf16x2 -0.0: adding it leaves q * s (rounded once) as it is, signed zeros included
NEG_ZERO_PAIR = tl.constexpr(-2147450880)  # 0x80008000 as int32

# One 32-bit word of the MXFP4 word layout ($8; bits in constants.MXFP4_MAG_BIT / _SIGN_BIT)
# -> eight bf16 outputs $0..$7 = v0..v7. tests/triton/test_layout.py runs these strings
# through a small PTX emulator. Each pair's bits are shifted and masked into place as bf16
# numbers 2^-126 times too small (exact; subnormal for codes 0 and 0.5); one bf16x2 FMA
# (with -0, so a multiply) by $9 = 2^(b-1) per half (b: the e8m0 byte) gives the weight,
# rounded once. WIDE (a scale above 2, where 2^(b-1) is no bf16): first by 2^126, then
# by $9 = 2^(b-127), the same single rounding.
def _e2m1_word_ptx(wide: bool) -> str:
    bias = "\n        .reg .b32 bias;\n        mov.b32 bias, 0x7E807E80;" if wide else ""
    unbias = "".join(f"\n        fma.rn.bf16x2 m{j}, m{j}, bias, nz;" for j in range(4)) if wide else ""
    return f"""
        {{
        .reg .b32 a, b, c, d, e, m0, m1, m2, m3, s0, s3, nz;{bias}
        mov.b32 nz, 0x80008000;
        shl.b32 a, $8, 4;
        shl.b32 b, $8, 3;
        shl.b32 c, $8, 6;
        shr.u32 d, $8, 7;
        shl.b32 e, $8, 5;
        and.b32 m0, $8, 0x01C001C0;
        and.b32 s0, a, 0x80008000;
        and.b32 m1, b, 0x81C081C0;
        and.b32 m2, c, 0x81C081C0;
        and.b32 m3, d, 0x01C001C0;
        and.b32 s3, e, 0x80008000;
        or.b32 m0, m0, s0;
        or.b32 m3, m3, s3;{unbias}
        fma.rn.bf16x2 m0, m0, $9, nz;
        fma.rn.bf16x2 m1, m1, $9, nz;
        fma.rn.bf16x2 m2, m2, $9, nz;
        fma.rn.bf16x2 m3, m3, $9, nz;
        mov.b32 {{$0, $1}}, m0;
        mov.b32 {{$2, $3}}, m1;
        mov.b32 {{$4, $5}}, m2;
        mov.b32 {{$6, $7}}, m3;
        }}
        """


E2M1_WORD_PTX = tl.constexpr(_e2m1_word_ptx(wide=False))
E2M1_WIDE_WORD_PTX = tl.constexpr(_e2m1_word_ptx(wide=True))
# int4: nibble n of a pair -> bf16 0x4300 | (n ^ 8) = 136 + q exactly; an FMA
# subtracts 136, leaving q in [-8, 7] exactly; a second bf16x2 FMA by the scale
# pair ($9) plus the offset pair ($10; -0.0 when symmetric) rounds once, as the
# fp32 path's q * s does (q * s is exact in fp32), at half an instruction per weight.
INT4_WORD_PTX = tl.constexpr("""
        {
        .reg .b32 a, b, c, d, one, off;
        mov.b32 one, 0x3F803F80;
        mov.b32 off, 0xC308C308;
        and.b32 a, $8, 0x000F000F;
        shr.u32 b, $8, 4;
        shr.u32 c, $8, 8;
        shr.u32 d, $8, 12;
        and.b32 b, b, 0x000F000F;
        and.b32 c, c, 0x000F000F;
        and.b32 d, d, 0x000F000F;
        xor.b32 a, a, 0x43084308;
        xor.b32 b, b, 0x43084308;
        xor.b32 c, c, 0x43084308;
        xor.b32 d, d, 0x43084308;
        fma.rn.bf16x2 a, a, one, off;
        fma.rn.bf16x2 b, b, one, off;
        fma.rn.bf16x2 c, c, one, off;
        fma.rn.bf16x2 d, d, one, off;
        fma.rn.bf16x2 a, a, $9, $10;
        fma.rn.bf16x2 b, b, $9, $10;
        fma.rn.bf16x2 c, c, $9, $10;
        fma.rn.bf16x2 d, d, $9, $10;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        mov.b32 {$4, $5}, c;
        mov.b32 {$6, $7}, d;
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
def ptx_e2m1_word(w, factor_pair, ASM: tl.constexpr):
    # w: int32 words; factor_pair: int32, the word's bf16 factor ($9 above) in both halves;
    # ASM: E2M1_WORD_PTX or E2M1_WIDE_WORD_PTX
    return tl.inline_asm_elementwise(
        asm=ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, factor_pair],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def ptx_int4_word(w, scale_pair, offset_pair):
    # scale_pair / offset_pair: int32, the word's bf16 scale / offset in both halves
    return tl.inline_asm_elementwise(
        asm=INT4_WORD_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", args=[w, scale_pair, offset_pair],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def factor_pair(s, FMT: tl.constexpr, DECODE: tl.constexpr):
    """A scale (e8m0 byte for MXFP4, bf16 for int4) or int4 offset -> the PTX decoders' bf16x2 operand
    ($9 / $10 above) for its group's words: MXFP4 2^(b-1) (DECODE_PTX, b <= 128: (b + 126) << 7 in each
    half, no carry across) or 2^(b-127) (DECODE_PTX_WIDE); int4 the value's bits in both halves."""
    if FMT == FMT_MXFP4:
        b = s.to(tl.int32)
        if DECODE == DECODE_PTX_WIDE:
            half = tl.where(b == 0, 0x40, b << 7)
            return half | (half << 16)
        else:
            return b * 0x00800080 + 0x3F003F00
    else:
        h = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return h | (h << 16)


@triton.jit
def _group_broadcast(s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, REPEAT: tl.constexpr):
    # [BN, GROUPS] -> [BN, GROUPS * REPEAT], each group value repeated REPEAT times
    s3 = tl.broadcast_to(tl.expand_dims(s, 2), (BLOCK_N, GROUPS, REPEAT))
    return tl.reshape(s3, (BLOCK_N, GROUPS * REPEAT))


@triton.jit
def _scaled(q, sw, ow, HAS_OFFSETS: tl.constexpr):
    v = q.to(tl.float32) * sw
    if HAS_OFFSETS:
        v += ow
    return to_bf16(v)


@triton.jit
def load_weight_raw(tile, k0, code, BLOCK_K: tl.constexpr):
    """The undecoded words [BN, BLOCK_K/8] (int32), scales and offsets [BN, BLOCK_K/32] of K
    range [k0, k0 + BLOCK_K) of a WeightTile (_details/groups.py: [BN, 1] pointers to each row's
    codes, scales and offsets; its mask [BN, 1] or [BN, BLOCK_K/8]-broadcastable). code: a WeightCode."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the 32-element scale group")
    g = tl.arange(0, BLOCK_K // 32)
    cw = tl.arange(0, BLOCK_K // 8)
    w = tl.load((tile.rows + k0 // 2).to(tl.pointer_type(tl.int32)) + cw[None, :], mask=tile.mask, other=0)
    s = tl.load(tile.scales + (k0 // 32 + g)[None, :], mask=tile.mask, other=0)
    if code.HAS_OFFSETS:
        o = tl.load(tile.offsets + (k0 // 32 + g)[None, :], mask=tile.mask, other=0)
    else:
        o = s
    return w, s, o


@triton.jit
def decode_weight_raw(w, s, o, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """load_weight_raw's words -> v0..v7, bf16 [BLOCK_N, BLOCK_K/8]: v_j[:, c] is the weight at
    K = k0 + 8c + j, decoded as the WeightCode `code` says. Every element is a whole 32-bit word, so
    the result does not depend on how the compiler lays the tile out in registers."""
    FMT: tl.constexpr = code.FMT
    HAS_OFFSETS: tl.constexpr = code.HAS_OFFSETS
    DECODE: tl.constexpr = code.DECODE
    GROUPS: tl.constexpr = BLOCK_K // 32
    tl.static_assert(FMT == FMT_MXFP4 or FMT == FMT_INT4, "unknown weight format")
    tl.static_assert(DECODE == DECODE_BITS or DECODE == DECODE_PTX or DECODE == DECODE_PTX_WIDE,
                     "unknown decoder")
    if FMT == FMT_MXFP4:
        if DECODE == DECODE_PTX:
            pair = _group_broadcast(factor_pair(s, FMT, DECODE), BLOCK_N, GROUPS, 4)
            v0, v1, v2, v3, v4, v5, v6, v7 = ptx_e2m1_word(w, pair, E2M1_WORD_PTX)
        elif DECODE == DECODE_PTX_WIDE:
            pair = _group_broadcast(factor_pair(s, FMT, DECODE), BLOCK_N, GROUPS, 4)
            v0, v1, v2, v3, v4, v5, v6, v7 = ptx_e2m1_word(w, pair, E2M1_WIDE_WORD_PTX)
        else:
            sw = _group_broadcast(_e8m0_to_f32(s), BLOCK_N, GROUPS, 4)
            v0 = to_bf16(_e2m1_at(w, MAG0, SIGN0) * sw)
            v1 = to_bf16(_e2m1_at(w, MAG1, SIGN1) * sw)
            v2 = to_bf16(_e2m1_at(w, MAG2, SIGN2) * sw)
            v3 = to_bf16(_e2m1_at(w, MAG3, SIGN3) * sw)
            v4 = to_bf16(_e2m1_at(w, MAG4, SIGN4) * sw)
            v5 = to_bf16(_e2m1_at(w, MAG5, SIGN5) * sw)
            v6 = to_bf16(_e2m1_at(w, MAG6, SIGN6) * sw)
            v7 = to_bf16(_e2m1_at(w, MAG7, SIGN7) * sw)
    elif DECODE != DECODE_BITS:
        sp = _group_broadcast(factor_pair(s, FMT, DECODE), BLOCK_N, GROUPS, 4)
        if HAS_OFFSETS:
            op = _group_broadcast(factor_pair(o, FMT, DECODE), BLOCK_N, GROUPS, 4)
        else:
            op = sp * 0 + NEG_ZERO_PAIR
        v0, v1, v2, v3, v4, v5, v6, v7 = ptx_int4_word(w, sp, op)
    else:
        sw = _group_broadcast(s.to(tl.float32), BLOCK_N, GROUPS, 4)
        ow = _group_broadcast(o.to(tl.float32), BLOCK_N, GROUPS, 4)
        q0 = _int4_at(w, 0)
        q1 = _int4_at(w, 16)
        q2 = _int4_at(w, 4)
        q3 = _int4_at(w, 20)
        q4 = _int4_at(w, 8)
        q5 = _int4_at(w, 24)
        q6 = _int4_at(w, 12)
        q7 = _int4_at(w, 28)
        v0 = _scaled(q0, sw, ow, HAS_OFFSETS)
        v1 = _scaled(q1, sw, ow, HAS_OFFSETS)
        v2 = _scaled(q2, sw, ow, HAS_OFFSETS)
        v3 = _scaled(q3, sw, ow, HAS_OFFSETS)
        v4 = _scaled(q4, sw, ow, HAS_OFFSETS)
        v5 = _scaled(q5, sw, ow, HAS_OFFSETS)
        v6 = _scaled(q6, sw, ow, HAS_OFFSETS)
        v7 = _scaled(q7, sw, ow, HAS_OFFSETS)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def load_weight_words(tile, k0, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """load_weight_raw then decode_weight_raw: v0..v7, bf16 [BLOCK_N, BLOCK_K/8]."""
    w, s, o = load_weight_raw(tile, k0, code, BLOCK_K)
    return decode_weight_raw(w, s, o, code, BLOCK_N, BLOCK_K)


@triton.jit
def load_weight_tile(tile, k0, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`load_weight_words` regrouped for dots: (wa, wb), bf16 [BLOCK_N, BLOCK_K // 2];
    wa[:, c] is the weight at K = k0 + word_k_offsets(c), wb the one 4 further."""
    v0, v1, v2, v3, v4, v5, v6, v7 = load_weight_words(tile, k0, code, BLOCK_N, BLOCK_K)
    wa = _interleave4(v0, v1, v2, v3, BLOCK_N, BLOCK_K // 2)
    wb = _interleave4(v4, v5, v6, v7, BLOCK_N, BLOCK_K // 2)
    return wa, wb


@triton.jit
def pair_order(k):
    """Column of the pair order that holds K index k (an involution inside each 32-group).

    Position 32g + 8p + 2q + b holds K = 32g + 8q + 2p + b: the bf16 pair p of word q of
    group g. Read in this order, a word's four decoded pairs are exactly one thread's
    register operand of a K-order wgmma (pairs at 2q, 2q + 8, 2q + 16, 2q + 24 of a
    32-wide K slice), so a K step is one dot and no regrouping shuffles are needed."""
    return (k & -32) | (((k >> 3) & 3) << 1) | (((k >> 1) & 3) << 3) | (k & 1)


@triton.jit
def to_pair_order(v):
    """[ROWS, N] (N a multiple of 32) -> the same rows with column c holding column pair_order(c):
    inside each 32-group the 4 x 4 (word, pair) indices swap, a register permute, so a caller
    reads and writes contiguous columns instead of gathering or scattering 2-byte pieces."""
    ROWS: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    return tl.reshape(tl.permute(tl.reshape(v, (ROWS, N // 32, 4, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, N))


@triton.jit
def load_weight_pairs(tile, k0, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile in pair order, bf16 [BLOCK_N, BLOCK_K]: column c holds K = k0 + pair_order(c)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = load_weight_words(tile, k0, code, BLOCK_N, BLOCK_K)
    return words_to_pair_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K)


@triton.jit
def words_to_pair_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """decode_weight_raw's v0..v7 ([BLOCK_N, BLOCK_K/8] each) -> one bf16 [BLOCK_N, BLOCK_K] tile in pair order.
    Each word's eight values stay in the thread that holds the word (only the register order changes)."""
    # [BN, C, b, p0, p1] with word c = 4g + q and pair p = 2 p1 + p0 (each join appends its axis last)
    t = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    t = tl.reshape(t, (BLOCK_N, BLOCK_K // 32, 4, 2, 2, 2))
    t = tl.permute(t, (0, 1, 5, 4, 2, 3))  # -> [BN, g, p1, p0, q, b]
    return tl.reshape(t, (BLOCK_N, BLOCK_K))
