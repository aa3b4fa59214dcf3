"""Quantized activations: the opt-in setting, and what each choice computes.

By default the experts multiply bf16 activations by 4-bit weights. A user may
opt in to quantized activations with `KIMI_K3_MOE_ACT_DTYPE=fp8|fp4` (or
`get_backend(..., act_dtype=...)`): the stage-1 input (the hidden rows) and the
stage-2 input (the activated intermediate, quantized right after SiTUv2/SiLU)
are then fp8 e4m3 or MXFP4 with scales. Which backend supports which choice on
which architecture is declared by each backend package (`supported_act_dtypes`);
an unsupported combination is refused when the plugin loads, never replaced by
another choice.

`ActQuant` names the exact scheme (element type and scale granularity per
stage). A backend exposes the scheme it applies as `backend.act_quant`, and the
reference (`reference.dense_moe(..., act_quant=...)`) and the load-time
self-check apply the same CPU quantizer at the same two points, so errors are
measured against the function the kernels are meant to compute.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.formats import fp8, mxfp4

ENV_ACT_DTYPE = settings.ACT_DTYPE
BF16, FP8, FP4 = settings.ACT_DTYPES
ACT_DTYPES = settings.ACT_DTYPES
BLOCK32, TOKEN = "block32", "token"   # e8m0 byte per 32 elements | float32 per row
SCALINGS = (BLOCK32, TOKEN)
STAGES = ("hidden", "inter")          # stage-1 input, stage-2 input


class UnsupportedActDtype(ValueError):
    """An activation dtype the chosen backend or machine does not run (never substituted)."""


def resolve_act_dtype(value: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The act dtype asked for: `value` when given, else $KIMI_K3_MOE_ACT_DTYPE, else bf16."""
    if value is None:
        return settings.choice(ENV_ACT_DTYPE, env)
    if value not in ACT_DTYPES:
        raise ValueError(f"act_dtype={value!r} is not an activation dtype; choose one of {ACT_DTYPES}")
    return value


def check_supported(backend: str, arch: str | None, act_dtype: str, supported: tuple[str, ...]) -> str:
    """`act_dtype` if `supported` holds it; otherwise an error naming the arch and the choices."""
    act_dtype = resolve_act_dtype(act_dtype)
    if act_dtype not in supported:
        where = arch or "this machine (no GPU arch)"
        raise UnsupportedActDtype(
            f"act_dtype={act_dtype!r} ({ENV_ACT_DTYPE}) is not available with the {backend} backend on "
            f"{where}; supported there: {', '.join(supported) or 'none'}")
    return act_dtype


@dataclass(frozen=True)
class ActQuant:
    """How activations are quantized at the two GEMM inputs.

    dtype "bf16": not quantized. "fp8": e4m3fn elements, scaled per 1x32 block
    (e8m0 byte, `formats.fp8.quantize_mx`) or per token (float32,
    `formats.fp8.quantize_per_token`), chosen per stage. "fp4": MXFP4 (e2m1 with
    an e8m0 byte per 32, `formats.mxfp4.quantize`) at both stages.
    """

    dtype: str = BF16
    hidden: str = BLOCK32
    inter: str = BLOCK32

    def __post_init__(self) -> None:
        if self.dtype not in ACT_DTYPES:
            raise ValueError(f"ActQuant.dtype {self.dtype!r} not in {ACT_DTYPES}")
        for stage in STAGES:
            if getattr(self, stage) not in SCALINGS:
                raise ValueError(f"ActQuant.{stage} scaling {getattr(self, stage)!r} not in {SCALINGS}")
        if self.dtype == FP4 and (self.hidden, self.inter) != (BLOCK32, BLOCK32):
            raise ValueError("fp4 activations are MXFP4: per-1x32 e8m0 scales at both stages")

    @classmethod
    def for_dtype(cls, dtype: str) -> ActQuant:
        """The default scheme of each dtype: per-1x32 e8m0 scales (what gfx950's scaled MFMA reads)."""
        return cls(resolve_act_dtype(dtype))

    @property
    def quantizes(self) -> bool:
        return self.dtype != BF16

    def tag(self) -> str:
        """Short name for logs and backend descriptions: bf16, a8 (block32), a8tok, a8tok-mx, a4."""
        if self.dtype == BF16:
            return BF16
        if self.dtype == FP4:
            return "a4"
        names = {BLOCK32: "", TOKEN: "tok"}
        if self.hidden == self.inter:
            return "a8" + names[self.hidden]
        return f"a8{names[self.hidden] or 'mx'}-{names[self.inter] or 'mx'}"

    def __str__(self) -> str:
        if not self.quantizes:
            return BF16
        if self.dtype == FP4:
            return "fp4 (MXFP4, e8m0 per 32)"
        desc = {BLOCK32: "e8m0 per 32", TOKEN: "fp32 per token"}
        return f"fp8 e4m3 (hidden {desc[self.hidden]}, intermediate {desc[self.inter]})"

    # ------------------------------------------------------------------ arithmetic
    def quantize(self, x: torch.Tensor, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., K] -> (codes, scales) at `stage` ("hidden" or "inter"), from float32 values.

        fp8: uint8 e4m3 codes [..., K] with uint8 e8m0 [..., K/32] or float32 [..., 1];
        fp4: packed uint8 [..., K/2] (element 2j in the low nibble) and uint8 e8m0 [..., K/32].
        """
        scaling = self._scaling(stage)
        name = f"{stage} activations"
        if self.dtype == FP4:
            return mxfp4.quantize(x.to(torch.float32), name=name)
        if self.dtype == FP8:
            if scaling == BLOCK32:
                return fp8.quantize_mx(x, name=name)
            return fp8.quantize_per_token(x, name=name)
        raise ValueError("bf16 activations are not quantized")

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, stage: str) -> torch.Tensor:
        """float32 values that (codes, scales) of `stage` encode."""
        scaling = self._scaling(stage)
        name = f"{stage} activations"
        if self.dtype == FP4:
            return mxfp4.dequantize(codes, scales, name=name)
        if scaling == BLOCK32:
            return fp8.dequantize_mx(codes, scales, name=name)
        return fp8.dequantize_per_token(codes, scales, name=name)

    def fake_quant(self, x: torch.Tensor, stage: str) -> torch.Tensor:
        """x rounded to what the kernels feed the matrix unit at `stage`, in x's dtype.

        Rounds through float32 first: the kernels quantize float32 values.
        """
        if not self.quantizes:
            return x
        return self.dequantize(*self.quantize(x, stage), stage).to(x.dtype)

    def _scaling(self, stage: str) -> str:
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r} not in {STAGES}")
        return getattr(self, stage)


BF16_ACTIVATIONS = ActQuant()
