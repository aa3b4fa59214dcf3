"""The Triton backend: fused MoE kernels over MXFP4 or int4 experts.

Importing this package imports neither triton nor torch's GPU state; the
kernels are loaded when the backend first prepares or runs experts.

Quantized activations (docs/ACT_DTYPE.md): fp8 e4m3 on NVIDIA sm_89 and sm_90+
(the matrix unit multiplies e4m3 by e4m3 there), with one float32 scale per row
at both stages; bf16 everywhere else. No fp4 activations in Triton. Triton's CPU
interpreter (arch "interpreter", TRITON_INTERPRET=1) runs the fp8 kernels' arithmetic
exactly, so it runs fp8 too (tests).
"""
from __future__ import annotations

from kimi_k3_moe.act_quant import BF16, FP8, TOKEN, ActQuant
from kimi_k3_moe.experts.format import MXFP4
from kimi_k3_moe.kernels.spec import BackendSpec
from kimi_k3_moe.platform import FLYDSL_ARCHS, FP8_MIN_SM, TRITON_MIN_SM, sm_version

__all__ = ["INTERPRETER_ARCH", "SPEC", "act_quant_for", "make_backend", "supported_act_dtypes"]

INTERPRETER_ARCH = "interpreter"


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """("bf16", "fp8") on sm_89 and sm_90+ (sm_90a, sm_100, ... too) and the interpreter; ("bf16",) elsewhere."""
    return (BF16, FP8) if arch == INTERPRETER_ARCH or sm_version(arch) >= FP8_MIN_SM else (BF16,)


def act_quant_for(arch: str | None, act_dtype: str) -> ActQuant:
    """fp8: e4m3 with a float32 scale per row at both stages (Hopper's dots take no block scales, so the
    scales go into the epilogue once); bf16: none."""
    if act_dtype == FP8:
        return ActQuant(FP8, hidden=TOKEN, inter=TOKEN)
    return ActQuant.for_dtype(act_dtype)


def _runs_on(platform, weight_format):
    if platform.vendor == "rocm":
        return True, ("fallback behind FlyDSL" if platform.arch in FLYDSL_ARCHS
                      else f"Triton kernels for {platform.arch}")
    if platform.vendor == "cuda" and platform.sm >= TRITON_MIN_SM:
        return True, f"Triton kernels for {platform.arch}"
    return False, f"the Triton kernels need an NVIDIA sm_{TRITON_MIN_SM}+ or AMD GPU, not {platform}"


def _act_dtypes(platform, weight_format):
    # the fp8 kernels read MXFP4 weights (e2m1 is exact in e4m3)
    return supported_act_dtypes(platform.arch) if weight_format == MXFP4 else (BF16,)


SPEC = BackendSpec("triton", __name__, _runs_on, act_dtypes=_act_dtypes, act_quant_for=act_quant_for)


def make_backend(**options):
    from kimi_k3_moe.kernels.triton.backend import TritonBackend
    return TritonBackend(**options)
