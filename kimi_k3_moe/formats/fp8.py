"""FP8 e4m3fn activations (OCP FP8), with per-token or per-1x32 scales.

Element codec: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2.
Largest magnitude 448 (0x7E); 0x7F and 0xFF are NaN; there is no infinity.
Exponent field 0 is subnormal: value = m * 2^-9. `encode` rounds to nearest
with ties to the even code and saturates at +-448 (a value past 448 becomes
448, never NaN); the sign always comes from the input's sign bit, so a
negative value that rounds to zero is -0 (0x80).

Two ways to scale a row of activations `x` into e4m3's range:
  * per 1x32 block (MXFP8, what gfx950's scaled MFMA consumes): one e8m0 byte b
    per 32 consecutive elements, scale 2^(b-127). b is the smallest power of two
    with amax / 2^(b-127) <= 448 (`mx_scale_bytes`), so no element is clipped;
    OCP's own rule (floor(log2 amax) - 8) clips up to 12.5% off the block maximum
    and measured 10-25% worse on activations (docs/FORMATS.md).
  * per token: one float32 scale `amax / 448` per row; codes = encode(x / scale).
Scaling and rounding both happen on float32 values, in a fixed order, so a
kernel following the same steps produces the same bytes.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E4M3_BIAS = 7
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6
NAN_CODES = (0x7F, 0xFF)
# amax mantissa above 1.75 (448 = 1.75 * 2^8) needs the next power of two
_MANTISSA_1P75 = 0x600000


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """float64 2^k for integer k in [-1022, 1023], built from bits: exact on every device (CUDA's
    torch.ldexp/pow(2, k) is not: one ulp low turned every truncated mantissa below into the next code)."""
    return ((k.long() + 1023) << 52).view(torch.float64)


def e4m3_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 value of each of the 256 codes (NaN at 0x7F and 0xFF)."""
    code = torch.arange(256, dtype=torch.int64, device=device)
    exp, man = (code >> 3) & 15, code & 7
    normal = (1.0 + man.double() / 8) * _pow2(exp - E4M3_BIAS)
    subnormal = man.double() * 2.0 ** (E4M3_MIN_NORMAL_EXP - E4M3_MANTISSA_BITS)
    mag = torch.where(exp == 0, subnormal, normal)
    mag = torch.where((code & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where(code >= 128, -mag, mag).to(torch.float32)


def decode(codes: torch.Tensor, *, name: str = "codes") -> torch.Tensor:
    """uint8 e4m3fn codes -> float32 values."""
    _require_uint8(codes, name)
    return e4m3_table(codes.device)[codes.long()]


def encode(x: torch.Tensor, *, name: str = "x") -> torch.Tensor:
    """float values -> uint8 e4m3fn codes: round to nearest even, saturate at +-448."""
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds non-finite values; e4m3 codes cannot carry them")
    mag = x.double().abs().clamp(max=E4M3_MAX)
    _, exponent = torch.frexp(mag)                     # mag = f * 2^exponent, f in [0.5, 1)
    e = (exponent - 1).clamp(min=E4M3_MIN_NORMAL_EXP)  # below 2^-6: the subnormal step
    quantum = _pow2(e - E4M3_MANTISSA_BITS)
    rounded = torch.round(mag / quantum) * quantum     # half to even; exact (powers of two)
    _, r_exp = torch.frexp(rounded)
    normal = rounded >= 2.0 ** E4M3_MIN_NORMAL_EXP
    field = torch.where(normal, r_exp - 1 + E4M3_BIAS, torch.zeros_like(r_exp))
    man = torch.where(normal, rounded * _pow2(E4M3_MANTISSA_BITS + 1 - r_exp) - 8,
                      rounded * 2.0 ** -(E4M3_MIN_NORMAL_EXP - E4M3_MANTISSA_BITS))
    code = (field.long() << 3) | man.round().long()
    return (code | (torch.signbit(x).long() << 7)).to(torch.uint8)


# --------------------------------------------------------------------- per 1x32 block (MXFP8)
def mx_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """e8m0 byte per block: smallest b with amax / 2^(b-127) <= 448, clamped to [0, 254].

    Built from amax's float32 bits (exponent E, mantissa m): b = E - 8 + (m > 0x600000);
    an all-zero or subnormal block gets 0.
    """
    bits = amax.to(torch.float32).contiguous().view(torch.int32).long()
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return (exp - 8 + (man > _MANTISSA_1P75).long()).clamp(0, 254).to(torch.uint8)


def scale_reciprocal(scale_bytes: torch.Tensor) -> torch.Tensor:
    """float32 2^(127-b): what x is multiplied by before rounding (exact for b in [1, 253])."""
    b = scale_bytes.long()
    return ((254 - b) << 23).to(torch.int32).view(torch.float32)


def quantize_mx(x: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] floats -> (uint8 e4m3 codes [..., K], uint8 e8m0 scales [..., K/32])."""
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: last dim {x.shape[-1]} is not a multiple of {BLOCK_SIZE}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds non-finite values; fp8 cannot encode them")
    blocks = x.to(torch.float32).unflatten(-1, (-1, BLOCK_SIZE))
    scales = mx_scale_bytes(blocks.abs().amax(dim=-1))
    scaled = blocks * scale_reciprocal(scales).unsqueeze(-1)   # float32 multiply by a power of two
    return encode(scaled, name=name).flatten(-2), scales


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, *, name: str = "x") -> torch.Tensor:
    """uint8 codes [..., K] and e8m0 scales [..., K/32] -> float32 [..., K]."""
    from kimi_k3_moe.formats.mxfp4 import e8m0_to_float

    _require_uint8(codes, name)
    expected = (*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE)
    if codes.shape[-1] % BLOCK_SIZE or tuple(scales.shape) != expected:
        raise ValueError(f"{name}: scales shape {tuple(scales.shape)} does not match codes "
                         f"{tuple(codes.shape)} (expected {expected})")
    values = decode(codes, name=name).unflatten(-1, (-1, BLOCK_SIZE))
    return (values * e8m0_to_float(scales, name=f"{name} scales").unsqueeze(-1)).flatten(-2)


# --------------------------------------------------------------------- per token
def quantize_per_token(x: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] floats -> (uint8 e4m3 codes [..., K], float32 scales [..., 1]).

    scale = float32(amax) / 448 (float32 division); codes = encode(float32(x) / scale).
    An all-zero row gets scale 1.
    """
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds non-finite values; fp8 cannot encode them")
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return encode(x32 / scale, name=name), scale


def dequantize_per_token(codes: torch.Tensor, scales: torch.Tensor, *, name: str = "x") -> torch.Tensor:
    if scales.dtype != torch.float32 or tuple(scales.shape) != (*codes.shape[:-1], 1):
        raise ValueError(f"{name}: per-token scales must be float32 {(*codes.shape[:-1], 1)}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    return decode(codes, name=name) * scales


def _require_uint8(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 e4m3 codes, got {t.dtype}")
