"""The Triton backend's weight layouts: 4-bit codes regrouped per 32-bit word.

Both formats keep their tensor shapes ([E, N, K/2] uint8 codes, one scale per
32 along K) and only move bits inside each little-endian 32-bit word, which
holds the 8 consecutive K elements v0..v7 of one row. The order is chosen so
that a few shifts and masks per word yield bf16 *pairs* (v0,v1), (v2,v3),
(v4,v5), (v6,v7) with no per-element work (see `_details/decode.py`):

* MXFP4 word: v_j's 3 magnitude bits start at bit `MXFP4_MAG_BIT[j]` and its sign
  is at `MXFP4_SIGN_BIT[j]` (`_details/constants.py`, which says why those bits).
* int4 word: v(2j) is the nibble at bits 4j, v(2j+1) the nibble at bits 16+4j.

Scales (e8m0 bytes for MXFP4, bf16 scales and optional offsets for int4) keep
the checkpoint's [E, N, K/32] layout. Everything here is plain PyTorch, so the
layout is checked bit for bit on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kimi_k3_moe.experts import KINDS, MXFP4, Int4Experts, Layout, Mxfp4Experts, PackedExperts
from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.kernels.triton._details import constants as C

WEIGHT_FORMATS = KINDS
WORD = 8  # K elements per 32-bit word

# bit offsets inside a word of element v0..v7 (MXFP4: C.MXFP4_MAG_BIT / C.MXFP4_SIGN_BIT)
_INT4_SHIFT = tuple(4 * (j // 2) + 16 * (j % 2) for j in range(WORD))


def _words_from_codes(codes: torch.Tensor, weight_format: str) -> torch.Tensor:
    """uint8 codes [..., K] (values < 16) -> uint8 [..., K/2] in the word layout."""
    if codes.shape[-1] % WORD:
        raise ValueError(f"K ({codes.shape[-1]}) must be a multiple of {WORD}")
    c = codes.to(torch.int64).unflatten(-1, (-1, WORD))
    word = torch.zeros(c.shape[:-1], dtype=torch.int64, device=codes.device)
    for j in range(WORD):
        if weight_format == MXFP4:
            word |= (c[..., j] & 7) << C.MXFP4_MAG_BIT[j]
            word |= ((c[..., j] >> 3) & 1) << C.MXFP4_SIGN_BIT[j]
        else:
            word |= (c[..., j] & 15) << _INT4_SHIFT[j]
    # int64 -> little-endian bytes of the low 32 bits
    word32 = (word - ((word >> 31) & 1) * (1 << 32)).to(torch.int32)
    return word32.contiguous().view(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def _codes_from_words(words: torch.Tensor, weight_format: str) -> torch.Tensor:
    """Inverse of `_words_from_codes`: uint8 [..., K/2] -> uint8 codes [..., K]."""
    if words.shape[-1] % 4:
        raise ValueError(f"packed row length {words.shape[-1]} is not a whole number of words")
    w = words.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    parts = []
    for j in range(WORD):
        if weight_format == MXFP4:
            mag = (w >> C.MXFP4_MAG_BIT[j]) & 7
            sign = (w >> C.MXFP4_SIGN_BIT[j]) & 1
            parts.append(mag | (sign << 3))
        else:
            parts.append((w >> _INT4_SHIFT[j]) & 15)
    return torch.stack(parts, dim=-1).flatten(-2).to(torch.uint8)


def to_word_layout(packed: torch.Tensor, weight_format: str, *, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Checkpoint nibble order (element 2j low, 2j+1 high) -> the word layout.

    Works through dim 0 in chunks so scratch memory stays near 16x `chunk_bytes`.
    """
    _check_fmt(weight_format)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.dim() < 2:
        return _words_from_codes(mxfp4.unpack_nibbles(packed), weight_format)
    out = torch.empty_like(packed)
    step = max(1, chunk_bytes // max(1, packed[0].numel()))
    for start in range(0, packed.shape[0], step):
        out[start:start + step] = _words_from_codes(mxfp4.unpack_nibbles(packed[start:start + step]), weight_format)
    return out


def from_word_layout(words: torch.Tensor, weight_format: str) -> torch.Tensor:
    """The word layout -> checkpoint nibble order."""
    _check_fmt(weight_format)
    return mxfp4.pack_nibbles(_codes_from_words(words, weight_format))


def wide_scales(*scales: torch.Tensor) -> bool:
    """Whether any e8m0 byte of these MXFP4 scales exceeds MXFP4_FOLD_MAX_SCALE (scales above 2),
    which the one-multiply PTX decoder cannot take; shape-only (meta) tensors have none."""
    return any(not s.is_meta and s.numel() and int(s.max()) > C.MXFP4_FOLD_MAX_SCALE for s in scales)


def _check_fmt(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r} not in {WEIGHT_FORMATS}")


class WordLayout(Layout):
    """The Triton kernels' word layout (see the module docstring)."""

    name = "triton-words"

    def swizzle(self, packed: torch.Tensor, kind: str) -> torch.Tensor:
        return to_word_layout(packed, kind)

    def unswizzle(self, codes: torch.Tensor, kind: str) -> torch.Tensor:
        return from_word_layout(codes, kind)


@dataclass
class TritonExperts(PackedExperts):
    """A layer's experts as the Triton kernels read them: codes in the word layout,
    scales and offsets as the formats hold them (`experts.PackedExperts`)."""

    layout: ClassVar[Layout] = WordLayout()
    # whether an MXFP4 scale exceeds 2 (e8m0 byte above MXFP4_FOLD_MAX_SCALE): the PTX decoder then
    # multiplies twice (DECODE_PTX_WIDE); read off the scales once here, at load, so no forward syncs
    wide_scales: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wide_scales is None:
            self.wide_scales = self.weight_format == MXFP4 and wide_scales(self.w13_scale, self.w2_scale)


def from_mxfp4(w13_packed, w13_scale, w2_packed, w2_scale) -> TritonExperts:
    return TritonExperts.from_experts(Mxfp4Experts(w13_packed, w13_scale, w2_packed, w2_scale))


def from_int4(w13: int4.Int4Weights, w2: int4.Int4Weights) -> TritonExperts:
    return TritonExperts.from_experts(Int4Experts(w13, w2))
