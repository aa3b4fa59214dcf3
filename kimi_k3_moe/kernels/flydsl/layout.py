"""Index, layout and decode arithmetic of the FlyDSL MoE kernels, written once.

Every function here uses only `+ - * // >> << & | ^` on its arguments (and, for
the activation quantizers, the three `ops` named there), so the
same call works on
  * FlyDSL integers inside a kernel trace (the kernels in `_details/` call these
    functions to build their addresses and decode their weights),
  * torch integer tensors on the CPU (k3lab's `emulator.py` calls the same
    functions to gather, byte for byte, what each GPU lane would load),
  * plain Python ints (tests, config checks).
No flydsl or torch import here on purpose. Operands stay non-negative wherever
`//` or `%` would differ between the device (truncating `remsi`) and Python
(floor); `%` is not used at all.

Buffers (all flat, little-endian, row-major):
  X     [T, K]        bf16 activations (stage 1: hidden, K = H)
  INTER [P, N1]       bf16 stage-1 output in sorted order (stage 2 reads it, K = I)
  W     [E, R, K/2]   uint8 4-bit codes; R = 2I (gate rows, then up) or H; MXFP4: element
                      k of a row sits in byte k>>1, low nibble for even k; int4: the kernels'
                      order within each 64-byte K128 block (int4_swizzle_plan)
  S     [E, R, K/32]  int4: bf16 scale; MXFP4: uint8 e8m0 byte (2^(b-127))
  OFS   [E, R, K/32]  bf16 offsets (asymmetric int4 only): value = q*scale + offset
  SLOTS [T*k, H]      bf16 stage-2 output per (token, slot); summed over the slots after
  ACC   [T, H]        fp32 stage-2 output when stage 2 accumulates with fp32 atomics
Routing: the flat slot s = t*k + j (token t, top-k slot j); SID[p] holds the slot
of sorted row p, or the sentinel T*k on padding rows; BE[b] the local expert of
the BM-row block b, or -1 for an unused block.

Lane mapping of one 16x16 MFMA tile of the MXFP4 kernels ("swap AB": the MFMA A
operand is 16 weight rows, B is 16 activation rows transposed; wave64, lane l = 16*g + r;
the int4 kernels differ, see "weight decode" below):
  * in K128 block kb, lane group g owns k in [128*kb + 32*g, +32): exactly one
    scale group, one 16-byte weight load, 64 contiguous activation bytes;
  * MFMA step j (0..3) consumes k = 128*kb + 32*g + 8*j + t, t < 8 (gfx942 splits
    the 8 into two 16x16x16 issues of 4);
  * lane l supplies A[r][.] from weight row n0 + r and B[.][r] from activation
    row m0 + r; it receives D[4g + e][r], e < 4, i.e. OUT[m0 + r][n0 + 4g + e].
Any lane<->k bijection shared by both operands sums to the same dot product,
which is why no weight pre-shuffle is needed. The D mapping is AMD's documented
MFMA output layout [read, not verified on hardware here].
"""
from __future__ import annotations

LANES = 64
K_BLOCK = 128          # K elements per lane-group block (4 groups x 32)
GROUP = 32             # elements per scale group (MXFP4 block = int4 group)
MFMA_TILE = 16
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------- lanes, tiles
def lane_split(lane):
    """(g, r): K group 0..3 and row-in-16 0..15 of a lane id."""
    return lane >> 4, lane & 15


def tile_origin(bid_m, bid_n, wave, ni, mi, BM, BN, n_rep):
    """(p0, n0): first sorted row and first output column of 16x16 sub-tile (mi, ni) of a wave."""
    return bid_m * BM + mi * MFMA_TILE, bid_n * BN + wave * (n_rep * MFMA_TILE) + ni * MFMA_TILE


def wave_split(wave, waves):
    """(wave_n, wave_k) of a workgroup's wave: `waves` side by side along N, then the next K slice."""
    wave_k = wave // waves
    return wave - wave_k * waves, wave_k


