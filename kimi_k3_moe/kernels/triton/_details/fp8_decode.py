"""Weight tiles of the fp8 word layout (fp8_layout.py) decoded to e4m3 bytes in registers.

A tile is read as whole 32-bit words w [BN, BK/8] plus one shift byte d per
(row, group of 32); each group's 8-byte table (t0, t1) = lut[d] holds the e4m3
bytes of the eight e2m1 magnitudes times 2^(6 - d). Decoding yields eight uint8
tiles v0..v7 [BN, BK/8], v_j[:, c] the e4m3 code of the weight at K = k0 + 8c + j
(the same slots as the bf16 word layout's). Two decoders read the same bits:

* DECODE_PTX: per word, `prmt` looks four magnitudes up at once and two masks
  place the signs; four words per asm block, whose bytes are transposed (8 more
  `prmt`) so each output register holds one slot of four words. NVIDIA only.
* DECODE_BITS: plain Triton integer ops per element (any target, the interpreter).
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details.decode import _group_broadcast

DECODE_BITS = tl.constexpr(C.DECODE_BITS)
DECODE_PTX = tl.constexpr(C.DECODE_PTX)


def _word_ptx(k: int) -> str:
    w, t0, t1 = f"${8 + k}", f"${12 + k}", f"${16 + k}"
    return f"""
        and.b32 m, {w}, 0x7777;
        prmt.b32 lo{k}, {t0}, {t1}, m;
        shr.u32 m, {w}, 16;
        and.b32 m, m, 0x7777;
        prmt.b32 hi{k}, {t0}, {t1}, m;
        and.b32 s, {w}, 0x80808080;
        or.b32 lo{k}, lo{k}, s;
        shl.b32 s, {w}, 4;
        and.b32 s, s, 0x80808080;
        or.b32 hi{k}, hi{k}, s;"""


def _transpose_ptx(rows: str, first_out: int) -> str:
    a, b, c, d = (f"{rows}{k}" for k in range(4))
    o = [f"${first_out + j}" for j in range(4)]
    return f"""
        prmt.b32 p, {a}, {b}, 0x5140;
        prmt.b32 q, {c}, {d}, 0x5140;
        prmt.b32 {o[0]}, p, q, 0x5410;
        prmt.b32 {o[1]}, p, q, 0x7632;
        prmt.b32 p, {a}, {b}, 0x7362;
        prmt.b32 q, {c}, {d}, 0x7362;
        prmt.b32 {o[2]}, p, q, 0x5410;
        prmt.b32 {o[3]}, p, q, 0x7632;"""


# Operands: $0..$7 the slot registers (byte k = word k's slot j), $8..$11 four words,
# $12..$15 their tables' low halves, $16..$19 the high halves (pack=4, Triton's operand order).
# tests/triton/test_fp8_activations.py runs this string through a PTX emulator.
FP8_WORDS_PTX = tl.constexpr(
    "{\n        .reg .b32 m, s, p, q, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3;"
    + "".join(_word_ptx(k) for k in range(4))
    + _transpose_ptx("lo", 0) + _transpose_ptx("hi", 4) + "\n        }\n")
FP8_WORDS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 12))

# bit positions of slot j's magnitude and sign (fp8_layout._MAG_SHIFT/_SIGN_SHIFT)
MAG0, MAG1, MAG2, MAG3 = tl.constexpr(0), tl.constexpr(4), tl.constexpr(8), tl.constexpr(12)
MAG4, MAG5, MAG6, MAG7 = tl.constexpr(16), tl.constexpr(20), tl.constexpr(24), tl.constexpr(28)
SGN0, SGN1, SGN2, SGN3 = tl.constexpr(7), tl.constexpr(15), tl.constexpr(23), tl.constexpr(31)
SGN4, SGN5, SGN6, SGN7 = tl.constexpr(3), tl.constexpr(11), tl.constexpr(19), tl.constexpr(27)


@triton.jit
def _ptx_fp8_words(w, t0, t1):
    return tl.inline_asm_elementwise(asm=FP8_WORDS_PTX, constraints=FP8_WORDS_CONSTRAINTS, args=[w, t0, t1],
                                     dtype=(tl.uint8,) * 8, is_pure=True, pack=4)


@triton.jit
def _bits_slot(w, t0, t1, MAG: tl.constexpr, SGN: tl.constexpr):
    mag = (w >> MAG) & 7
    sel = (mag & 3) * 8
    byte = tl.where(mag < 4, t0 >> sel, t1 >> sel) & 0xFF
    return (byte | (((w >> SGN) & 1) << 7)).to(tl.uint8)


@triton.jit
def load_fp8_weight_raw(row_ptr, d_row_ptr, k0, mask_n, BLOCK_K: tl.constexpr):
    """Words [BN, BLOCK_K/8] (int32) and shift bytes [BN, BLOCK_K/32] of K range [k0, k0 + BLOCK_K)."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the 32-element scale group")
    g = tl.arange(0, BLOCK_K // 32)
    cw = tl.arange(0, BLOCK_K // 8)
    w = tl.load((row_ptr + k0 // 2).to(tl.pointer_type(tl.int32)) + cw[None, :], mask=mask_n, other=0)
    d = tl.load(d_row_ptr + (k0 // 32 + g)[None, :], mask=mask_n, other=0)
    return w, d


@triton.jit
def decode_fp8_raw(w, d, lut_ptr, DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """-> v0..v7, uint8 e4m3 codes [BLOCK_N, BLOCK_K/8] (v_j[:, c] at K = k0 + 8c + j)."""
    tl.static_assert(DECODE == DECODE_BITS or DECODE == DECODE_PTX, "unknown decoder")
    GROUPS: tl.constexpr = BLOCK_K // 32
    idx = d.to(tl.int32) * 2
    t0 = _group_broadcast(tl.load(lut_ptr + idx), BLOCK_N, GROUPS, 4)
    t1 = _group_broadcast(tl.load(lut_ptr + idx + 1), BLOCK_N, GROUPS, 4)
    if DECODE == DECODE_PTX:
        v0, v1, v2, v3, v4, v5, v6, v7 = _ptx_fp8_words(w, t0, t1)
    else:
        v0 = _bits_slot(w, t0, t1, MAG0, SGN0)
        v1 = _bits_slot(w, t0, t1, MAG1, SGN1)
        v2 = _bits_slot(w, t0, t1, MAG2, SGN2)
        v3 = _bits_slot(w, t0, t1, MAG3, SGN3)
        v4 = _bits_slot(w, t0, t1, MAG4, SGN4)
        v5 = _bits_slot(w, t0, t1, MAG5, SGN5)
        v6 = _bits_slot(w, t0, t1, MAG6, SGN6)
        v7 = _bits_slot(w, t0, t1, MAG7, SGN7)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def join_words(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The eight slots regrouped into K order: [BLOCK_N, BLOCK_K], column 8c + j = v_j[:, c]."""
    a = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    b = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(a, b), (BLOCK_N, BLOCK_K))
