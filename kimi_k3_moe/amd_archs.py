"""One traits object per AMD arch the package builds kernels for: the hardware facts the FlyDSL
kernels, their tile table, the compile targets (FlyDSL and Triton's AOT) and the speed model read.

A new arch is a new `AmdArch` entry here, its tiers in configs/tables/flydsl_tiles.json and, only if
its bf16 MFMA has a new shape, that shape's spelling in kernels/flydsl/_details/device.py
(tests/flydsl/test_arch_files.py holds that list). Figures for the model (CU count, clock, HBM peak)
are AMD's published numbers for the product named, not measurements here.
"""
from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_moe.act_quant import BF16, FP4, FP8
from kimi_k3_moe.experts.format import INT4, MXFP4


@dataclass(frozen=True)
class AmdArch:
    arch: str                            # the LLVM target, "gfx942"
    product: str                         # the GPU the model's figures are for
    mfma: str                            # the bf16 MFMA the kernels issue, "MxNxK" (16x16 tiles)
    weight_formats: tuple[str, ...]      # 4-bit weights its kernels read, the one it multiplies first
    act_dtypes: tuple[str, ...]          # activation dtypes with a matrix instruction (scaled MFMA: fp8/fp4)
    lds_bytes: int                       # LDS per CU
    cus: int
    clock_ghz: float
    hbm_tbs: float                       # peak HBM bandwidth, TB/s
    mfma_cycles: int = 16                # issue cycles of one bf16 MFMA of `mfma` (the model's rate)
    max_waves_per_simd: int = 8
    simds_per_cu: int = 4
    wave_size: int = 64

    @property
    def mfma_k(self) -> int:
        return int(self.mfma.split("x")[-1])

    @property
    def scaled_mfma(self) -> bool:
        """v_mfma_scale_f32_*_f8f6f4: fp8/fp4 operands with e8m0 scales."""
        return FP8 in self.act_dtypes or FP4 in self.act_dtypes


GFX942 = AmdArch("gfx942", "MI300X", mfma="16x16x16", weight_formats=(INT4,), act_dtypes=(BF16,),
                 lds_bytes=64 * 1024, cus=304, clock_ghz=2.1, hbm_tbs=5.3)
GFX950 = AmdArch("gfx950", "MI355X", mfma="16x16x32", weight_formats=(MXFP4, INT4), act_dtypes=(BF16, FP8, FP4),
                 lds_bytes=160 * 1024, cus=256, clock_ghz=2.4, hbm_tbs=8.0)
AMD_ARCHS = {t.arch: t for t in (GFX942, GFX950)}


class UnsupportedArchError(ValueError):
    """An AMD architecture the FlyDSL kernels are not written for."""


def traits(arch: str) -> AmdArch:
    """The traits of `arch`; any other name is refused in one line."""
    if arch not in AMD_ARCHS:
        raise UnsupportedArchError(
            f"FlyDSL MoE kernels exist for {tuple(AMD_ARCHS)} only, not {arch!r} "
            "(gfx942 = MI300X/MI325X with int4 weights, gfx950 = MI355X with MXFP4); "
            "use the triton backend there")
    return AMD_ARCHS[arch]
