"""FlyDSL MoE kernels for gfx942 (packed int4) and gfx950 (MXFP4).

Compiled for gfx942 and gfx950; never run on AMD hardware here (docs/FLYDSL.md).

Public modules: `config` (one kernel specialisation), `tiles` (tile table and
lookup), `layout` (index and decode arithmetic shared by the kernels and the CPU
emulator), `align` (token alignment), `experts` (the prepared weights),
`pipeline` (the forward pass around the kernels), `emulator` (CPU stand-in for
the kernels), `build` / `toolchain` / `artifacts` / `sweep` (compiling and
inspecting), `backend` (the MoEBackend). Kernel bodies live in `_details/`.
Importing this package does not import flydsl.
"""
from __future__ import annotations


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """gfx950: bf16, fp8 and fp4 activations; gfx942 (no scaled MFMA): bf16 only."""
    from kimi_k3_moe.kernels.flydsl.config import ACT_DTYPES
    return ACT_DTYPES.get(arch, ("bf16",))


def make_backend(**options):
    """`get_backend("flydsl", arch=..., weight_format=..., act_dtype=...)` lands here."""
    from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
    return FlyDSLBackend(**options)
