"""The Triton backend: fused MoE kernels over MXFP4 or int4 experts.

Importing this package imports neither triton nor torch's GPU state; the
kernels are loaded when the backend first prepares or runs experts.

Activations are bf16 only (docs/ACT_DTYPE.md). The fp8 (e4m3 x e4m3) kernels this
backend had on sm_89/sm_90+ were 1.03-1.69x slower than bf16 on the H200 at every
token count, and the bf16 kernels are not bound by the matrix unit, so a faster
MMA could not pay for the quantization; they were removed (the measurements: `git show 5f27697:docs/PERF.md`,
"fp8 activations in the Triton backend"; the code is in git before that commit).
"""
from __future__ import annotations

from kimi_k3_moe.act_quant import BF16
from kimi_k3_moe.kernels.spec import BackendSpec
from kimi_k3_moe.platform import FLYDSL_ARCHS, TRITON_MIN_SM

__all__ = ["INTERPRETER_ARCH", "SPEC", "make_backend", "supported_act_dtypes"]

INTERPRETER_ARCH = "interpreter"


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """("bf16",) on every arch the backend runs on."""
    return (BF16,)


def _runs_on(platform, weight_format):
    if platform.vendor == "rocm":
        return True, ("fallback behind FlyDSL" if platform.arch in FLYDSL_ARCHS
                      else f"Triton kernels for {platform.arch}")
    if platform.vendor == "cuda" and platform.sm >= TRITON_MIN_SM:
        return True, f"Triton kernels for {platform.arch}"
    return False, f"the Triton kernels need an NVIDIA sm_{TRITON_MIN_SM}+ or AMD GPU, not {platform}"


SPEC = BackendSpec("triton", __name__, _runs_on, user_table="kimi_k3_moe.kernels.triton.table")


def make_backend(**options):
    from kimi_k3_moe.kernels.triton.backend import TritonBackend
    return TritonBackend(**options)
