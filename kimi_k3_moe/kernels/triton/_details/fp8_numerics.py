"""e4m3 arithmetic of the fp8-activation kernels, the same compiled and interpreted.

`e4m3_encode` follows formats/fp8.encode step for step (round to nearest even
on the float32 bits, saturate at 448, sign from the sign bit), so a kernel's
codes equal the CPU quantizer's. Under the interpreter (no fp8 in numpy) dot
operands and conversions take an exact float32 route: e4m3 x e4m3 products are
exact in float32.
"""
import os

import triton
import triton.language as tl

INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
E4M3_MAX = tl.constexpr(448.0)
MIN_NORMAL = tl.constexpr(0.015625)      # 2^-6
SUBNORMAL_STEP = tl.constexpr(512.0)     # 1 / 2^-9
ROUND_MAGIC = tl.constexpr(8388608.0)    # 2^23: adding and subtracting it rounds to an integer (RNE)


@triton.jit
def div_rn(x, y):
    """IEEE float32 division (what torch does on the CPU)."""
    if INTERPRETER:
        return x / y
    else:
        return tl.math.div_rn(x, y)


@triton.jit
def e4m3_encode(y):
    """float32 -> e4m3fn code (int32 0..255): nearest even, saturating at +-448, never NaN."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    mag = tl.minimum(tl.abs(y), E4M3_MAX)
    bits = mag.to(tl.int32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)          # round the mantissa to 3 bits, ties to even
    normal = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)
    sub = ((mag * SUBNORMAL_STEP + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)  # multiples of 2^-9
    code = tl.where(mag >= MIN_NORMAL, normal, sub)
    return code | (sign << 7)


@triton.jit
def e4m3_to_f32_exact(code):
    """e4m3 code (any integer type, low 8 bits) -> float32, by bits (codes 0x7F/0xFF never occur)."""
    c = code.to(tl.int32) & 0xFF
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * (1.0 / SUBNORMAL_STEP), normal)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def f8_to_f32(code):
    """uint8 e4m3 codes -> float32 values (hardware conversion when compiled)."""
    if INTERPRETER:
        return e4m3_to_f32_exact(code)
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def f8_operand(code):
    """uint8 e4m3 codes -> a tl.dot operand (fp8e4nv; exact float32 under the interpreter)."""
    if INTERPRETER:
        return e4m3_to_f32_exact(code)
    else:
        return code.to(tl.float8e4nv, bitcast=True)
