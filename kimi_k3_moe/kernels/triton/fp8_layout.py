"""MXFP4 experts as the fp8-activation kernels read them (Hopper, sm_89+).

The matrix unit multiplies e4m3 by e4m3, so each weight is turned into an e4m3
byte in registers. Every e2m1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} is exact in
e4m3, and so is e2m1 * 2^(6 - d) for a shift d in 0..14 (largest 6 * 2^6 = 384
<= 448; smallest 0.5 * 2^-8 = 2^-9, e4m3's least subnormal). So a row's per-32
e8m0 scales s_g are split exactly into

    weight = e2m1 * 2^(s_g - 127) = [e2m1 * 2^(6 - d_g)] * 2^(s_max - 133),  d_g = s_max - s_g

with s_max the row's largest scale among its groups that hold a nonzero code:
the bracket is the e4m3 operand, and the power of two 2^(s_max - 133) (`row_scale`,
float32) multiplies the row's fp32 dot product once, in the epilogue. Scales
are applied exactly whenever every nonzero group of a row lies within 14
binades of the row's largest (random and real checkpoints: a few binades). A
group further down cannot be held by e4m3 at all; its values are rounded to
nearest even e4m3 (at most 2^-10 * 2^s_max in magnitude, against a row whose
largest weight is >= 0.5 * 2^s_max); `Fp8Experts.inexact_groups` counts such
groups and `dequantize` returns exactly what the kernels multiply.

Word layout (32 bits = 8 consecutive K elements v0..v7 of one row):
  bits 4i..4i+2: magnitude code of v_i (0..7);
  sign of v_i (i < 4) at bit 8i + 7, of v_i (i >= 4) at bit 8(i - 4) + 3.
so one `prmt` per four elements looks the magnitudes up in the group's 8-byte
table (`lut()`: e4m3 bytes of each magnitude times 2^(6 - d)) and two masks
place the signs (`_details/fp8_decode.py`). Plain PyTorch: checked bit for bit
on the CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kimi_k3_moe.formats import fp8, mxfp4
from kimi_k3_moe.experts import MXFP4, PackedShapes

WORD = 8
SHIFT_BITS = 6            # the e4m3 operand is e2m1 * 2^(6 - d)
EXACT_SHIFTS = 15         # d in 0..14 is exact in e4m3
LUT_ROWS = 32             # d is clamped to 31 (every entry rounds to 0 there)
_MAG_SHIFT = tuple(4 * i for i in range(WORD))
_SIGN_SHIFT = tuple(8 * i + 7 if i < 4 else 8 * (i - 4) + 3 for i in range(WORD))


def lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [32, 2]: row d holds the e4m3 bytes of E2M1[c] * 2^(6 - d), byte c of the pair (c = 0..7,
    little-endian: c = 0..3 in the first word). Rounded to nearest even for d > 14 (not exact there)."""
    mags = torch.tensor(mxfp4.E2M1_MAGNITUDES, dtype=torch.float64)
    d = torch.arange(LUT_ROWS, dtype=torch.float64)
    values = mags[None, :] * torch.pow(2.0, SHIFT_BITS - d)[:, None]           # [32, 8], exact in float64
    codes = fp8.encode(values).to(torch.int64)                                  # [32, 8]
    words = torch.stack([sum(codes[:, 4 * h + b] << (8 * b) for b in range(4)) for h in (0, 1)], dim=1)
    return words.to(torch.int32).to(device)