def k_block(bid_k, wave_k, it, u, k_waves, iters, U):
    """K128 block of loop iteration `it`, step u: workgroup slice bid_k, then wave slice wave_k
    (each wave of a K-split workgroup walks `iters` iterations of its own contiguous slice)."""
    return ((bid_k * k_waves + wave_k) * iters + it) * U + u


def reduce_lds_byte_offset(wave_k, wave_n, a, lane, waves, n_acc):
    """LDS byte offset of accumulator a (4 fp32 per lane) of wave (wave_n, wave_k) in a K-split
    workgroup's reduction: consecutive lanes on consecutive 16 bytes (no bank conflicts)."""
    return (((wave_k * waves + wave_n) * n_acc + a) * LANES + lane) * 16


def d_row_col(g, r, e):
    """Which element of the 16x16 D tile a lane holds in accumulator register e: (row i, col c)."""
    return 4 * g + e, r


# --------------------------------------------------------------------- routing
def slot_token(slot, top_k):
    """Token of a flat slot t*k + j (the sentinel T*k maps to token T: out of X's range)."""
    return slot // top_k


def direct_row_slot(p, sentinel):
    """Direct layout (one pair per 16-row block): the slot of sorted row p is its block's index on
    the block's first row, the sentinel on the other 15."""
    padding = ((p & (MFMA_TILE - 1)) + MFMA_TILE - 1) >> 4          # 0 on a block's first row, else 1
    return (1 - padding) * (p >> 4) + padding * sentinel


def sid_byte_offset(p):
    """Byte offset of SID[p] (int32)."""
    return p * 4


