"""The Triton backend: fused MoE kernels over MXFP4 or int4 experts.

Importing this package imports neither triton nor torch's GPU state; the
kernels are loaded when the backend first prepares or runs experts.

Quantized activations (docs/ACT_DTYPE.md): fp8 e4m3 on NVIDIA sm_89 and sm_90+
(the matrix unit multiplies e4m3 by e4m3 there), with one float32 scale per row
at both stages; bf16 everywhere else. No fp4 activations in Triton.
"""
from __future__ import annotations

import re

__all__ = ["act_quant_for", "make_backend", "supported_act_dtypes"]

FP8_MIN_SM = 89


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """("bf16", "fp8") on sm_89 and sm_90+ (sm_90a, sm_100, ... too); ("bf16",) elsewhere."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch or "")
    if match and int(match.group(1)) >= FP8_MIN_SM:
        return ("bf16", "fp8")
    return ("bf16",)


def act_quant_for(arch: str | None, act_dtype: str):
    """fp8: e4m3 with a float32 scale per row at both stages (Hopper's dots take no block scales, so the
    scales go into the epilogue once); bf16: none."""
    from kimi_k3_moe.act_quant import FP8, ActQuant
    if act_dtype == FP8:
        from kimi_k3_moe.act_quant import TOKEN
        return ActQuant(FP8, hidden=TOKEN, inter=TOKEN)
    return ActQuant.for_dtype(act_dtype)


def make_backend(**options):
    from kimi_k3_moe.kernels.triton.backend import TritonBackend
    return TritonBackend(**options)
