"""PyTorch backend: dequantise the touched experts one at a time, fp32 matmuls.

Slow but exact to the format and light on memory; it serves CPU machines and
stands behind every GPU backend as the last fallback. With
`weight_format="int4"` it computes what the gfx942 kernels compute.

Quantized activations (`act_dtype="fp8"|"fp4"`) are emulated: the activations
are quantized and dequantized by the formats' CPU quantizers at the two points
where the kernels quantize (`act_quant.ActQuant`), then multiplied in fp32. The
CPU path and the fallback behind a quantized-activation kernel therefore compute
the function that kernel computes, not a more accurate one; it is not faster.
"""
from __future__ import annotations

import torch

from kimi_k3_moe.act_quant import BF16, ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import MXFP4, Int4Experts, Mxfp4Experts, WeightFormat
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.base import MoEBackend
from kimi_k3_moe.kernels.torch import SPEC
from kimi_k3_moe.reference import dense_moe


class TorchBackend(MoEBackend):
    name = "torch"
    spec = SPEC

    def __init__(self, weight_format: str = MXFP4, int4_method: str = int4.DEFAULT_METHOD,
                 compute_dtype: torch.dtype = torch.float32, act_dtype: str = BF16,
                 act_quant: ActQuant | None = None):
        try:
            self.format = WeightFormat.of(weight_format, int4_method)
        except ValueError as exc:
            raise ValueError(f"torch backend: {exc}") from None
        act_quant = act_quant or ActQuant.for_dtype(act_dtype)
        if act_quant.dtype != act_dtype:
            raise ValueError(f"torch backend: act_quant {act_quant} does not match act_dtype {act_dtype!r}")
        self.compute_dtype = compute_dtype
        self.act_quant = act_quant

    def describe(self) -> str:
        act = f", {self.act_quant.tag()} emulated" if self.act_quant.quantizes else ""
        return f"{self.name}[{self.format}{act}]"

    def available(self) -> tuple[bool, str]:
        return True, "PyTorch runs everywhere"

    def lay_out(self, experts: Mxfp4Experts | Int4Experts) -> Mxfp4Experts | Int4Experts:
        """The experts as they are: this backend decodes the formats' own layout."""
        return experts

    def forward(self, prepared, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            if e not in cache:
                cache.clear()  # one expert's float weights alive at a time
                cache[e] = prepared.dequantize(e)
            return cache[e]

        return dense_moe(hidden, lambda e: weights(e)[0], lambda e: weights(e)[1],
                         topk_weights, topk_ids, activation, expert_map,
                         compute_dtype=self.compute_dtype, act_quant=self.act_quant,
                         num_experts=prepared.num_experts, hidden_size=prepared.hidden_size)
