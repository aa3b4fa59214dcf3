"""The one interface every kernel backend implements.

Dispatch, the engine plugins, the self-check, tests and benchmarks only
speak this interface: experts in the backend's `WeightFormat` in (the load
path converts them, `weights.requant.to_format`), a backend's own prepared form
in between, the MoE output out.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from kimi_k3_moe.act_quant import BF16_ACTIVATIONS, ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import MXFP4_FORMAT, WeightFormat, require_format
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.spec import BackendUnavailable

if TYPE_CHECKING:
    from kimi_k3_moe.kernels.spec import BackendSpec

__all__ = ["BackendUnavailable", "MoEBackend"]


class MoEBackend(ABC):
    """A kernel family that can run the routed-expert MoE.

    `prepare` lays experts out once, at load; `forward` runs per batch.
    `dequantize_prepared` returns the float weights the prepared form encodes,
    which is what the self-check compares the kernel against. `act_quant` is the
    activation quantization the kernels apply (bf16: none); the self-check's
    reference applies the same.
    """

    name: str = "?"
    spec: BackendSpec  # what it declares (kernels.spec): graph safety, self-check, how to make it
    act_quant: ActQuant = BF16_ACTIVATIONS
    format: WeightFormat | None = MXFP4_FORMAT
    prepared_types: tuple[type, ...] = ()  # its own prepared forms, which `prepare` takes as they are

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(can run here, why or why not)."""

    @property
    def weight_format(self) -> str | None:
        return None if self.format is None else self.format.kind

    @property
    def int4_method(self) -> str:
        return (self.format.method if self.format is not None else None) or int4.DEFAULT_METHOD

    def prepare(self, experts) -> Any:
        """Experts in this backend's `format` (or its own prepared form) -> its prepared form."""
        require_format(experts, self.format, self.describe(), self.prepared_types)
        prepared = experts if isinstance(experts, self.prepared_types) else self.lay_out(experts)
        weight_format = getattr(prepared, "weight_format", self.format.kind)
        if weight_format != self.format.kind:
            raise ValueError(f"{self.describe()}: prepared experts are {weight_format}, "
                             f"the backend runs {self.format.kind}")
        return prepared

    @abstractmethod
    def lay_out(self, experts) -> Any:
        """Experts already in this backend's format -> its prepared form (its layout)."""

    @abstractmethod
    def forward(
        self,
        prepared: Any,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: ActivationSpec,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, H] hidden -> [T, H]: this rank's sum over its experts.

        A (token, slot) whose id is negative, or maps to -1 through
        `expert_map`, names an expert on another rank and contributes nothing.
        """

    def dequantize_prepared(self, prepared: Any, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [2I, H], w2 [H, I]) that the prepared form encodes."""
        return prepared.dequantize(expert)

    def describe(self) -> str:
        return self.name

    def require_available(self) -> None:
        ok, why = self.available()
        if not ok:
            raise BackendUnavailable(f"backend {self.describe()!r} cannot run here: {why}")
