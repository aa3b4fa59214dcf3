"""Packed int4 weights with a bf16 scale per 32 along K (our own layout).

gfx942 has no FP4 matrix path, so its kernels read MXFP4 experts converted
to this format at load time. Layout (docs/FORMATS.md has the full text):
`packed` uint8 [..., N, K/2], element 2j in the low nibble of byte j, each
nibble a two's-complement int4 in [-8, 7]; `scales` bf16 [..., N, K/32];
optional `offsets` bf16 [..., N, K/32]; value = code * scale (+ offset).
Kernels decode both variants the same way and add the offset when present.
Scales may be negative (method "search"). Conversion recipes: "amax" (the
published amax/7), "search" (error-minimising symmetric scale, the default)
and "asym" (scale and offset); `int4_fit` holds the search.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.formats import int4_fit, mxfp4

GROUP_SIZE = 32
SYMMETRIC_MAX = 7
METHODS = ("amax", "search", "asym")
OFFSET_METHODS = ("asym",)
# "search" has the lowest requantisation error (docs/FORMATS.md, Fidelity) and keeps the symmetric
# layout the kernels already read.
DEFAULT_METHOD = "search"
_DEFAULT_CHUNK_BYTES = 256 << 20
# Peak scratch bytes per group of 32 while converting a chunk: measured on
# the CPU allocator at 530 (amax), 645 (search) and 880 (asym), rounded up.
# tests/core/test_requant.py checks the peak stays within two chunks.
_SCRATCH_PER_GROUP = {"amax": 640, "search": 768, "asym": 1280}


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
        """q * s (+ o); in float64 when asked for (exact), else float32 (q * s exact, the sum rounded)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        codes = unpack_signed(self.packed).to(work)
        groups = codes.unflatten(-1, (-1, GROUP_SIZE)) * self.scales.to(work).unsqueeze(-1)
        if self.offsets is not None:
            groups = groups + self.offsets.to(work).unsqueeze(-1)
        return groups.flatten(-2).to(dtype)

    def _map(self, fn) -> Int4Weights:
        offsets = None if self.offsets is None else fn(self.offsets)
        return Int4Weights(fn(self.packed), fn(self.scales), self.method, offsets)

    def __getitem__(self, index) -> Int4Weights:
        """Slice the leading (expert) dims."""
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> Int4Weights:
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
    if method != "amax":
        raise ValueError(f"quantize_groups implements the 'amax' recipe only, not {method!r}; "
                         "the search methods fit MXFP4 groups (requantize)")
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
    method: str = DEFAULT_METHOD,
    name: str = "weight",
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    progress=None,
    device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
) -> Int4Weights:
    """MXFP4 [..., N, K/2] + e8m0 [..., N, K/32] -> Int4Weights.

    Rows are converted a chunk at a time on `device` (default: where
    `packed` is) and written to `out_device` (default: the same). One
    chunk's scratch stays near `chunk_bytes` (`scratch_bytes_per_row`);
    the result does not depend on the chunk size. `progress` (a callable
    taking a count) is told each time leading items (experts) complete.
    """
    mxfp4.check_scale_shape(packed, scales, name)
    if method not in METHODS:
        raise ValueError(f"unknown int4 method {method!r}; choose one of {METHODS}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name} (packed) must be uint8, got {packed.dtype}")
    device = torch.device(device) if device is not None else packed.device
    out_device = torch.device(out_device) if out_device is not None else packed.device
    half_k = packed.shape[-1]
    rows_per_item = packed.shape[-2] if packed.dim() > 2 else packed.shape[0]
    rows_p = packed.reshape(-1, half_k)
    rows_s = scales.reshape(-1, scales.shape[-1])
    total = rows_p.shape[0]
    out_packed = torch.empty(packed.shape, dtype=torch.uint8, device=out_device)
    out_scales = torch.empty(scales.shape, dtype=torch.bfloat16, device=out_device)
    out_offsets = (torch.empty(scales.shape, dtype=torch.bfloat16, device=out_device)
                   if method in OFFSET_METHODS else None)
    flat_p, flat_s = out_packed.view(-1, half_k), out_scales.view(-1, scales.shape[-1])
    flat_o = None if out_offsets is None else out_offsets.view(-1, scales.shape[-1])
    step = max(1, chunk_bytes // scratch_bytes_per_row(half_k * 2, method))
    done_items = 0
    for start in range(0, total, step):
        stop = min(total, start + step)
        chunk_p = rows_p[start:stop].to(device, non_blocking=True)
        chunk_s = rows_s[start:stop].to(device, non_blocking=True)
        q, s, o = convert_rows(chunk_p, chunk_s, method=method, name=name)
        del chunk_p, chunk_s
        flat_p[start:stop] = q.to(out_device)
        flat_s[start:stop] = s.to(out_device)
        if flat_o is not None:
            flat_o[start:stop] = o.to(out_device)
        del q, s, o
        if progress is not None and packed.dim() > 2:
            items = stop // rows_per_item
            if items > done_items:
                progress(items - done_items)
                done_items = items
    if progress is not None and packed.dim() <= 2:
        progress(1)
    return Int4Weights(out_packed, out_scales, method, out_offsets)


def scratch_bytes_per_row(k: int, method: str) -> int:
    """Scratch memory one row of K elements needs while converting (measured, with margin)."""
    return (k // GROUP_SIZE) * _SCRATCH_PER_GROUP[method]


def convert_rows(packed: torch.Tensor, scales: torch.Tensor, *, method: str, name: str = "weight"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: uint8 [R, K/2], e8m0 [R, K/32] -> (int4 bytes, bf16 scales, bf16 offsets or None)."""
    if method == "amax":
        dense = mxfp4.dequantize(packed, scales, name=name)
        codes, group_scales = quantize_groups(dense, method="amax")
        del dense
        return pack_signed(codes), group_scales, None
    mxfp4.e8m0_to_float(scales, name=f"{name} scales")  # refuses NaN scale bytes, naming the tensor
    groups = packed.reshape(-1, GROUP_SIZE // 2)
    exps = scales.reshape(-1)
    counts = int4_fit.histograms(groups)
    sym = int4_fit.fit_symmetric(counts)
    fit = int4_fit.fit_asymmetric(counts, sym) if method == "asym" else sym
    del counts, sym
    out = int4_fit.encode(groups, fit.q)
    group_scales = int4_fit.exponent_scale(fit.t, exps)
    offsets = None if fit.u is None else int4_fit.exponent_scale(fit.u, exps)
    del fit
    unsafe = ~int4_fit.safe_groups(exps)
    if bool(unsafe.any()):
        # Exponents so extreme that t * 2^E could leave bf16's normal range:
        # the element-wise amax/7 recipe, whose arithmetic has no such limit.
        idx = unsafe.nonzero().squeeze(1)
        dense = mxfp4.dequantize(groups[idx], exps[idx].unsqueeze(1), name=name)
        codes, fallback_scales = quantize_groups(dense, method="amax")
        out[idx] = pack_signed(codes)
        group_scales[idx] = fallback_scales.squeeze(1)
        if offsets is not None:
            offsets[idx] = 0
    return (out.reshape(packed.shape), group_scales.reshape(scales.shape),
            None if offsets is None else offsets.reshape(scales.shape))


def relative_error(source_packed: torch.Tensor, source_scales: torch.Tensor,
                   converted: Int4Weights) -> float:
    """Relative L2 error of the int4 weights against their MXFP4 source."""
    reference = mxfp4.dequantize(source_packed, source_scales).double()
    diff = converted.dequantize().double() - reference
    return float(diff.norm() / reference.norm().clamp_min(1e-300))
