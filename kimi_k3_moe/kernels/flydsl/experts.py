"""A layer's experts as the FlyDSL kernels read them.

No re-layout: the kernels read the formats' own byte order (MXFP4 as the
checkpoint holds it; int4 as formats/int4.py packs it), so `dequantize` is the
formats' own decoder and the self-check compares against exactly that.
  w13 [E, 2I, H/2] uint8 (gate rows, then up), w2 [E, H, I/2] uint8
  scales [.., K/32]: uint8 e8m0 (MXFP4) or bf16 (int4); offsets bf16 or None (int4 only)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.kernels.base import ExpertWeights, PackedExpertShapes
from kimi_k3_moe.weights.requant import Int4Experts


@dataclass
class FlyDSLExperts(PackedExpertShapes):
    weight_format: str            # "mxfp4" | "int4"
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_offset: torch.Tensor | None = None
    w2_offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.weight_format not in ("mxfp4", "int4"):
            raise ValueError(f"weight_format {self.weight_format!r} must be 'mxfp4' or 'int4'")
        e, two_i, half_h = self.w13.shape
        if tuple(self.w2.shape) != (e, half_h * 2, two_i // 4):
            raise ValueError(f"w2 shape {tuple(self.w2.shape)} does not match w13 {tuple(self.w13.shape)}")
        scale_dtype = torch.uint8 if self.weight_format == "mxfp4" else torch.bfloat16
        for name in ("w13", "w2"):
            codes = getattr(self, name)
            if codes.dtype != torch.uint8 or not codes.is_contiguous():
                raise ValueError(f"FlyDSLExperts.{name} must be contiguous uint8, got {codes.dtype}")
            groups = (*codes.shape[:-1], codes.shape[-1] * 2 // mxfp4.BLOCK_SIZE)
            for suffix, dtype in (("scale", scale_dtype), ("offset", torch.bfloat16)):
                t = getattr(self, f"{name}_{suffix}")
                if t is None and suffix == "offset":
                    continue
                if t.dtype != dtype or tuple(t.shape) != groups or not t.is_contiguous():
                    raise ValueError(f"FlyDSLExperts.{name}_{suffix}: {t.dtype} {tuple(t.shape)}, "
                                     f"expected contiguous {dtype} {groups}")
        if (self.w13_offset is None) != (self.w2_offset is None):
            raise ValueError("int4 offsets must be given for both w13 and w2 or for neither")
        if self.w13_offset is not None and self.weight_format != "int4":
            raise ValueError("MXFP4 experts carry no offsets")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mxfp4(cls, experts: ExpertWeights) -> "FlyDSLExperts":
        for name, scale in (("w13_scale", experts.w13_scale), ("w2_scale", experts.w2_scale)):
            nan = int((scale == mxfp4.E8M0_NAN).sum())
            if nan:
                raise ValueError(f"ExpertWeights.{name} holds {nan} NaN scale byte(s) (0xFF)")
        return cls("mxfp4", experts.w13_packed.contiguous(), experts.w13_scale.contiguous(),
                   experts.w2_packed.contiguous(), experts.w2_scale.contiguous())

    @classmethod
    def from_int4(cls, experts: Int4Experts) -> "FlyDSLExperts":
        def opt(t):
            return None if t is None else t.contiguous()
        return cls("int4", experts.w13.packed.contiguous(), experts.w13.scales.contiguous(),
                   experts.w2.packed.contiguous(), experts.w2.scales.contiguous(),
                   opt(experts.w13.offsets), opt(experts.w2.offsets))

    # ------------------------------------------------------------------ shape
    @property
    def has_offsets(self) -> bool:
        return self.w13_offset is not None

    def tensors(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, offsets) of "w13" or "w2", flat as the kernels take them.

        Without offsets a one-element bf16 tensor fills the offsets argument: never read,
        but of the dtype the kernels were specialised for."""
        codes, scale = getattr(self, which), getattr(self, f"{which}_scale")
        offset = getattr(self, f"{which}_offset")
        if offset is None:
            offset = torch.zeros(1, dtype=torch.bfloat16, device=codes.device)
        return codes.reshape(-1), scale.reshape(-1), offset.reshape(-1)

    # ------------------------------------------------------------------ values
    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [2I, H], w2 [H, I]) of one expert, as the formats define them."""
        if self.weight_format == "mxfp4":
            return (mxfp4.dequantize(self.w13[expert], self.w13_scale[expert], name=f"w13[{expert}]"),
                    mxfp4.dequantize(self.w2[expert], self.w2_scale[expert], name=f"w2[{expert}]"))

        def one(codes, scales, offsets):
            return int4.Int4Weights(codes, scales, offsets=offsets).dequantize()
        o13 = None if self.w13_offset is None else self.w13_offset[expert]
        o2 = None if self.w2_offset is None else self.w2_offset[expert]
        return (one(self.w13[expert], self.w13_scale[expert], o13), one(self.w2[expert], self.w2_scale[expert], o2))
