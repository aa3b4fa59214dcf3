"""Load-time conversion of a layer's MXFP4 experts to packed int4 (gfx942).

A real layer is ~2 GB per rank and a model has 92 of them, so conversion
runs in expert chunks on the tensors' own device, with a progress bar and a
bounded amount of scratch memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.base import ExpertWeights


@dataclass
class Int4Experts:
    """A layer's experts after conversion: w13 [E, 2I, H] and w2 [E, H, I] in int4."""

    w13: int4.Int4Weights
    w2: int4.Int4Weights

    @property
    def num_experts(self) -> int:
        return self.w13.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[expert].dequantize(), self.w2[expert].dequantize()


def requantize_experts(
    experts: ExpertWeights,
    *,
    method: str = "amax",
    chunk_bytes: int = 256 << 20,
    progress: bool = True,
    desc: str = "MXFP4 -> int4",
) -> Int4Experts:
    """Convert every expert of `experts`; scratch memory stays near `chunk_bytes`."""
    total = 2 * experts.num_experts
    with tqdm(total=total, desc=desc, unit="expert", disable=not progress, leave=False) as bar:
        w13 = int4.requantize(experts.w13_packed, experts.w13_scale, method=method,
                              name="w13", chunk_bytes=chunk_bytes, progress=bar.update)
        w2 = int4.requantize(experts.w2_packed, experts.w2_scale, method=method,
                             name="w2", chunk_bytes=chunk_bytes, progress=bar.update)
    return Int4Experts(w13, w2)
