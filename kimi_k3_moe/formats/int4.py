"""Packed int4 weights with a bf16 scale per 32 along K (our own layout).

gfx942 has no FP4 matrix path, so its kernels read MXFP4 experts converted
to this format at load time. Layout (docs/FORMATS.md has the full text):
`packed` uint8 [..., N, K/2], element 2j in the low nibble of byte j, each
nibble a two's-complement int4 in [-8, 7]; `scales` bf16 [..., N, K/32];
optional `offsets` bf16 [..., N, K/32]; value = code * scale (+ offset).
Kernels decode both variants the same way and add the offset when present.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.formats import mxfp4

GROUP_SIZE = 32
SYMMETRIC_MAX = 7
METHODS = ("amax",)
_DEFAULT_CHUNK_BYTES = 256 << 20


@dataclass
class Int4Weights:
    """Packed two's-complement int4 codes, a bf16 scale (and optional offset) per 32."""

    packed: torch.Tensor  # uint8 [..., N, K/2]
    scales: torch.Tensor  # bfloat16 [..., N, K/32]
    method: str = "amax"
    offsets: torch.Tensor | None = None  # bfloat16 [..., N, K/32], asymmetric variants only

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8:
            raise TypeError(f"Int4Weights.packed must be uint8, got {self.packed.dtype}")
        expected = (*self.packed.shape[:-1], self.packed.shape[-1] * 2 // GROUP_SIZE)
        for field in ("scales", "offsets"):
            t = getattr(self, field)
            if t is None and field == "offsets":
                continue
            if t.dtype != torch.bfloat16:
                raise TypeError(f"Int4Weights.{field} must be bfloat16, got {t.dtype}")
            if tuple(t.shape) != expected:
                raise ValueError(f"Int4Weights.{field} shape {tuple(t.shape)} != {expected}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.numel() * 2
        return self.packed.numel() + self.scales.numel() * 2 + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = unpack_signed(self.packed).to(torch.float32)
        groups = codes.unflatten(-1, (-1, GROUP_SIZE)) * self.scales.float().unsqueeze(-1)
        if self.offsets is not None:
            groups = groups + self.offsets.float().unsqueeze(-1)
        return groups.flatten(-2).to(dtype)

    def _map(self, fn) -> "Int4Weights":
        offsets = None if self.offsets is None else fn(self.offsets)
        return Int4Weights(fn(self.packed), fn(self.scales), self.method, offsets)

    def __getitem__(self, index) -> "Int4Weights":
        """Slice the leading (expert) dims."""
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> "Int4Weights":
        return self._map(lambda t: t.to(device))


def unpack_signed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 [..., K] in [-8, 7] (two's complement nibbles)."""
    nibbles = mxfp4.unpack_nibbles(packed).to(torch.int8)
    return (nibbles ^ 8) - 8


def pack_signed(codes: torch.Tensor) -> torch.Tensor:
    """int8 [..., K] in [-8, 7] -> uint8 [..., K/2]."""
    if codes.min() < -8 or codes.max() > 7:
        raise ValueError("int4 codes must lie in [-8, 7]")
    return mxfp4.pack_nibbles((codes.to(torch.int16) & 0x0F).to(torch.uint8))


def quantize_groups(x: torch.Tensor, *, method: str = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] -> (int8 codes [..., K], bf16 scales [..., K/32])."""
    if method not in METHODS:
        raise ValueError(f"unknown int4 method {method!r}; choose one of {METHODS}")
    groups = x.to(torch.float32).unflatten(-1, (-1, GROUP_SIZE))
    amax = groups.abs().amax(dim=-1)
    # Quantise with the bf16-rounded scale, so dequantisation sees the same scale.
    scales = (amax / SYMMETRIC_MAX).to(torch.bfloat16)
    s = scales.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round(groups / safe), torch.zeros_like(groups))
    codes = codes.clamp(-SYMMETRIC_MAX, SYMMETRIC_MAX).to(torch.int8)
    return codes.flatten(-2), scales


def requantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    method: str = "amax",
    name: str = "weight",
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    progress=None,
) -> Int4Weights:
    """MXFP4 [E, N, K/2] + e8m0 [E, N, K/32] -> Int4Weights, chunked over dim 0.

    Peak extra memory is one chunk dequantised to fp32 (`chunk_bytes`) plus
    its codes; `progress` (a callable taking a count) is told after each chunk.
    """
    mxfp4.check_scale_shape(packed, scales, name)
    if method not in METHODS:
        raise ValueError(f"unknown int4 method {method!r}; choose one of {METHODS}")
    lead = packed.shape[0] if packed.dim() > 2 else 1
    view_p = packed if packed.dim() > 2 else packed.unsqueeze(0)
    view_s = scales if scales.dim() > 2 else scales.unsqueeze(0)
    per_item = view_p[0].numel() * 2 * 4
    step = max(1, chunk_bytes // max(per_item, 1))
    out_packed = torch.empty_like(view_p)
    out_scales = torch.empty(view_s.shape, dtype=torch.bfloat16, device=scales.device)
    for start in range(0, lead, step):
        stop = min(lead, start + step)
        dense = mxfp4.dequantize(view_p[start:stop], view_s[start:stop], name=name)
        codes, group_scales = quantize_groups(dense, method=method)
        out_packed[start:stop] = pack_signed(codes)
        out_scales[start:stop] = group_scales
        del dense, codes
        if progress is not None:
            progress(stop - start)
    if packed.dim() == 2:
        out_packed, out_scales = out_packed[0], out_scales[0]
    return Int4Weights(out_packed, out_scales, method)


def relative_error(source_packed: torch.Tensor, source_scales: torch.Tensor,
                   converted: Int4Weights) -> float:
    """Relative L2 error of the int4 weights against their MXFP4 source."""
    reference = mxfp4.dequantize(source_packed, source_scales).double()
    diff = converted.dequantize().double() - reference
    return float(diff.norm() / reference.norm().clamp_min(1e-300))
