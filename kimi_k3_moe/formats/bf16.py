"""bfloat16 rounding of exact values.

torch converts float64 to bfloat16 through float32, rounding twice; a value just
above a bf16 tie that float32 rounds onto the tie then goes to even, away from
its nearest bf16. Kernels that round an exact product-sum once (a bf16x2 FMA) are
checked against `round_once`.
"""
from __future__ import annotations

import torch


def round_once(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16, rounded once to nearest even (float32 with round-to-odd, then RNE:
    24 bits are more than the 8 + 2 this needs to round correctly)."""
    x = x.double()
    f = x.float()
    back = f.double()
    bits = f.view(torch.int32)
    # sign-magnitude bits: +1 moves one ulp away from zero, -1 towards it
    step = torch.where(x.abs() > back.abs(), 1, -1).to(torch.int32)
    odd = torch.where((back != x) & ((bits & 1) == 0), bits + step, bits)
    return odd.view(torch.float32).to(torch.bfloat16)
