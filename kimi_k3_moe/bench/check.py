"""The check every timed candidate passes first: close to the float reference of its function,
finite, and (for SiTUv2) clearly away from what SiLU would give."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.reference import relative_l2

REL_L2_BOUND = 1e-2   # bf16 operands and outputs against an fp32 reference (METHOD: 1e-3 .. 1e-2)
SILU_MARGIN = 10.0    # the SiLU reference must sit this many bounds away, or the check cannot tell


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rel_l2: float
    why: str = ""


def judge(out: torch.Tensor, ref: torch.Tensor, silu_ref: torch.Tensor | None = None,
          bound: float = REL_L2_BOUND) -> Verdict:
    if out.shape != ref.shape:
        return Verdict(False, float("nan"), f"output shape {tuple(out.shape)} != {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return Verdict(False, float("nan"), "output has NaN/Inf")
    err = relative_l2(out.float(), ref.float())
    if not err <= bound:  # NaN too (a non-finite reference): never a pass
        why = f"rel L2 {err:.2e} > {bound:.2g}"
        if silu_ref is not None and relative_l2(out.float(), silu_ref.float()) <= bound:
            why += " (it matches SiLU: the activation was ignored)"
        return Verdict(False, err, why)
    if silu_ref is not None:
        gap = relative_l2(silu_ref.float(), ref.float())
        if gap <= SILU_MARGIN * bound:
            return Verdict(False, err, f"SiLU and SiTUv2 references differ by only {gap:.2e}: the data "
                                       "cannot tell them apart")
    return Verdict(True, err)
