"""MXFP4 (OCP MX v1.0): e2m1 codes packed two per byte, one e8m0 scale per 32.

Byte j of a packed row holds element 2j in its low nibble and 2j+1 in its
high nibble. Code bit 3 is the sign, bits 0-2 index E2M1_MAGNITUDES. Scale
byte b means 2^(b-127); b = 255 is NaN.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest e2m1 magnitude (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_NAN = 255
# Rounding thresholds between consecutive magnitudes; ties go to the even code.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 value of each of the 16 codes."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K], low nibble first."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values < 16) -> uint8 [..., K/2], element 2j low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of codes ({codes.shape[-1]})")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e8m0_to_float(
    scales: torch.Tensor, *, name: str = "scales", allow_nan: bool = False
) -> torch.Tensor:
    """uint8 e8m0 bytes -> float32 2^(b-127), built from bits so it is exact."""
    _require_uint8(scales, name)
    if not allow_nan:
        nan_count = int((scales == E8M0_NAN).sum())
        if nan_count:
            raise ValueError(
                f"{name} holds {nan_count} NaN scale byte(s) (0xFF); "
                "pass allow_nan=True to decode them as NaN"
            )
    b = scales.to(torch.int32)
    # b >= 1: exponent field b, zero mantissa. b == 0: 2^-127 is the subnormal 2^22 bits.
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    values = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, torch.full_like(values, float("nan")), values)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    name: str = "weight",
    allow_nan: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 [..., K/2] codes and uint8 [..., K/32] scales -> [..., K] floats."""
    _require_uint8(packed, f"{name} (packed)")
    check_scale_shape(packed, scales, name)
    values = e2m1_table(packed.device)[unpack_nibbles(packed).long()]
    scale = e8m0_to_float(scales, name=f"{name} scales", allow_nan=allow_nan)
    blocks = values.unflatten(-1, (-1, BLOCK_SIZE)) * scale.unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def quantize(x: torch.Tensor, *, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] floats -> (packed uint8 [..., K/2], e8m0 uint8 [..., K/32]).

    OCP MX v1.0: shared exponent floor(log2(amax)) - 2 per block, elements
    rounded to nearest (ties to even code) on e2m1 and saturated at +-6.
    """
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: last dim {x.shape[-1]} is not a multiple of {BLOCK_SIZE}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds non-finite values; MXFP4 cannot encode them")
    blocks = x.to(torch.float32).unflatten(-1, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, torch.full_like(exponent, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1).to(torch.float32))
    codes = _round_to_e2m1(scaled).flatten(-2)
    return pack_nibbles(codes), (shared + E8M0_BIAS).to(torch.uint8)


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        # At a tie, odd i rounds up to the even code i+1; even i stays.
        index += (magnitude > mid) | ((magnitude == mid) & (i % 2 == 1))
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def check_scale_shape(packed: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    k = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], k // BLOCK_SIZE)
    if k % BLOCK_SIZE or tuple(scales.shape) != expected:
        raise ValueError(
            f"{name}: scales shape {tuple(scales.shape)} does not match packed "
            f"{tuple(packed.shape)} (expected {expected}, one scale per {BLOCK_SIZE} along K)"
        )


def _require_uint8(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8, got {t.dtype}")


def scale_shape_2d(shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """The [N, K/32] shape a checkpoint scale of `shape` stands for, or ValueError naming it.

    Exports store scales 2-D, or 4-D as [N, 1, K/32, 1] (the layouts seen in
    real Kimi-K3 exports);
    no other 4-D layout is known from a real export, and slicing one plane
    out of an unknown layout would serve wrong scales without a word.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 2:
        return shape
    if len(shape) == 4 and shape[1] == 1 and shape[3] == 1:
        return shape[0], shape[2]
    raise ValueError(f"tensor {name!r} is a scale of shape {shape}; expected [N, K/32] or "
                     "[N, 1, K/32, 1] (no other layout is known from a real export)")


def scale_as_2d(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A checkpoint scale as [N, K/32] (a view), under the one rule of `scale_shape_2d`."""
    scale_shape_2d(tuple(scale.shape), name)
    return scale[:, 0, :, 0] if scale.dim() == 4 else scale
