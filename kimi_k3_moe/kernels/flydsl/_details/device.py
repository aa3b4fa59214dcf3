"""Device-side helpers the MoE kernels call at trace time (each emits a few MLIR ops).

Addresses and bit formulas come from `layout.py`, the module the CPU emulator
evaluates too; what is here is the FlyDSL spelling around them.
"""

import flydsl.expr as fx
from flydsl.expr import rocdl
from flydsl.expr.typing import T

from kimi_k3_moe.act_quant import FP4
from kimi_k3_moe.kernels.flydsl import layout as L


def i32(v):
    return fx.Int32(v).ir_value()


def rsrc(ptr, nbytes=None):
    """Buffer resource over a global pointer. With `nbytes` the hardware range check
    is on: loads past it return 0 and stores (and atomics) past it are dropped."""
    return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(ptr, num_records_bytes=nbytes))


def expert_ptr(tensor, element_offset):
    """Pointer to `tensor` + a 64-bit element offset: the expert's base folds into the
    descriptor, so 32-bit buffer offsets only ever span one expert."""
    return fx.add_offset(fx.get_iter(tensor), element_offset)


def load(res, byte_off, ty):
    return rocdl.raw_ptr_buffer_load(ty, res, i32(byte_off), i32(0))


def store(val, res, byte_off):
    rocdl.raw_ptr_buffer_store(val.ir_value(), res, i32(byte_off), i32(0))


def atomic_add_f32(val, res, byte_off):
    """buffer_atomic_add_f32: exists on gfx942 and gfx950 (the packed-bf16 form is gfx950-only)."""
    rocdl.raw_ptr_buffer_atomic_fadd(fx.Float32(val).ir_value(), res, i32(byte_off), i32(0))


def release_to_agent():
    """This thread's stores reach every XCD before what follows (gfx94x/95x: buffer_wbl2 sc1 and
    s_waitcnt vmcnt(0); each XCD has its own L2), LLVM's AMDGPU memory model spelling it."""
    fx.memory_fence(syncscope="agent", ordering=fx.AtomicOrdering.Release)


def acquire_from_agent():
    """Loads after this see what other XCDs released (s_waitcnt vmcnt(0) and buffer_inv sc1)."""
    fx.memory_fence(syncscope="agent", ordering=fx.AtomicOrdering.Acquire)


def count_arrival(tensor, byte_off):
    """Atomic +1 on the int32 at `byte_off` of `tensor` at device scope; the count before it."""
    ptr = fx.add_offset(fx.get_iter(tensor), fx.Int64(byte_off >> 2))
    return fx.atomic_add(ptr, fx.Int32(1), syncscope="agent", ordering=fx.AtomicOrdering.Monotonic)


def load_i32(res, byte_off):
    return fx.Int32(load(res, byte_off, T.i32))


def load_f32(res, byte_off):
    return fx.Float32(load(res, byte_off, T.f32))


def load_v4i32(res, byte_off):
    return fx.Vector(load(res, byte_off, T.vec(4, T.i32)))


def exp2(x):
    return fx.Float32(rocdl.exp2(T.f32, fx.Float32(x).ir_value()))   # v_exp_f32


def rcp(x):
    return fx.Float32(rocdl.rcp(T.f32, fx.Float32(x).ir_value()))    # v_rcp_f32


def select(cond, a, b):
    return cond.select(a, b)


# --------------------------------------------------------------------- scales
def load_scale_raw(s_res, gi):
    """MXFP4 group scale as stored (the e8m0 byte), element gi of one expert. Kept raw so a prefetched
    block's scale is converted where it is used, not where its load is issued (a conversion right
    after the load would wait for it there)."""
    return fx.Uint8(load(s_res, gi, T.i8))


def scale_value(raw):
    """A raw e8m0 scale byte as f32."""
    return L.e8m0_f32_bits(raw.to(fx.Int32)).bitcast(fx.Float32)     # zero-extended byte


# --------------------------------------------------------------------- decode
def dequant8(cfg, word, scale, offset=None):
    """MXFP4: one dword of 8 e2m1 codes + its group's scale -> v8bf16 MFMA fragment.
    gfx950: v_cvt_scalef32_pk_bf16_fp4, byte selector j -> (low nibble, high nibble) = elements 2j, 2j+1."""
    parts = []
    for sel in range(4):
        pair = fx.Vector(rocdl.cvt_scalef32_pk_bf16_fp4(T.vec(2, T.bf16), word.ir_value(), scale.ir_value(), sel))
        parts += [pair[0], pair[1]]
    return fx.Vector.from_elements(parts, fx.BFloat16)


