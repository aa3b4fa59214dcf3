"""A layer's experts as the FlyDSL kernels read them.

No re-layout: the kernels read the formats' own byte order (MXFP4 as the
checkpoint holds it; int4 as formats/int4.py packs it), so the layout is the
checkpoint's and `dequantize` is the formats' own decoder, which the self-check
compares against. Every tensor must be contiguous: the kernels take flat buffers.
  w13 [E, 2I, H/2] uint8 (gate rows, then up), w2 [E, H, I/2] uint8
  scales [.., K/32]: uint8 e8m0 (MXFP4) or bf16 (int4); offsets bf16 or None (int4 only)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kimi_k3_moe.experts import PackedExperts


@dataclass
class FlyDSLExperts(PackedExperts):
    contiguous: ClassVar[bool] = True

    def kernel_args(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, offsets) of "w13" or "w2", flat as the kernels take them.

        Without offsets a one-element bf16 tensor fills the offsets argument: never read (so left
        uninitialised: filling it would be a launch per forward), but of the dtype the kernels were
        specialised for."""
        codes, scale = getattr(self, which), getattr(self, f"{which}_scale")
        offset = getattr(self, f"{which}_offset")
        if offset is None:
            offset = torch.empty(1, dtype=torch.bfloat16, device=codes.device)
        return codes.reshape(-1), scale.reshape(-1), offset.reshape(-1)
