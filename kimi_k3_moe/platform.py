"""What GPU this is, read once, and the facts that follow from its hardware, stated once.

  vendor "cpu" | "cuda" | "rocm"; arch "sm_90", "gfx942", ...; capability (major, minor) on CUDA
  gfx942 (MI300X/MI325X): no FP4 matrix instructions, so its kernels read int4 (requantised at load)
  gfx950 (MI355X): scaled MFMA reads e2m1/e4m3 operands: MXFP4 weights, fp8 and fp4 activations
  CUDA sm_80+: the Triton kernels' floor; sm_89 and sm_90+: e4m3 x e4m3 MMA (fp8 activations)

Backends ask these functions instead of reading torch's device properties or
parsing arch names themselves. Imports torch only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import torch

from kimi_k3_moe.act_quant import BF16, FP8
from kimi_k3_moe.amd_archs import AMD_ARCHS
from kimi_k3_moe.experts.format import INT4, MXFP4

FLYDSL_ARCHS = tuple(AMD_ARCHS)       # archs with FlyDSL kernels (amd_archs: one traits object each)
INT4_ARCHS = tuple(a for a, t in AMD_ARCHS.items() if MXFP4 not in t.weight_formats)   # experts requantised
TRITON_MIN_SM = 80
FP8_MIN_SM = 89                       # e4m3 x e4m3 MMA (sm_89, sm_90 and newer)
PDL_MIN_SM = 90                       # programmatic dependent launch (griddepcontrol)
LDS_PER_CU = {a: t.lds_bytes for a, t in AMD_ARCHS.items()}
SHARED_PER_BLOCK = {"sm_90": 227 * 1024, **LDS_PER_CU}     # what one block may use (H100/H200: 227 KB)


@dataclass(frozen=True)
class SmLimits:
    """What one NVIDIA SM holds, for counting blocks per SM (CUDA's occupancy rules)."""
    registers: int = 65536
    register_unit: int = 256      # registers are given to a warp in units of 256 (8 per thread)
    warps: int = 64
    blocks: int = 32
    shared: int = 228 * 1024
    shared_reserved: int = 1024   # per block, kept by the driver


SM_LIMITS = {"sm_90": SmLimits()}


@dataclass(frozen=True)
class Platform:
    vendor: str              # "cpu", "cuda" or "rocm"
    arch: str | None = None  # "sm_90", "gfx942", ...
    device_name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def sm(self) -> int:
        """CUDA compute capability as one number (90 for sm_90), 0 elsewhere."""
        return sm_version(self.arch) if self.vendor == "cuda" else 0

    @property
    def weight_format(self) -> str:
        """The 4-bit format this hardware multiplies: int4 where there is no FP4 path, else MXFP4."""
        return weight_formats(self.arch)[0]

    def __str__(self) -> str:
        return self.vendor if not self.is_gpu else f"{self.vendor} {self.arch} ({self.device_name})"


def gfx_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    return gcn_arch_name.split(":", 1)[0]


def sm_version(arch: str | None) -> int:
    """'sm_90' / 'sm_90a' -> 90; anything else -> 0."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch or "")
    return int(match.group(1)) if match else 0


def is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def arch_of(props) -> str:
    """The arch name of a torch device-properties object."""
    return gfx_arch(props.gcnArchName) if is_rocm() else f"sm_{props.major}{props.minor}"


def for_arch(arch: str | None) -> Platform:
    """The platform an arch name stands for: "gfx*" ROCm, "sm_*" CUDA, anything else (None, a
    software target such as Triton's interpreter) the CPU, keeping the name."""
    if arch and arch.startswith("gfx"):
        return Platform("rocm", arch)
    return Platform("cuda", arch) if sm_version(arch) else Platform("cpu", arch)


def device_platform(device: int = 0) -> Platform:
    if not torch.cuda.is_available():
        return Platform("cpu")
    props = torch.cuda.get_device_properties(device)
    return Platform("rocm" if is_rocm() else "cuda", arch_of(props), props.name)


@cache
def detect_platform(device: int = 0) -> Platform:
    """This process's GPU `device` (read once), or the CPU."""
    return device_platform(device)


def weight_formats(arch: str | None) -> tuple[str, ...]:
    """4-bit weight formats kernels on `arch` can read, the one it multiplies first: an AMD arch's
    traits say (int4 alone where there is no FP4 path), elsewhere MXFP4 and int4 (integer decode)."""
    return AMD_ARCHS[arch].weight_formats if arch in AMD_ARCHS else (MXFP4, INT4)


def hardware_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """Activation dtypes whose matrix instructions `arch` has (bf16 everywhere)."""
    if arch in AMD_ARCHS:
        return AMD_ARCHS[arch].act_dtypes
    if sm_version(arch) >= FP8_MIN_SM:
        return (BF16, FP8)
    return (BF16,)
