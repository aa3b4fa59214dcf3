"""FlyDSL MoE kernels for gfx942 (packed int4) and gfx950 (MXFP4).

Compiled for gfx942 and gfx950; never run on AMD hardware here (docs/FLYDSL.md).

Public modules: `config` (one kernel specialisation), `tiles` (tile table and
lookup), `layout` (index and decode arithmetic shared by the kernels and the CPU
emulator), `experts` (the prepared weights),
`pipeline` (the forward pass around the kernels), `build` / `toolchain` /
`code_object` (compiling, and what a compiled kernel holds), `backend` (the
MoEBackend). Kernel bodies live in `_details/`; the alignment and the top-k sum
around them in kernels/common/. The CPU emulator, the ISA reader and speed
model, and the CI sweep are development tools: k3lab/flydsl/.
Importing this package does not import flydsl.
"""
from __future__ import annotations

from kimi_k3_moe.act_quant import BF16
from kimi_k3_moe.experts.format import INT4, MXFP4
from kimi_k3_moe.kernels.spec import BackendSpec
from kimi_k3_moe.platform import FLYDSL_ARCHS, hardware_act_dtypes, weight_formats

__all__ = ["SPEC", "make_backend", "supported_act_dtypes", "supported_weight_formats"]


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """gfx950: bf16, fp8 and fp4 activations (its scaled MFMA); gfx942 (none): bf16 only."""
    return hardware_act_dtypes(arch) if arch in FLYDSL_ARCHS else (BF16,)


def supported_weight_formats(arch: str | None) -> tuple[str, ...]:
    """gfx942: int4 (no FP4 path); gfx950: MXFP4 and int4; elsewhere none."""
    return weight_formats(arch) if arch in FLYDSL_ARCHS else ()


def _runs_on(platform, weight_format):
    if platform.vendor != "rocm" or platform.arch not in FLYDSL_ARCHS:
        return False, f"FlyDSL kernels exist for {FLYDSL_ARCHS} only and this machine is {platform}"
    formats = supported_weight_formats(platform.arch)
    if weight_format not in formats:
        return False, f"FlyDSL kernels on {platform.arch} read {' or '.join(formats)} weights, not {weight_format}"
    if weight_format == MXFP4:
        return True, f"{platform.arch} runs MXFP4 weights directly"
    if platform.weight_format == INT4:
        return True, f"no FP4 MFMA on {platform.arch}: experts requantised to int4"
    return True, f"int4 weights on {platform.arch} (requantised from MXFP4)"


def _act_dtypes(platform, weight_format):
    # quantized activations run on the scaled MFMA, which reads e2m1 weights
    return supported_act_dtypes(platform.arch) if weight_format == MXFP4 else (BF16,)


SPEC = BackendSpec("flydsl", __name__, _runs_on, act_dtypes=_act_dtypes, arch_bound=True,
                   options=lambda platform, weight_format: {"arch": platform.arch},
                   user_table="kimi_k3_moe.kernels.flydsl.tiles")


def make_backend(**options):
    """`get_backend("flydsl", arch=..., weight_format=..., act_dtype=...)` lands here."""
    from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
    return FlyDSLBackend(**options)
