"""`WeightFormat`: what the 4-bit codes of a layer's experts mean.

  mxfp4            e2m1 codes with an e8m0 scale byte per 32 (the checkpoint's own format)
  int4/<method>    two's-complement int4 with a bf16 scale per 32 (gfx942), converted from
                   MXFP4 by <method>; with offsets when the method fits one per group

Backends and the plan name formats by these values, so a method is never lost
between the plan, the conversion and a backend.
"""
from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_moe.formats import int4

MXFP4 = "mxfp4"
INT4 = "int4"
KINDS = (MXFP4, INT4)


@dataclass(frozen=True)
class WeightFormat:
    kind: str                  # "mxfp4" | "int4"
    method: str | None = None  # int4 only: the conversion recipe (formats.int4.METHODS)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"weight_format {self.kind!r} not in {KINDS}")
        if self.kind == MXFP4 and self.method is not None:
            raise ValueError(f"mxfp4 weights have no int4 method (got {self.method!r})")
        if self.kind == INT4 and self.method not in int4.METHODS:
            raise ValueError(f"int4_method {self.method!r} not in {int4.METHODS}")

    @classmethod
    def of(cls, kind: str, int4_method: str = int4.DEFAULT_METHOD) -> WeightFormat:
        """The format a backend option pair (weight_format, int4_method) names."""
        if kind not in KINDS:
            raise ValueError(f"weight_format {kind!r} not in {KINDS}")
        if int4_method not in int4.METHODS:
            raise ValueError(f"int4_method {int4_method!r} not in {int4.METHODS}")
        return cls(kind, int4_method if kind == INT4 else None)

    @property
    def has_offsets(self) -> bool:
        return self.kind == INT4 and self.method in int4.OFFSET_METHODS

    def __str__(self) -> str:
        return f"{self.kind}/{self.method}" if self.kind == INT4 else self.kind


MXFP4_FORMAT = WeightFormat(MXFP4)