def int4_word_high():
    """layout.INT4_WORD_HIGH in a VGPR, made once before the K loop.

    Through an opaque v_mov: LLVM would otherwise keep both constants of the and-or as
    literals and, a gfx9 VOP3 reading at most one, split it into v_and_b32 + v_or_b32.
    """
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import llvm

    return fx.Int32(llvm.inline_asm(ir.IntegerType.get_signless(32), [i32(L.INT4_WORD_HIGH)],
                                    "v_mov_b32 $0, $1", "=v,s", has_side_effects=False))


def int4_decode8(word, high):
    """int4: one kernel-order dword -> v8bf16 of q + 136 (layout.int4_bf16_words: 7 integer ops)."""
    return fx.Vector.from_elements(L.int4_bf16_words(fx.Int32(word), high), fx.Int32).bitcast(fx.BFloat16)


def int4_constant8(words):
    """A constant v8bf16 operand (layout.INT4_NEG_BIAS_WORDS)."""
    return fx.Vector.from_elements([fx.Int32(w) for w in words], fx.Int32).bitcast(fx.BFloat16)


def load_bf16x4(res, element):
    """Four consecutive bf16 (8 bytes, one load) as two i32 words."""
    v = fx.Vector(load(res, element * 2, T.vec(2, T.i32)))
    return [fx.Int32(v[0]), fx.Int32(v[1])]


def bf16x4_f32(pairs):
    """The 4 bf16 of load_bf16x4 as f32 (a shift or a mask each)."""
    out = []
    for w in pairs:
        out += [(w << 16).bitcast(fx.Float32), (w & -65536).bitcast(fx.Float32)]
    return out


def int4_offset8(pairs, G):
    """v8bf16 with the offset of group G in every slot: layout.int4_offset_word as one v_perm_b32
    (its byte selector, layout.int4_offset_perm_selector), which LLVM does not find for the shift-and-or."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import llvm

    pair = fx.Int32(pairs[G >> 1]).ir_value()
    w = fx.Int32(llvm.call_intrinsic(ir.IntegerType.get_signless(32), "llvm.amdgcn.perm",
                                     [pair, pair, i32(L.int4_offset_perm_selector(G))], [], []))
    return fx.Vector.from_elements([w] * 4, fx.Int32).bitcast(fx.BFloat16)


def fma4(a, s, c):
    """c + a * s on v4f32 with a scalar s: two v_pk_fma_f32 (one rounding per element). LLVM
    unpacks some into v_fma_f32 pairs that it issues in an MFMA's shadow."""
    return fx.Vector(fx.math.fma(a, fx.Vector.filled(4, s, fx.Float32), c))


# --------------------------------------------------------------------- MFMA
def mma(cfg, acc, a8, b8):
    """acc (v4f32) += the 16x16 tile product of 8 bf16 A values and 8 bf16 B values per lane.
    MXFP4 kernels pass weights as A ("swap AB"), int4 kernels activations."""
    if cfg.mfma == "16x16x32":
        return fx.Vector(rocdl.mfma_f32_16x16x32_bf16(T.vec(4, T.f32), [a8, b8, acc]))
    wi = a8.bitcast(fx.Int16)   # the gfx942 *_1k op takes vector<4xi16>
    xi = b8.bitcast(fx.Int16)
    for h in range(2):
        sel = [4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3]
        acc = fx.Vector(rocdl.mfma_f32_16x16x16bf16_1k(T.vec(4, T.f32),
                                                       [wi.shuffle(wi, sel), xi.shuffle(xi, sel), acc]))
    return acc


# --------------------------------------------------------------------- activation
def activation_params(cfg, beta, lin_beta):
    """(beta, c_gate, lin_beta, c_up): Python floats folded into the code (const), or
    fx.Float32 kernel arguments (runtime; lin_beta <= 0 means up passes unchanged)."""
    act = cfg.activation
    if act.name != "situv2":
        return None
    if act.betas == "const":
        lb = act.linear_beta
        return act.beta, L.tanh_coef(act.beta), lb, (None if lb is None else L.tanh_coef(lb))
    two_log2e = fx.Float32(-2.0 * L.LOG2E)
    return beta, two_log2e / beta, lin_beta, two_log2e / lin_beta


