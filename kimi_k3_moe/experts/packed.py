"""The one base of the backends' prepared forms: 4-bit codes plus a layout.

A prepared form holds the same values as `Mxfp4Experts` (MXFP4) or
`Int4Experts`: codes w13 [E, 2I, H/2] (gate rows first) and w2 [E, H, I/2],
scales [.., K/32] (e8m0 bytes for MXFP4, bf16 for int4) and, for asymmetric
int4, bf16 offsets of the same shape. Only where the bits of the codes sit
differs per backend; that is its `Layout`: `swizzle` turns the formats' own
nibble order into the kernels' order and `unswizzle` undoes it, so every
prepared form decodes (`dequantize`) through the formats' own decoders.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kimi_k3_moe.experts.format import INT4, KINDS, MXFP4, WeightFormat
from kimi_k3_moe.experts.int4 import Int4Experts
from kimi_k3_moe.experts.mxfp4 import Mxfp4Experts
from kimi_k3_moe.experts.shapes import PackedShapes
from kimi_k3_moe.formats import int4, mxfp4


class Layout:
    """Where the kernels want the bits of each byte row; this base keeps the formats' own order."""

    name = "checkpoint"

    def swizzle(self, packed: torch.Tensor, kind: str) -> torch.Tensor:
        """uint8 [..., K/2] in the formats' nibble order -> the kernels' order."""
        return packed.contiguous()

    def unswizzle(self, codes: torch.Tensor, kind: str) -> torch.Tensor:
        """Inverse of `swizzle`."""
        return codes


CHECKPOINT_LAYOUT = Layout()


@dataclass
class PackedExperts(PackedShapes):
    """Experts in a backend's layout; subclasses name the layout (and whether tensors must be contiguous)."""

    weight_format: str                      # "mxfp4" | "int4"
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_offset: torch.Tensor | None = None
    w2_offset: torch.Tensor | None = None

    layout: ClassVar[Layout] = CHECKPOINT_LAYOUT
    contiguous: ClassVar[bool] = False

    def __post_init__(self) -> None:
        cls = type(self).__name__
        if self.weight_format not in KINDS:
            raise ValueError(f"{cls}: weight format {self.weight_format!r} not in {KINDS}")
        e, two_i, half_h = self.w13.shape
        if tuple(self.w2.shape) != (e, half_h * 2, two_i // 4):
            raise ValueError(f"w2 shape {tuple(self.w2.shape)} does not match w13 {tuple(self.w13.shape)}")
        scale_dtype = torch.uint8 if self.weight_format == MXFP4 else torch.bfloat16
        must = "contiguous " if self.contiguous else ""
        for name in ("w13", "w2"):
            codes = getattr(self, name)
            if codes.dtype != torch.uint8 or (self.contiguous and not codes.is_contiguous()):
                raise ValueError(f"{cls}.{name} must be {must}uint8, got {codes.dtype}")
            groups = (*codes.shape[:-1], codes.shape[-1] * 2 // mxfp4.BLOCK_SIZE)
            for suffix, dtype in (("scale", scale_dtype), ("offset", torch.bfloat16)):
                t = getattr(self, f"{name}_{suffix}")
                if t is None:
                    if suffix == "scale":
                        raise ValueError(f"{cls}.{name}_scale is required")
                    continue
                if suffix == "offset" and self.weight_format == MXFP4:
                    raise ValueError("MXFP4 experts carry no offsets")
                if t.dtype != dtype or tuple(t.shape) != groups or (self.contiguous and not t.is_contiguous()):
                    raise ValueError(f"{cls}.{name}_{suffix}: {t.dtype} {tuple(t.shape)}, "
                                     f"expected {must}{dtype} {groups}")
        if (self.w13_offset is None) != (self.w2_offset is None):
            raise ValueError("int4 offsets must be given for both w13 and w2 or for neither")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_experts(cls, experts: Mxfp4Experts | Int4Experts):
        """MXFP4 or int4 experts in this class's layout (scales and offsets as they are)."""
        def keep(t):
            return None if t is None else t.contiguous()
        if isinstance(experts, Mxfp4Experts):
            return cls(MXFP4, cls.layout.swizzle(experts.w13_packed, MXFP4), keep(experts.w13_scale),
                       cls.layout.swizzle(experts.w2_packed, MXFP4), keep(experts.w2_scale))
        if isinstance(experts, Int4Experts):
            w13, w2 = experts.w13, experts.w2
            return cls(INT4, cls.layout.swizzle(w13.packed, INT4), keep(w13.scales),
                       cls.layout.swizzle(w2.packed, INT4), keep(w2.scales), keep(w13.offsets), keep(w2.offsets))
        raise TypeError(f"{cls.__name__}.from_experts takes Mxfp4Experts or Int4Experts, "
                        f"got {type(experts).__name__}")

    # ------------------------------------------------------------------ values
    @property
    def has_offsets(self) -> bool:
        return self.w13_offset is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w13, self.w13_scale, self.w2, self.w2_scale, self.w13_offset,
                                 self.w2_offset) if t is not None)

    def dequantize(self, expert: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of one expert in `dtype`, decoded through the formats' own
        decoders (MXFP4 values are exact in float32; int4's q * s + o is exact only in float64)."""
        out = []
        for name in ("w13", "w2"):
            codes = self.layout.unswizzle(getattr(self, name)[expert], self.weight_format)
            scale = getattr(self, f"{name}_scale")[expert]
            if self.weight_format == MXFP4:
                out.append(mxfp4.dequantize(codes, scale, name=f"{name}[{expert}]", dtype=dtype))
            else:
                offset = getattr(self, f"{name}_offset")
                offset = None if offset is None else offset[expert]
                out.append(int4.Int4Weights(codes, scale, offsets=offset).dequantize(dtype))
        return out[0], out[1]


def require_format(source, wanted: WeightFormat, where: str, prepared: tuple[type, ...] = ()) -> None:
    """Refuse `source` unless it is experts in `wanted` (or one of the `prepared` forms), naming why.

    What a backend's `prepare` takes is the format its plan names; converting to
    it is the load path's job (`weights.requant.to_format`), never a backend's.
    """
    if prepared and isinstance(source, prepared):
        return
    if not isinstance(source, (Mxfp4Experts, Int4Experts)):
        names = ", ".join(["Mxfp4Experts", "Int4Experts", *(t.__name__ for t in prepared)])
        raise TypeError(f"{where}: prepare() takes {names}, got {type(source).__name__}")
    got = source.format
    if got.kind != wanted.kind:
        raise ValueError(f"{where} runs {wanted.kind} weights; got {got.kind}: weight_format={wanted.kind!r} "
                         f"was given {got.kind} experts (it needs the {wanted.kind.upper()} ones)")
    if got.method != wanted.method:
        raise ValueError(f"{where}: pre-converted experts use int4 method {got.method!r}, "
                         f"but this backend is configured for {wanted.method!r}")
