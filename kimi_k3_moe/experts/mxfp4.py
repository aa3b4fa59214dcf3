"""`Mxfp4Experts`: a layer's experts in MXFP4, exactly as checkpoints hold them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.experts.format import MXFP4_FORMAT
from kimi_k3_moe.experts.shapes import PackedShapes
from kimi_k3_moe.formats import mxfp4


@dataclass
class Mxfp4Experts(PackedShapes):
    """A layer's (or a rank's share of a layer's) experts in MXFP4, as checkpoints hold them.

    w13 rows [0, I) are the gate (checkpoint w1), rows [I, 2I) the up half (w3).
    """

    w13_packed: torch.Tensor  # uint8 [E, 2I, H/2]
    w13_scale: torch.Tensor   # uint8 [E, 2I, H/32]
    w2_packed: torch.Tensor   # uint8 [E, H, I/2]
    w2_scale: torch.Tensor    # uint8 [E, H, I/32]

    format = MXFP4_FORMAT
    W13_FIELD = "w13_packed"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for field in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            t = getattr(self, field)
            if t.dtype != torch.uint8:
                raise TypeError(f"Mxfp4Experts.{field} must be uint8, got {t.dtype}")
            if t.dim() != 3:
                raise ValueError(f"Mxfp4Experts.{field} must be 3-D [E, N, K'], got {tuple(t.shape)}")
        e, two_i, half_h = self.w13_packed.shape
        if two_i % 2:
            raise ValueError(f"Mxfp4Experts.w13_packed rows ({two_i}) must be 2*I")
        h, i = half_h * 2, two_i // 2
        expected = {
            "w13_scale": (e, two_i, h // mxfp4.BLOCK_SIZE),
            "w2_packed": (e, h, i // 2),
            "w2_scale": (e, h, i // mxfp4.BLOCK_SIZE),
        }
        if h % mxfp4.BLOCK_SIZE or i % mxfp4.BLOCK_SIZE:
            raise ValueError(f"hidden {h} and intermediate {i} must be multiples of {mxfp4.BLOCK_SIZE}")
        for field, shape in expected.items():
            if tuple(getattr(self, field).shape) != shape:
                raise ValueError(f"Mxfp4Experts.{field} shape {tuple(getattr(self, field).shape)} "
                                 f"!= {shape} (from w13_packed {tuple(self.w13_packed.shape)})")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)

    def to(self, device: torch.device | str) -> Mxfp4Experts:
        return Mxfp4Experts(*(t.to(device) for t in self.tensors()))

    def select(self, experts) -> Mxfp4Experts:
        """The experts at these local indices (a list, tensor or slice)."""
        return Mxfp4Experts(*(t[experts] for t in self.tensors()))

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [2I, H], w2 [H, I]) of one expert."""
        return (mxfp4.dequantize(self.w13_packed[expert], self.w13_scale[expert], name=f"w13[{expert}]"),
                mxfp4.dequantize(self.w2_packed[expert], self.w2_scale[expert], name=f"w2[{expert}]"))