def activate(cfg, params, gate, up):
    if cfg.activation.name == "silu":
        return L.silu_mul(gate, up, exp2, rcp)
    b, cg, lb, cu = params
    return L.situv2_mul(gate, up, b, cg, lb, cu, exp2, rcp,
                        select=select if cfg.activation.betas == "runtime" else None)


# --------------------------------------------------------------------- quantized activations (gfx950)
class FlyOps:
    """The `ops` of layout.minifloat_code / e8m0_from_amax_bits, on FlyDSL values."""

    @staticmethod
    def select(cond, a, b):
        return cond.select(_i32_or(a), _i32_or(b))

    @staticmethod
    def bits(x):
        return fx.Float32(x).bitcast(fx.Int32)

    @staticmethod
    def f32(i):
        return fx.Int32(i).bitcast(fx.Float32)


def _i32_or(v):
    return fx.Int32(v) if isinstance(v, int) else v


def load_u8(res, byte_off):
    """One byte, zero-extended to i32 (an e8m0 scale: the scaled MFMA takes it in bits 0-7)."""
    return fx.Uint8(load(res, byte_off, T.i8)).to(fx.Int32)


def load_qact(cfg, res, row, kb, g):
    """The B operand of the scaled MFMA for one activation row: v4i32 (e2m1) or v8i32 (e4m3)."""
    lo = load_v4i32(res, L.qact_byte_offset(row, kb, g, 0, cfg.shape.K, cfg.act_dtype))
    if cfg.act_dtype == FP4:
        return lo
    hi = load_v4i32(res, L.qact_byte_offset(row, kb, g, 1, cfg.shape.K, cfg.act_dtype))
    return lo.shuffle(hi, list(range(8)))


def mma_scaled(cfg, acc, w4, w_scale, x, x_scale):
    """acc (v4f32) += one K128 block: 16 e2m1 weight rows (A, scale per lane) x 16 activation rows (B)."""
    return fx.Vector(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
        T.vec(4, T.f32), [w4, x, acc, L.MFMA_FMT[FP4], L.MFMA_FMT[cfg.act_dtype], 0, w_scale, 0, x_scale]))


def imax(a, b):
    return (a > b).select(a, b)


def lane_amax(v, lane):
    """Max of a non-negative i32 (float bits) over lanes l, l^16, l^32, l^48 (two ds_bpermute steps)."""
    for partner in L.amax_partner_lanes(lane):
        other = fx.Int32(rocdl.ds_bpermute(T.i32, (partner * 4).ir_value(), fx.Int32(v).ir_value()))
        v = imax(v, other)
    return v


def quantize_group(values, act_dtype, lane=None):
    """float32 values (one lane's share of a 32-group; the rest on lanes l^16, l^32 when `lane` is
    given) -> (codes, e8m0 byte), with layout.py's rounding rules."""
    amax = None
    for v in values:
        mag = FlyOps.bits(v) & 0x7FFFFFFF
        amax = mag if amax is None else imax(amax, mag)
    if lane is not None:
        amax = lane_amax(amax, lane)
    b = L.e8m0_from_amax_bits(amax, act_dtype, FlyOps)
    mult = FlyOps.f32(L.e8m0_reciprocal_bits(b))
    return [L.minifloat_code(v * mult, act_dtype, FlyOps) for v in values], b


def pack_codes(codes, act_dtype):
    """Codes of consecutive elements -> i32 words, element 0 in the lowest bits (bytes or nibbles)."""
    per = 32 // L.ACT_CODE_BITS[act_dtype]
    words = []
    for i in range(0, len(codes), per):
        w = codes[i]
        for j in range(1, min(per, len(codes) - i)):
            w = w | (codes[i + j] << (j * L.ACT_CODE_BITS[act_dtype]))
        words.append(w)
    return words


def store_u8(val, res, byte_off):
    rocdl.raw_ptr_buffer_store(fx.Int32(val).to(fx.Uint8).ir_value(), res, i32(byte_off), i32(0))


def store_bf16(val, res, byte_off):
    rocdl.raw_ptr_buffer_store(fx.Float32(val).to(fx.BFloat16).ir_value(), res, i32(byte_off), i32(0))


def store_u16(val, res, byte_off):
    rocdl.raw_ptr_buffer_store(fx.Int32(val).to(fx.Int16).ir_value(), res, i32(byte_off), i32(0))