def lut_values() -> torch.Tensor:
    """float32 [32, 8]: the value each LUT byte encodes."""
    table = lut().to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(table[:, c // 4] >> (8 * (c % 4))) & 0xFF for c in range(WORD)], dim=1)
    return fp8.decode(codes.to(torch.uint8))


def words_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [..., K] -> uint8 [..., K/2] in the fp8 word layout."""
    if codes.shape[-1] % WORD:
        raise ValueError(f"K ({codes.shape[-1]}) must be a multiple of {WORD}")
    c = codes.to(torch.int64).unflatten(-1, (-1, WORD))
    word = torch.zeros(c.shape[:-1], dtype=torch.int64, device=codes.device)
    for i in range(WORD):
        word |= (c[..., i] & 7) << _MAG_SHIFT[i]
        word |= ((c[..., i] >> 3) & 1) << _SIGN_SHIFT[i]
    word32 = (word - ((word >> 31) & 1) * (1 << 32)).to(torch.int32)
    return word32.contiguous().view(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def codes_from_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `words_from_codes`."""
    if words.shape[-1] % 4:
        raise ValueError(f"packed row length {words.shape[-1]} is not a whole number of words")
    w = words.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    parts = [((w >> _MAG_SHIFT[i]) & 7) | (((w >> _SIGN_SHIFT[i]) & 1) << 3) for i in range(WORD)]
    return torch.stack(parts, dim=-1).flatten(-2).to(torch.uint8)


def split_scales(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """MXFP4 codes [.., N, K/2] and e8m0 scales [.., N, K/32] -> (shift bytes d [.., N, K/32] uint8,
    row scales 2^(s_max - 133) [.., N] float32, number of nonzero groups with d > 14)."""
    mxfp4.check_scale_shape(packed, scales, "weight")
    if int((scales == mxfp4.E8M0_NAN).sum()):
        raise ValueError("weight scales hold NaN bytes (0xFF); fp8 operands cannot carry them")
    mags = (mxfp4.unpack_nibbles(packed) & 7).unflatten(-1, (-1, mxfp4.BLOCK_SIZE))
    nonzero = mags.amax(dim=-1) > 0                                             # [.., N, G]
    s = scales.to(torch.int32)
    s_max = torch.where(nonzero, s, torch.full_like(s, -1)).amax(dim=-1)        # -1: row of zeros
    s_max = torch.where(s_max < 0, s.amax(dim=-1), s_max)
    d = (s_max.unsqueeze(-1) - s).clamp(0, LUT_ROWS - 1)
    inexact = int((nonzero & (d >= EXACT_SHIFTS)).sum())
    row_scale = torch.ldexp(torch.ones_like(s_max, dtype=torch.float64),
                            (s_max - mxfp4.E8M0_BIAS - SHIFT_BITS).double()).to(torch.float32)
    return d.to(torch.uint8), row_scale, inexact


def _convert(packed: torch.Tensor, scales: torch.Tensor, chunk_bytes: int = 64 << 20):
    """Per chunk of experts, so scratch stays bounded (as `layout.to_word_layout`)."""
    words = torch.empty_like(packed)
    shifts = torch.empty_like(scales)
    row_scale = torch.empty(scales.shape[:-1], dtype=torch.float32, device=scales.device)
    inexact = 0
    step = max(1, chunk_bytes // max(1, packed[0].numel()))
    for start in range(0, packed.shape[0], step):
        sl = slice(start, start + step)
        words[sl] = words_from_codes(mxfp4.unpack_nibbles(packed[sl]))
        d, r, n = split_scales(packed[sl], scales[sl])
        shifts[sl], row_scale[sl] = d, r
        inexact += n
    return words, shifts, row_scale, inexact


@dataclass
class Fp8Experts(PackedShapes):
    """A layer's MXFP4 experts for the fp8-activation kernels.

    w13 [E, 2I, H/2] and w2 [E, H, I/2]: codes in the fp8 word layout;
    *_shift uint8 [.., K/32]: d per group; *_row_scale float32 [E, N]: 2^(s_max - 133);
    lut int32 [32, 2]; inexact_groups: nonzero groups not held exactly (d > 14).
    """

    w13: torch.Tensor
    w13_shift: torch.Tensor
    w13_row_scale: torch.Tensor
    w2: torch.Tensor
    w2_shift: torch.Tensor
    w2_row_scale: torch.Tensor
    lut: torch.Tensor
    inexact_groups: int = 0
    fmt = MXFP4

    def __post_init__(self) -> None:
        e, two_i, half_h = self.w13.shape
        if tuple(self.w2.shape) != (e, half_h * 2, two_i // 4):
            raise ValueError(f"w2 shape {tuple(self.w2.shape)} does not match w13 {tuple(self.w13.shape)}")
        for name in ("w13", "w2"):
            codes = getattr(self, name)
            shift, rs = getattr(self, f"{name}_shift"), getattr(self, f"{name}_row_scale")
            if codes.dtype != torch.uint8 or shift.dtype != torch.uint8 or rs.dtype != torch.float32:
                raise TypeError(f"Fp8Experts.{name}: codes/shifts uint8 and row scales float32 expected")
            if tuple(shift.shape) != (*codes.shape[:-1], codes.shape[-1] * 2 // mxfp4.BLOCK_SIZE):
                raise ValueError(f"Fp8Experts.{name}_shift shape {tuple(shift.shape)} does not match codes "
                                 f"{tuple(codes.shape)}")
            if tuple(rs.shape) != tuple(codes.shape[:-1]):
                raise ValueError(f"Fp8Experts.{name}_row_scale shape {tuple(rs.shape)}, expected "
                                 f"{tuple(codes.shape[:-1])}")
        if self.lut.dtype != torch.int32 or tuple(self.lut.shape) != (LUT_ROWS, 2):
            raise ValueError(f"Fp8Experts.lut must be int32 [{LUT_ROWS}, 2]")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors()[:-1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w13, self.w13_shift, self.w13_row_scale, self.w2, self.w2_shift, self.w2_row_scale, self.lut)

    def operands(self, which: str, expert: int) -> torch.Tensor:
        """float32 [N, K]: the e4m3 operand values the kernels feed the matrix unit (before row_scale)."""
        codes = codes_from_words(getattr(self, which)[expert]).long()
        shift = getattr(self, f"{which}_shift")[expert].long()
        table = lut_values().to(codes.device)                                    # [32, 8]
        d = shift.repeat_interleave(mxfp4.BLOCK_SIZE, dim=-1)
        mag = table[d, codes & 7]
        return torch.where((codes & 8) != 0, -mag, mag)

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [2I, H], w2 [H, I]) the kernels compute with (the MXFP4 weights when
        inexact_groups is 0)."""
        return tuple(self.operands(w, expert) * getattr(self, f"{w}_row_scale")[expert].unsqueeze(-1)
                     for w in ("w13", "w2"))


def from_mxfp4(w13_packed, w13_scale, w2_packed, w2_scale) -> Fp8Experts:
    a = _convert(w13_packed, w13_scale)
    b = _convert(w2_packed, w2_scale)
    return Fp8Experts(a[0], a[1], a[2], b[0], b[1], b[2], lut(w13_packed.device), a[3] + b[3])


def exact_shift_limit() -> int:
    """Largest d whose table entries are all exact (14), derived from e4m3's least subnormal."""
    least = 2.0 ** (fp8.E4M3_MIN_NORMAL_EXP - fp8.E4M3_MANTISSA_BITS)        # 2^-9
    return int(math.log2(min(m for m in mxfp4.E2M1_MAGNITUDES if m) * 2 ** SHIFT_BITS / least))
