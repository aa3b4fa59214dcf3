"""`Int4Experts`: a layer's experts after conversion to packed int4 (what gfx942's kernels read)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.experts.format import INT4, WeightFormat
from kimi_k3_moe.formats import int4


@dataclass
class Int4Experts:
    """A layer's experts after conversion: w13 [E, 2I, H] and w2 [E, H, I] in int4."""

    w13: int4.Int4Weights
    w2: int4.Int4Weights

    def __post_init__(self) -> None:
        e, two_i, h = self.w13.shape
        if self.w13.packed.dim() != 3 or two_i % 2:
            raise ValueError(f"Int4Experts.w13 must be [E, 2I, H], got {self.w13.shape}")
        if self.w2.shape != (e, h, two_i // 2):
            raise ValueError(f"Int4Experts.w2 shape {self.w2.shape} != {(e, h, two_i // 2)} "
                             f"(from w13 {self.w13.shape})")
        if self.w13.method != self.w2.method:
            raise ValueError(f"Int4Experts mixes methods: w13 {self.w13.method!r}, w2 {self.w2.method!r}")

    @property
    def method(self) -> str:
        return self.w13.method

    @property
    def format(self) -> WeightFormat:
        return WeightFormat(INT4, self.method)

    @property
    def num_experts(self) -> int:
        return self.w13.packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.packed.device

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for w in (self.w13, self.w2) for t in (w.packed, w.scales, w.offsets) if t is not None)

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[expert].dequantize(), self.w2[expert].dequantize()

    def select(self, experts) -> Int4Experts:
        """The experts at these local indices (a list, tensor or slice)."""
        return Int4Experts(self.w13[experts], self.w2[experts])

    def to(self, device: torch.device | str) -> Int4Experts:
        return Int4Experts(self.w13.to(device), self.w2.to(device))