# --------------------------------------------------------------------- weights
def expert_code_base(e, R, K):
    """Byte offset of expert e's codes in W [E, R, K/2] (kernels evaluate it in 64 bits)."""
    return e * (R * (K // 2))


def expert_group_base(e, R, K):
    """Element offset of expert e's scales (and offsets) in S/OFS [E, R, K/32]."""
    return e * (R * (K // GROUP))


def gate_up_row(n_col, is_up, N):
    """Stage 1: weight row of output column n_col, gate half (is_up=0) or up half (1)."""
    return n_col + is_up * N


def w_byte_offset(row, kb, g, K):
    """Byte offset (inside one expert) of the 16-byte code chunk a lane loads in block kb."""
    return row * (K // 2) + kb * (K_BLOCK // 2) + g * 16


def group_index(row, kb, g, K):
    """Element index (inside one expert) of the scale/offset of that chunk: group 4*kb + g."""
    return row * (K // GROUP) + kb * (K_BLOCK // GROUP) + g


def k_of(kb, g, j, t):
    """Logical k of element t (0..7) of MFMA step j of a lane in group g, block kb."""
    return kb * K_BLOCK + g * GROUP + j * 8 + t


# --------------------------------------------------------------------- activations
def act_byte_offset(row, kb, g, j, K):
    """Byte offset of the 16-byte bf16 chunk (8 elements) of MFMA step j, activation row `row`."""
    return (row * K + kb * K_BLOCK + g * GROUP + j * 8) * 2


def lds_chunk_coords(c, U):
    """Staged activation tile (BM rows x 128*U bf16): 16-byte chunk c -> (row, chunk column)."""
    return c >> (4 + U.bit_length() - 1), c & (16 * U - 1)   # U is a Python int: 1, 2 or 4


def lds_row_bytes(U):
    """Bytes per staged row: 256*U plus a 16-byte pad against LDS bank conflicts."""
    return 256 * U + 16


def lds_byte_offset(row, kk, U):
    """LDS byte offset of element kk (0..128*U-1) of staged row `row`."""
    return row * lds_row_bytes(U) + kk * 2


def lds_tile_byte_base(it, BM, U, buffers):
    """Byte offset of the LDS buffer K iteration `it` reads: 0, or with a double buffer (buffers 2)
    the tile of it's parity (`it` an int or a kernel value)."""
    return (it & 1) * (BM * lds_row_bytes(U)) if buffers == 2 else 0


def staged_act_byte_offset(row, kb0, cc, K):
    """Global byte offset of chunk column cc of activation row `row`, K128 block kb0 onwards."""
    return (row * K + kb0 * K_BLOCK + cc * 8) * 2


# --------------------------------------------------------------------- outputs
def inter_byte_offset(p, n_col, N):
    """Stage 1 output INTER[p, n_col] (bf16)."""
    return (p * N + n_col) * 2


def slot_out_byte_offset(slot, n_col, N):
    """Stage 2 output SLOTS[slot, n_col] (bf16)."""
    return (slot * N + n_col) * 2


def acc_byte_offset(token, n_col, N):
    """Stage 2 output ACC[token, n_col] (fp32, atomic add)."""
    return (token * N + n_col) * 4


def out_byte_offset(token, n_col, N):
    """The forward's output OUT[token, n_col] (bf16), written by stage 2 when it sums tokens."""
    return (token * N + n_col) * 2


# BOOK (int32), what a token-summing stage 2 reads besides its operands: each slot's local expert
# (-1: not on this rank), then one arrival counter per (token, BN-column tile), token T (the padding
# rows') included, all zeroed by the alignment.
def local_byte_offset(slot):
    """BOOK[slot]: the local expert of flat slot t*k + j."""
    return slot * 4


def counter_byte_offset(token, bid_n, num_slots, n_tiles):
    """BOOK[num_slots + token * n_tiles + bid_n]: the workgroups that stored this token's tile so far."""
    return (num_slots + token * n_tiles + bid_n) * 4


def book_ints(num_tokens, top_k, n_tiles):
    """BOOK's length: the slots, the counters of tokens 0..T, padded to 16 bytes."""
    n = num_tokens * top_k + (num_tokens + 1) * n_tiles
    return (n + 3) // 4 * 4


def router_weight_byte_offset(slot):
    """topk_weights flattened [T*k] fp32."""
    return slot * 4


# --------------------------------------------------------------------- weight decode
# int4 (both archs): every MFMA's K slice lies inside one 32-element scale group, so the
# codes enter the bf16 MFMA unscaled and the group scale multiplies fp32 partial sums.
#   * K128 block kb of a row: lane group g loads the 16 bytes at w_byte_offset (as MXFP4);
#     in the kernels' byte order (`int4_swizzle_plan`, applied once at load) dword G of that
#     chunk holds elements j = 0..7 of group 4kb + G for that lane group:
#     k = 128 kb + 32 G + 8 g + j (`int4_k_of`), and the lane's activations for group G are
#     the 16 contiguous bytes at int4_act_byte_offset.
#   * nibbles are stored offset-binary, u = q + 8, and physical nibble p of a dword holds
#     element INT4_NIBBLE_ELEMENT[p], so that word i of `int4_bf16_words`,
#     ((w >> 4i) & 0x000F000F) | 0x43004300, is the bf16 pair of elements (2i, 2i+1), each
#     0x4300 | u = 128 + u = q + 136: exact. (A nibble at bits 4-7 of a half word would
#     reach the exponent's low bit, so every word takes its shift.)
#   * gfx942 feeds the 8 values as two 16x16x16 MFMAs, gfx950 as one 16x16x32: either way one
#     MFMA chain per (group, tile), started from -136 sum_k x_k (an MFMA of the activations
#     with the constant INT4_NEG_BIAS_WORDS, once per row tile and group), ends at
#     P = sum_k q_k x_k in fp32; acc += scale * P (v_pk_fma_f32). With offsets, a second
#     accumulator per tile takes offset * x_k through the MFMA too (the bf16 offset, exact,
#     in every slot of the B operand: `int4_offset_word`), over all groups, and is added to
#     acc once after the K loop.
#   * activations are the MFMA's A operand and weights its B operand ("no swap"), so a lane
#     holds one weight row (n0 + r, its own scale) and four activation rows m0 + 4g + e.
INT4_XOR = 0x88                               # per byte: two's complement q -> u = q + 8
INT4_NIBBLE_ELEMENT = (0, 2, 4, 6, 1, 3, 5, 7)
INT4_WORD_SHIFT = (0, 4, 8, 12)
INT4_WORD_MASK = 0x000F000F
INT4_WORD_HIGH = 0x43004300
INT4_BIAS = 136                               # bf16 value of a decoded half = q + 136
INT4_NEG_BIAS_WORDS = (0xC308C308,) * 4       # bf16 pairs -136


def int4_swizzle_plan():
    """(physical dword d -> source dword, physical nibble p -> source nibble) of a 64-byte row block.

    Physical dword 4g + G (lane group g's load, dword G) holds the formats' dword 4G + g
    (elements 32G + 8g + [0, 8) of the block); inside it, physical nibble p holds the
    formats' nibble INT4_NIBBLE_ELEMENT[p]. Every byte is then XORed with INT4_XOR.
    """
    return tuple(4 * (d & 3) + (d >> 2) for d in range(16)), INT4_NIBBLE_ELEMENT


def int4_k_of(kb, G, g, j):
    """Logical k of element j (0..7) of group dword G, lane group g, K128 block kb (int4 kernels)."""
    return kb * K_BLOCK + G * GROUP + g * 8 + j


def int4_act_byte_offset(row, kb, G, g, K):
    """int4 kernels: byte offset of the 8 bf16 activations (elements j = 0..7) a lane pairs with group G."""
    return (row * K + kb * K_BLOCK + G * GROUP + g * 8) * 2


def int4_group_quad_index(row, kb, K):
    """Element index (inside one expert) of the 4 scales (offsets) of row `row`, groups 4kb..4kb+3."""
    return group_index(row, kb, 0, K)


def int4_bf16_words(w, high=INT4_WORD_HIGH):
    """One kernel-order dword of 8 offset-binary nibbles -> 4 words, each a bf16 pair (2i, 2i+1).

    Seven integer ops: three shifts, four and-or (v_and_or_b32). `w` is a 32-bit int
    (fx.Int32 or a torch int tensor); an arithmetic shift is fine, the mask drops the sign bits.
    `high` is INT4_WORD_HIGH; the kernels pass it held in a VGPR (a gfx9 VOP3 instruction reads
    one SGPR or literal at most, and the mask already is one).
    """
    return [((w >> s) if s else w) & INT4_WORD_MASK | high for s in INT4_WORD_SHIFT]


def int4_offset_word(pair, G):
    """Offset of group G (0..3) of the row in both halves of a word; `pair` is the dword of the
    row's 8-byte offset load that holds it (dword G >> 1, half G & 1)."""
    if G & 1:
        return (pair & -65536) | ((pair >> 16) & 0xFFFF)
    return (pair & 0xFFFF) | (pair << 16)


def int4_offset_perm_selector(G):
    """v_perm_b32 byte selector giving int4_offset_word from (pair, pair): bytes 0,1,0,1 (group 0, 2)
    or 2,3,2,3 (group 1, 3) of the pair, lowest result byte first."""
    lo = 2 * (G & 1)
    return lo | (lo + 1) << 8 | lo << 16 | (lo + 1) << 24


def int4_out_coords(g, r, e):
    """int4 kernels (activations in A, weights in B): (activation row, weight column) of
    accumulator register e of lane (g, r), offsets inside the 16x16 tile."""
    return d_row_col(g, r, e)


def e2m1_f32_bits(code):
    """float32 bit pattern of e2m1 `code` times 2^-126: multiply the float by E2M1_BIAS_FIX.

    Magnitude bits (e1 e0 m) go to f32 bits 24..22 and the sign to bit 31; e = 0 is a
    float32 subnormal, so the kernel needs denormals kept (its default mode).
    """
    return ((code & 7) << 22) | ((code & 8) << 28)


E2M1_BIAS_FIX = 2.0 ** 126


def e8m0_f32_bits(b):
    """float32 bit pattern of 2^(b-127) for b in 1..254 (b = 0 gives 0.0, b = 255 inf)."""
    return b << 23


# --------------------------------------------------------------------- epilogue math
def tanh_coef(beta):
    """c such that tanh(x / beta) = 2 / (1 + 2^(c*x)) - 1."""
    return -2.0 * LOG2E / beta


def sigmoid(x, exp2, rcp):
    return rcp(1.0 + exp2(x * -LOG2E))


def tanh_scaled(x, c, exp2, rcp):
    """tanh(x / beta) with c = tanh_coef(beta), built from exp2 and rcp only.

    Saturates to +-1 at both ends without clamping. (The `math.tanh` FlyDSL offers
    lowers to a libcall the AMDGPU backend does not have: it compiles to garbage.)
    """
    return 2.0 * rcp(1.0 + exp2(x * c)) - 1.0


def silu_mul(gate, up, exp2, rcp):
    return gate * sigmoid(gate, exp2, rcp) * up


def situv2_mul(gate, up, beta, c_gate, lin_beta, c_up, exp2, rcp, select=None):
    """beta*tanh(gate/beta)*sigmoid(gate) * (lin_beta*tanh(up/lin_beta) or up).

    Compile-time betas: lin_beta is a float, or None for "up passes unchanged".
    Runtime betas: lin_beta <= 0 means unchanged, decided per element with `select`.
    """
    g = beta * tanh_scaled(gate, c_gate, exp2, rcp) * sigmoid(gate, exp2, rcp)
    if select is None:
        u = up if lin_beta is None else lin_beta * tanh_scaled(up, c_up, exp2, rcp)
    else:
        u = select(lin_beta > 0.0, lin_beta * tanh_scaled(up, c_up, exp2, rcp), up)
    return g * u


# ===================================================================== quantized activations (gfx950)
# a8w4 / a4w4 feed v_mfma_scale_f32_16x16x128_f8f6f4: A = 16 weight rows (e2m1, cbsz 4),
# B = 16 activation rows (e4m3, blgp 0, or e2m1, blgp 4), one MFMA per K128 block.
# Operand ABI [read: FlyDSL's mxfp_moe and AMD's CDNA4 matrix-core guide; not verified on hardware]:
#   e2m1: lane 16g + r holds row r, k = 32g + v (v < 32), 16 bytes, low nibble first;
#   e4m3: lane 16g + r holds row r, k = 16g + v (v < 16) and k = 64 + 16g + (v - 16) (v >= 16),
#         32 bytes: two 16-byte halves 64 bytes apart in the row;
#   scales: lane 16b + r holds the e8m0 byte of row r for the k block [32b, 32b + 32),
#   whichever lane holds that block's data. D is laid out as for the bf16 16x16 MFMAs.
# Our loads keep memory k = MFMA k inside each K128 block, so lane group g supplies the
# scales of group 4kb + g for both operands; weights need no change (their 16-byte chunk
# per lane is already the e2m1 operand).
#   XQ  [T, H] e4m3 bytes or [T, H/2] packed e2m1  (stage-1 input; INTER_Q [P, I] likewise)
#   XS  [T, H/32] e8m0 bytes                        (INTER_S [P, I/32] likewise)
ACT_CODE_BITS = {"fp8": 8, "fp4": 4}
MFMA_FMT = {"fp8": 0, "fp4": 4}          # cbsz / blgp format codes of the scaled MFMA
QUANT_THREADS = 256                      # quantization kernel: one lane per 32-element group


def qact_row_bytes(K, act_dtype):
    """Bytes per quantized activation row of K elements (K a Python int)."""
    return K * ACT_CODE_BITS[act_dtype] // 8


def qact_byte_offset(row, kb, g, half, K, act_dtype):
    """16-byte chunk `half` (fp8: 0 or 1; fp4: 0) of row `row` that lane group g loads in block kb."""
    if act_dtype == "fp4":
        return row * (K // 2) + kb * (K_BLOCK // 2) + g * 16
    return row * K + kb * K_BLOCK + g * 16 + half * 64


def act_scale_index(row, kb, g, K):
    """e8m0 byte (one per 32 along K) of row `row` that lane group g supplies in block kb: group 4kb + g."""
    return row * (K // GROUP) + kb * (K_BLOCK // GROUP) + g


# stage-1 epilogue: the lane holding OUT[p][n0 + 4g + e] of 16-column sub-tiles 2c and 2c+1 (one
# 32-column group) finds the group's amax over its 8 values, then across lanes r, r+16, r+32, r+48
def amax_partner_lanes(lane):
    """Lanes whose values the two butterfly steps bring in (ds_bpermute sources)."""
    return lane ^ 16, lane ^ 32


def qinter_byte_offset(p, n_col, N, act_dtype):
    """Stage-1 quantized output: the 4 codes of OUT[p][n_col .. n_col+3] (n_col a multiple of 4)."""
    if act_dtype == "fp4":
        return (p * N + n_col) // 2
    return p * N + n_col


def qinter_scale_offset(p, n_col, N):
    """Stage-1 output scale byte of row p, group n_col // 32."""
    return p * (N // GROUP) + n_col // GROUP


def quant_group_offsets(q, act_dtype):
    """Quantization kernel, flat group q (32 consecutive elements): (bf16 input byte, code byte, scale byte)."""
    return q * 64, q * (4 * ACT_CODE_BITS[act_dtype]), q


# --------------------------------------------------------------------- minifloat encoding
# `ops` supplies what differs between the device and torch: ops.select(cond, a, b),
# ops.bits(float32 -> int32 bit pattern), ops.f32(int32 bit pattern -> float32).
_MINIFLOAT = {   # act dtype: (mantissa bits, exponent bias, largest finite code, code bits)
    "fp8": (3, 7, 0x7E, 8),      # e4m3fn: 448 = 0x7E (0x7F is NaN)
    "fp4": (1, 1, 0x7, 4),       # e2m1: 6 = 0x7
}
_MAGIC_2P23 = 8388608.0          # adding 2^23 rounds a float32 in [0, 2^22) to an integer, ties to even
_MAGIC_2P23_BITS = 0x4B000000


def minifloat_code(x, act_dtype, ops):
    """Code of float32 x in e4m3fn ("fp8") or e2m1 ("fp4"): round to nearest even, saturate at the
    largest finite value, sign from x's sign bit (so tiny negatives give -0). x must be finite."""
    m, bias, max_code, code_bits = _MINIFLOAT[act_dtype]
    shift = 23 - m
    bits = ops.bits(x)
    sign = ((bits >> 31) & 1) << (code_bits - 1)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift) - ((127 - bias) << m)
    scaled = ops.f32(mag) * float(2 ** (bias - 1 + m))   # subnormal range: value / smallest step
    sub = ops.bits(scaled + _MAGIC_2P23) - _MAGIC_2P23_BITS
    code = ops.select(mag < ((127 + 1 - bias) << 23), sub, normal)
    return ops.select(code > max_code, max_code, code) | sign


def e8m0_from_amax_bits(amax_bits, act_dtype, ops):
    """Scale byte of a 32-group from its amax (non-negative float32 bits).

    fp8: smallest b with amax / 2^(b-127) <= 448, i.e. E - 8 + (mantissa > 1.75);
    fp4: OCP MX, floor(log2 amax) - 2 + 127 = E - 2. Both clamped below at 0 (zero and
    subnormal groups). The same rules as formats.fp8.mx_scale_bytes and formats.mxfp4.quantize.
    """
    exp = amax_bits >> 23
    if act_dtype == "fp8":
        b = exp - 8 + ops.select((amax_bits & 0x7FFFFF) > 0x600000, 1, 0)
    else:
        b = exp - 2
    return ops.select(b < 0, 0, b)


def e8m0_reciprocal_bits(b):
    """float32 bits of 2^(127-b), the factor that scales a group into the element range (b <= 253)."""
    return (254 - b) << 23
